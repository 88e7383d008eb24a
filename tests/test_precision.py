"""Precision policy per device, autocast/GradScaler behaviour on the CPU, backend flags."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch import nn

from vidtune.trainer.training import precision
from vidtune.trainer.training.precision import (
    BY_SUPPORT,
    PrecisionPolicy,
    choose_precision,
    configure_backends,
    decide_precision,
    trial_precision,
)


@pytest.mark.parametrize("requested, device_type, capability, expected", [
    ("auto", "cuda", (7, 5), (torch.float16, True)),      # T4: fp16 + loss scaling
    ("auto", "cuda", (7, 0), (torch.float16, True)),      # V100
    ("auto", "cuda", (8, 0), (torch.bfloat16, False)),    # A100: bf16, no scaler
    ("auto", "cuda", (9, 0), (torch.bfloat16, False)),    # H100
    ("auto", "cpu", None, (torch.float32, False)),
    ("fp32", "cuda", (9, 0), (torch.float32, False)),
    ("fp16", "cuda", (9, 0), (torch.float16, True)),
    ("bf16", "cpu", None, (torch.bfloat16, False)),
    ("fp16", "cpu", None, (torch.float16, True)),         # honoured: CPU fp16 autocast + GradScaler("cpu")
])
def test_decide_precision(requested, device_type, capability, expected):
    assert decide_precision(requested, device_type, capability) == expected


def test_bf16_on_old_gpu_is_refused():
    with pytest.raises(ValueError, match=r"bf16 needs .* >= 8.0.*this one is 7.5.*--precision fp16"):
        decide_precision("bf16", "cuda", (7, 5))


def test_unknown_precision_names_the_flag():
    with pytest.raises(ValueError, match=r"unknown precision 'half'.*auto, fp32, fp16, bf16.*--precision"):
        choose_precision("half", "cpu")


def test_choose_precision_reads_the_device_capability(monkeypatch):
    asked = []
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d: asked.append(d) or (7, 5))
    policy = choose_precision("auto", "cuda:1")
    assert policy == PrecisionPolicy("auto", torch.float16, True, "cuda")
    assert policy.name == "fp16" and asked == [torch.device("cuda:1")]


@pytest.mark.parametrize("requested, lowest, recorded, expected", [
    ("auto", "bf16", None, "bf16"),      # a fresh run on Ampere or newer
    ("auto", "fp16", None, "fp16"),      # a T4 among the ranks: fp16 for every rank
    ("auto", "bf16", "fp16", "fp16"),    # an fp16 trial (begun on a T4) resumed on H100s stays fp16
    ("auto", "bf16", "bf16", "bf16"),
    ("auto", "fp16", "bf16", "fp16"),    # a bf16 trial resumed where a T4 is: fp16 (a fresh scaler)
    ("auto", "bf16", "fp32", "fp32"),    # trained in fp32: every device runs it
    ("auto", "fp32", "fp16", "fp32"),    # on the CPU auto never picks fp16
    ("fp16", "fp16", "bf16", "fp16"),    # forced: what was asked, on every rank
])
def test_trial_precision(requested, lowest, recorded, expected):
    assert trial_precision(requested, lowest, recorded) == expected


def test_ranks_on_different_gpu_types_agree_on_one_precision(monkeypatch):
    """An A100 and a T4 in one run: alone each would train in its own precision (bf16, fp16 with
    a scaler); the run's is the lowest of the two, for both."""
    capability = {0: (8, 0), 1: (7, 5)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d: capability[torch.device(d).index])
    mine = [choose_precision("auto", f"cuda:{i}").name for i in capability]
    assert mine == ["bf16", "fp16"]
    lowest = min(mine, key=BY_SUPPORT.index)
    assert trial_precision("auto", lowest) == "fp16"
    assert trial_precision("auto", lowest, recorded="bf16") == "fp16"


