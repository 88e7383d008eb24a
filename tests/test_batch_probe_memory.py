"""What the batch probe measures: a steady step trained like the trials (precision, channels-last,
--compile), not cuDNN's benchmark scratch, on a GPU of each kind the trials may use. The GPU's
memory is a fake allocator here (torch's CUDA memory queries replaced); the steps are real
steps of the tiny model on the CPU."""
from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from vidtune.trainer.commands import batch_probe_cli
from vidtune.trainer.models.registry import build_model
from vidtune.trainer.training import batch_probe
from vidtune.trainer.training.batch_probe import probe_batch_size
from vidtune.tune import runner
from vidtune.tune.config.options import SearchOptions
from vidtune.tune.running.probe_sites import ProbeSite, probe_sites


class FakeCudaAllocator:
    """torch's caching allocator on a GPU, in shares of its memory. A forward of b clips reserves
    b/16 for the step's tensors plus 1/64 for the convolution algorithms cuDNN chose; the first
    forward at a new shape is cuDNN's benchmark (cudnn.benchmark), whose trial workspaces take
    what is free at that moment: the allocator's peak reaches 97% whatever b is."""

    def __init__(self):
        self.reserved = self.peak = 0.0
        self.benchmarked: set[tuple[int, ...]] = set()

    def reserve(self, share: float) -> None:
        self.reserved = max(self.reserved, share)
        self.peak = max(self.peak, self.reserved)

    def forward(self, module, inputs) -> None:
        shape = tuple(inputs[0].shape)
        if shape not in self.benchmarked:
            self.benchmarked.add(shape)
            self.reserve(0.97)
        need = shape[0] / 16 + 1 / 64
        if need > 1.0:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        self.reserve(need)

    def empty_cache(self, device) -> None:   # cuDNN's chosen algorithms stay cached (benchmarked)
        self.reserved = 0.0

    def reset_peak(self, device) -> None:
        self.peak = self.reserved


def _fake_gpu(monkeypatch) -> FakeCudaAllocator:
    """The real tiny model and step, with the fake allocator's memory queries and its hook."""
    allocator = FakeCudaAllocator()

    def model_with_hook(name, **kwargs):
        model = build_model(name, **kwargs)
        model.register_forward_pre_hook(allocator.forward)
        return model

    monkeypatch.setattr(batch_probe, "build_model", model_with_hook)
    monkeypatch.setattr(batch_probe.prec, "free_memory", allocator.empty_cache)
    monkeypatch.setattr(batch_probe.prec, "reset_peak_memory", allocator.reset_peak)
    monkeypatch.setattr(batch_probe.prec, "peak_reserved_share", lambda device: allocator.peak)
    return allocator


def test_the_probe_measures_a_steady_step_not_cudnns_benchmark_scratch(monkeypatch):
    """Each size's first step reads 97% (cuDNN's free-memory-sized trials): measured there, every
    size is "tight" and not even 2 clips fit. The steady step after it needs b/16 + 1/64, so
    14 clips fit in 90% (57/64 = 0.89) and 15 do not (61/64 = 0.95); 16 run out of memory."""
    allocator = _fake_gpu(monkeypatch)
    probe = probe_batch_size("tiny", device="cpu", limit=32)
    assert (probe.batch_size, probe.tight) == (14, 15)
    assert probe.peak_share == pytest.approx(57 / 64)
    assert "a steady step of 14 peaks at 89%" in probe.describe()
    assert {shape[0] for shape in allocator.benchmarked} == {2, 4, 8, 16, 12, 14, 15}


def test_the_probe_trains_like_the_trial_channels_last_and_compiled(monkeypatch):
    """--channels-last lays out the model's convolutions and the clips as a trial does, and
    --compile wraps the model in torch.compile (replaced here: compiling costs minutes on 2 cores);
    the line says which settings it measured with."""
    compiled, layouts = [], []
    monkeypatch.setattr(batch_probe, "maybe_compile",
                        lambda model, enabled: compiled.append(enabled) or model)

    def model_with_hook(name, **kwargs):
        model = build_model(name, **kwargs)
        model.register_forward_pre_hook(
            lambda m, inputs: layouts.append(inputs[0].is_contiguous(memory_format=torch.channels_last_3d)))
        return model

    monkeypatch.setattr(batch_probe, "build_model", model_with_hook)
    probe = probe_batch_size("tiny", device="cpu", start=2, limit=2, channels_last=True, compile=True)
    assert compiled == [True] and layouts and all(layouts)
    assert "fp32, channels-last, compiled" in probe.describe()
    compiled.clear()
    layouts.clear()
    probe = probe_batch_size("tiny", device="cpu", start=2, limit=2)
    assert compiled == [False] and not any(layouts) and "channels-last" not in probe.describe()