def test_cpu_auto_is_fp32_with_autocast_off():
    policy = choose_precision("auto", torch.device("cpu"))
    assert (policy.name, policy.use_scaler, policy.device_type) == ("fp32", False, "cpu")
    a = torch.randn(4, 4)
    with policy.autocast():
        assert not torch.is_autocast_enabled("cpu")
        assert (a @ a).dtype == torch.float32


def test_bf16_autocast_trains_on_cpu():
    torch.manual_seed(0)
    policy = choose_precision("bf16", "cpu")
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 2))
    x, y = torch.randn(8, 16), torch.randint(0, 2, (8,))
    with policy.autocast():
        logits = model(x)
        loss = nn.functional.cross_entropy(logits, y)
    assert logits.dtype == torch.bfloat16 and loss.dtype == torch.float32   # CE autocasts to fp32
    loss.backward()
    assert torch.isfinite(loss) and all(p.grad.dtype == torch.float32 for p in model.parameters())


def test_disabled_scaler_is_a_no_op():
    policy = choose_precision("fp32", "cpu")
    scaler = policy.make_scaler()
    assert not scaler.is_enabled()
    model = nn.Linear(3, 1)
    loss = model(torch.ones(2, 3)).sum()
    assert scaler.scale(loss) is loss
    loss.backward()
    grad = model.weight.grad.clone()
    weight = model.weight.detach().clone()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler.unscale_(optimizer)
    assert torch.equal(model.weight.grad, grad)
    scaler.step(optimizer)
    scaler.update()
    assert torch.allclose(model.weight, weight - 0.1 * grad)


def test_fp16_scaler_on_cpu_scales_and_unscales():
    policy = choose_precision("fp16", "cpu")
    scaler = policy.make_scaler()
    assert scaler.is_enabled() and scaler.get_scale() == 2.0 ** 16
    model = nn.Linear(3, 1)
    with policy.autocast():
        # d loss / d out = 0.25, scaled 2**14 < fp16 max (the initial 2**16 alone would overflow)
        loss = 0.25 * model(torch.full((1, 3), 0.5)).float().sum()
    scaler.scale(loss).backward()
    assert torch.allclose(model.weight.grad, torch.full((1, 3), 0.125 * 2 ** 16))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler.unscale_(optimizer)
    assert torch.allclose(model.weight.grad, torch.full((1, 3), 0.125))


def test_configure_backends_sets_cuda_flags_only_for_cuda():
    flags = lambda: (torch.backends.cudnn.benchmark, torch.backends.cuda.matmul.fp32_precision,  # noqa: E731
                     torch.backends.cudnn.conv.fp32_precision)
    before = flags()
    configure_backends("cpu")
    assert flags() == before
    with precision.backend_flags("cuda", cudnn_benchmark=True):
        configure_backends(torch.device("cuda"))     # settable without a GPU: flags only
        assert flags() == (True, "tf32", "tf32")
        # Inductor reads TF32 through the legacy getters: they must still answer (they raised
        # "mix of the legacy and new APIs" when only the new API was set, failing --compile).
        assert torch.get_float32_matmul_precision() == "high"
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    assert flags() == before


@pytest.mark.slow
def test_a_model_with_matmuls_compiles_after_the_cuda_flags_are_set():
    """`--compile` after `configure_backends` on a GPU: Inductor's GEMM autotuning reads
    `torch.get_float32_matmul_precision()` when it lowers bmm/addmm (MViT's and Swin's attention).
    Run on the CPU with the CUDA flags set, max-autotune makes Inductor take that same path."""

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = nn.Linear(16, 48)

        def forward(self, x):
            q, k, v = self.qkv(x).chunk(3, dim=-1)
            return torch.bmm(torch.bmm(q, k.transpose(1, 2)).softmax(-1), v)

    torch.manual_seed(0)
    model, x = Attention(), torch.randn(2, 8, 16)
    with precision.backend_flags("cuda", cudnn_benchmark=True):
        compiled = torch.compile(model, mode="max-autotune-no-cudagraphs")
        out = compiled(x)
    torch.testing.assert_close(out, model(x), rtol=1e-4, atol=1e-4)


TF32_API_SINCE = (2, 9)    # torch.backends.cuda.matmul.fp32_precision / cudnn.conv.fp32_precision


def _floor(requirement: str) -> tuple[int, int]:
    match = re.search(r">=\s*(\d+)\.(\d+)", requirement)
    assert match, f"{requirement!r} has no >= floor"
    return int(match.group(1)), int(match.group(2))


def test_torch_floor_has_the_tf32_api_configure_backends_uses():
    """pyproject.toml must not admit a torch that lacks what configure_backends sets (an
    AttributeError on the first GPU trial), nor a torchvision built for an older torch."""
    import tomllib

    pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
    deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    by_name = {re.match(r"[A-Za-z0-9_.\-]+", d).group(0).lower(): d for d in deps}
    torch_floor, vision_floor = _floor(by_name["torch"]), _floor(by_name["torchvision"])
    assert torch_floor >= TF32_API_SINCE, by_name["torch"]
    # torchvision 0.(x+15) is the one built for torch 2.x (0.24 for 2.9).
    assert vision_floor >= (0, torch_floor[1] + 15), (by_name["torch"], by_name["torchvision"])
    # The attributes configure_backends sets exist in the installed (pinned) torch.
    assert torch.backends.cuda.matmul.fp32_precision and torch.backends.cudnn.conv.fp32_precision


def test_helpers_are_no_ops_on_cpu():
    assert precision.peak_allocated_mb("cpu") is None
    assert not precision.supports_fused_optimizer("cpu") and precision.supports_fused_optimizer("cuda:0")
    precision.synchronize("cpu")
    precision.reset_peak_memory("cpu")
    assert precision.collective_device() == torch.device("cpu")


def test_device_type_literal_only_in_precision_module():
    """The runtime owns the device: our training-core modules ask precision.py instead."""
    root = Path(__file__).resolve().parents[1] / "trainer"
    for name in ("training/loop.py", "training/metrics.py", "models/registry.py", "training/batch_probe.py"):
        text = (root / name).read_text()
        assert not re.search(r"""["']cuda""", text), f"trainer/{name} names the cuda device type"


@pytest.mark.gpu
def test_auto_policy_on_the_real_gpu_casts_and_scales_as_decided():
    device = torch.device("cuda", torch.cuda.current_device())
    policy = choose_precision("auto", device)
    low = torch.bfloat16 if torch.cuda.get_device_capability(device) >= (8, 0) else torch.float16
    assert (policy.dtype, policy.use_scaler, policy.device_type) == (low, low == torch.float16, "cuda")
    a = torch.randn(16, 16, device=device)
    with policy.autocast():
        assert (a @ a).dtype == low                       # autocast really applies on this device
    assert (a @ a).dtype == torch.float32
    assert policy.make_scaler().is_enabled() == policy.use_scaler
    with choose_precision("fp32", device).autocast():     # fp32: autocast off on the GPU too
        assert (a @ a).dtype == torch.float32


@pytest.mark.gpu
def test_peak_allocated_follows_tensors_on_the_gpu():
    device = torch.device("cuda", torch.cuda.current_device())
    precision.synchronize(device)
    base = torch.cuda.memory_allocated(device) / 2**20
    precision.reset_peak_memory(device)
    block = torch.ones(32 * 2**20, dtype=torch.uint8, device=device)     # 32 MiB
    assert precision.peak_allocated_mb(device) == pytest.approx(base + 32, abs=0.5)
    del block
    assert precision.peak_allocated_mb(device) == pytest.approx(base + 32, abs=0.5)   # a peak stays
    precision.reset_peak_memory(device)
    assert precision.peak_allocated_mb(device) == pytest.approx(base, abs=0.5)        # until reset
    precision.free_memory(device)