def test_the_cli_probes_with_the_trials_settings(monkeypatch, capsys):
    seen = {}

    def fake_probe(model, **kwargs):
        seen.update(kwargs)
        return batch_probe.BatchProbe(batch_size=12, headroom=0.1, peak_share=None, memory_gib=None)

    monkeypatch.setattr(batch_probe, "probe_batch_size", fake_probe)
    assert batch_probe_cli.main(["--model", "tiny", "--device", "cpu", "--channels-last", "--compile",
                                 "--precision", "fp32"]) == 0
    assert (seen["channels_last"], seen["compile"], seen["precision"]) == (True, True, "fp32")
    assert capsys.readouterr().out.strip() == "12"


def _node(node_id, ip, gpus, kind=None, alive=True):
    resources = {"CPU": 8.0, **({"GPU": float(gpus)} if gpus else {})}
    if kind:
        resources[f"accelerator_type:{kind}"] = 1.0
    return {"NodeID": node_id, "NodeManagerAddress": ip, "Alive": alive, "Resources": resources}


def test_one_probe_site_per_gpu_kind_alive():
    nodes = [_node("h", "10.0.0.1", 0), _node("b2", "10.0.0.3", 4, "A10G"),
             _node("b1", "10.0.0.2", 4, "A10G"),
             _node("a", "10.0.0.4", 8, "H100"), _node("x", "10.0.0.5", 8, "H100", alive=False),
             _node("u", "10.0.0.6", 1)]
    sites = probe_sites(nodes)
    assert [(s.kind, s.node_id, s.gpus) for s in sites] == [("A10G", "b1", 8.0), ("H100", "a", 8.0),
                                                            ("", "u", 1.0)]
    assert sites[0].describe() == "on node 10.0.0.2 (A10G, one of 8 such GPUs)"
    assert sites[2].describe() == "on node 10.0.0.6 (GPU of a kind Ray does not name, the only such GPU)"
    assert probe_sites([_node("h", "10.0.0.1", 0)]) == []


def test_the_search_caps_at_the_smallest_kind_with_the_trials_settings(monkeypatch, capsys):
    """Trials may land on either kind of GPU: the search probes both, with the trials' precision,
    layout and --compile, keeps the smaller cap and names each node, kind and GPU it measured."""
    opts = SearchOptions()
    opts = replace(opts, space=replace(opts.space, probe_batch_size=True, batch_sizes=(8, 16, 32, 64)),
                   train=replace(opts.train, channels_last=True, compile=True, precision="bf16"))
    sites = [ProbeSite("H100", "a", "10.0.0.4", 8.0), ProbeSite("A10G", "b1", "10.0.0.2", 4.0)]
    asked = {}

    def probe_each_kind(where, model, **kwargs):
        asked.update(kwargs, sites=where)
        return [(site, batch_probe.BatchProbe(batch_size=size, headroom=0.1, peak_share=0.8, memory_gib=gib,
                                              gpu=gpu, settings="bf16, channels-last, compiled"))
                for site, size, gib, gpu in zip(where, (48, 20), (79, 22), ("NVIDIA H100", "NVIDIA A10G"),
                                                strict=True)]

    monkeypatch.setattr(runner.ray, "cluster_resources", lambda: {"GPU": 12.0})
    monkeypatch.setattr(runner.ray, "nodes", lambda: [_node("b1", "10.0.0.2", 4, "A10G"),
                                                      _node("a", "10.0.0.4", 8, "H100")])
    monkeypatch.setattr(runner, "probe_each_kind", probe_each_kind)
    capped = runner.probe_batch_sizes(opts, SimpleNamespace(data=opts.train.data))
    assert capped.space.batch_sizes == (8, 16)
    assert asked["sites"] == sites
    assert (asked["channels_last"], asked["compile"], asked["precision"]) == (True, True, "bf16")
    out = capsys.readouterr().out
    assert "on node 10.0.0.2 (A10G, one of 4 such GPUs): at most 20 clips" in out
    assert "measured on NVIDIA H100; bf16, channels-last, compiled" in out
    assert "searching batch sizes (8, 16) (the smallest cap of the 2 GPU kinds)" in out
