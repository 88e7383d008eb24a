"""The Ray Train worker: checkpoints resume exactly (unit and through Ray), workers import this
project's `datasets`, 2-worker DDP matches 1 worker, out of memory (in an epoch or while the
model is built) and divergence are reports, not crashes."""
from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path

import pytest
import ray.train
import torch
from ray.util.queue import Queue
from torch import nn

from vidtune.datasets.config import DataConfig
from vidtune.trainer.cluster.build_trainer import build_torch_trainer
from vidtune.trainer.cluster.worker import METRIC_KEYS, train_loop_per_worker
from vidtune.trainer.models import registry as models
from vidtune.trainer.models.registry import build_model, get_spec
from vidtune.trainer.training.checkpointing import (
    CheckpointError,
    load_checkpoint,
    restore_training_state,
    save_checkpoint,
)
from vidtune.trainer.training.config import TrainConfig
from vidtune.trainer.training.loop import make_optimizer, make_scheduler
from vidtune.trainer.training.precision import is_out_of_memory
from vidtune.trainer.training.run import ShardSampler

REPO_ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------- checkpoints (no Ray)

def _training_objects(cfg: TrainConfig, seed: int = 0):
    torch.manual_seed(seed)
    model = build_model("tiny")
    optimizer = make_optimizer(model, cfg.lr, cfg.weight_decay, torch.device("cpu"))
    scheduler = make_scheduler(optimizer, cfg.epochs * 2, cfg.warmup_frac)
    # An enabled scaler (as for fp16) so its state is not trivially empty.
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1)
    return model, optimizer, scheduler, scaler


def _step(model, optimizer, scheduler, scaler, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 3, 8, 64, 64, generator=g)
    y = torch.tensor([0, 1])
    model.train()
    torch.manual_seed(seed)  # dropout masks
    loss = torch.nn.functional.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    scheduler.step()


def _assert_same_state(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key


def test_checkpoint_resume_continues_exactly(tmp_path):
    """Stop after "epoch 1" (2 steps), restore into fresh objects, run "epoch 2": the result is
    bit-identical to an uninterrupted run's state after epoch 2."""
    cfg = TrainConfig(epochs=2, lr=1e-3, warmup_frac=0.3)
    straight = _training_objects(cfg)
    for s in range(4):
        _step(*straight, seed=s)

    first = _training_objects(cfg)
    for s in range(2):
        _step(*first, seed=s)
    model, optimizer, scheduler, scaler = first
    save_checkpoint(tmp_path, model=model, optimizer=optimizer, scaler=scaler, scheduler=scheduler, epoch=1,
                    config=cfg.to_dict(), spec=get_spec("tiny"), class_names={1: "Fight", 0: "NonFight"},
                    metrics={"val_acc": 0.5, "epoch": 1})

    resumed = _training_objects(cfg, seed=123)  # different init: everything must come from the file
    state = load_checkpoint(tmp_path)
    assert state["epoch"] == 1 and state["class_names"] == {1: "Fight", 0: "NonFight"}
    assert TrainConfig.from_dict(state["config"]) == cfg and state["spec"]["name"] == "tiny"
    start = restore_training_state(state, model=resumed[0], optimizer=resumed[1], scaler=resumed[3],
                                   scheduler=resumed[2])
    assert start == 2
    assert resumed[3].get_scale() == scaler.get_scale()
    assert resumed[2].last_epoch == scheduler.last_epoch == 2
    for s in range(2, 4):
        _step(*resumed, seed=s)

    _assert_same_state(resumed[0], straight[0])
    assert resumed[1].state_dict()["state"].keys() == straight[1].state_dict()["state"].keys()
    for k, st in straight[1].state_dict()["state"].items():
        for name, value in st.items():
            assert torch.equal(resumed[1].state_dict()["state"][k][name], value), (k, name)
    assert resumed[2].get_last_lr() == straight[2].get_last_lr()
    assert resumed[3].state_dict() == straight[3].state_dict()


def test_checkpoint_errors_name_the_file(tmp_path):
    with pytest.raises(CheckpointError, match="not found"):
        load_checkpoint(tmp_path / "nope")
    bad = tmp_path / "checkpoint.pt"
    bad.write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match=r"checkpoint\.pt cannot be read"):
        load_checkpoint(tmp_path)
    torch.save({"weight": torch.zeros(2)}, bad)
    with pytest.raises(CheckpointError, match="not a vidtune checkpoint"):
        load_checkpoint(bad)


def test_checkpoint_loads_as_weights_of_a_new_run(tmp_path):
    """A vidtune checkpoint is accepted by --weights (fine-tune further from it)."""
    cfg = TrainConfig()
    model, optimizer, scheduler, scaler = _training_objects(cfg)
    save_checkpoint(tmp_path, model=model, optimizer=optimizer, scaler=scaler, scheduler=scheduler, epoch=1,
                    config=cfg.to_dict(), spec=get_spec("tiny"), class_names={1: "Fight", 0: "NonFight"})
    again = build_model("tiny", weights=str(tmp_path / "checkpoint.pt"))
    _assert_same_state(again, model)


def test_free_device_lets_go_of_the_weights_and_optimiser_state_once_checkpointed(tmp_path):
    """The last epoch's hand-over: the checkpoint is written first, then the run holds nothing
    on its device (here the CPU, as with simulated GPUs): what the lease records at release."""
    from types import SimpleNamespace

    from vidtune.trainer.training.device_memory import free_device, held_device_mb

    model = nn.Sequential(nn.Linear(64, 256), nn.BatchNorm1d(256), nn.Linear(256, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(8, 64)).sum().backward()
    optimizer.step()
    run = SimpleNamespace(model=model, optimizer=optimizer, device=torch.device("cpu"))
    params = sum(p.numel() for p in model.parameters())
    # weights, their gradients and AdamW's two moments: 4 float32 copies, plus BatchNorm's buffers
    assert held_device_mb(run) * 2**20 >= 4 * 4 * params
    torch.save(model.state_dict(), tmp_path / "weights.pt")
    free_device(run)
    assert held_device_mb(run) == 0.0 and not optimizer.state
    restored = nn.Sequential(nn.Linear(64, 256), nn.BatchNorm1d(256), nn.Linear(256, 2))
    restored.load_state_dict(torch.load(tmp_path / "weights.pt"))    # the checkpoint written before is whole


def test_free_device_drops_ddp_inside_a_compiled_model(tmp_path):
    """Under --compile the trial's model is torch.compile's wrapper around DDP: the hand-over
    must drop DDP (its gradient buckets are as large as the weights) from inside it too."""
    import gc
    import weakref
    from types import SimpleNamespace

    import torch.distributed as dist

    from vidtune.trainer.training.device_memory import free_device, held_device_mb

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        plain = nn.Sequential(nn.Linear(64, 256), nn.Linear(256, 2))
        ddp = nn.parallel.DistributedDataParallel(plain)
        optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
        ddp(torch.randn(8, 64)).sum().backward()
        optimizer.step()
        run = SimpleNamespace(model=torch.compile(ddp), optimizer=optimizer, device=torch.device("cpu"))
        dropped = weakref.ref(ddp)
        del ddp
        free_device(run)
        gc.collect()
        assert run.model is plain and dropped() is None and held_device_mb(run) == 0.0
    finally:
        dist.destroy_process_group()


def test_a_gpu_trial_waits_for_its_lease_in_host_memory(monkeypatch):
    """Before the lease, a GPU worker makes no CUDA context on its GPU: Ray's train_func_context
    (which calls torch.cuda.set_device, a context under CUDA 12) is replaced, and its own
    collectives go over gloo with CPU tensors (NCCL only for DDP's CUDA tensors)."""
    import contextlib

    import torch.distributed as dist

    from vidtune.trainer.cluster.process_group import GPU_BACKEND, LeasedTorchConfig
    from vidtune.trainer.training import precision
    from vidtune.trainer.training.gpus import SIMULATE_ENV

    monkeypatch.delenv(SIMULATE_ENV, raising=False)
    config = build_torch_trainer(TrainConfig(), num_workers=2, use_gpu=True).backend_config
    assert isinstance(config, LeasedTorchConfig) and config.backend == GPU_BACKEND == "cpu:gloo,cuda:nccl"
    set_device = []
    monkeypatch.setattr(torch.cuda, "set_device", set_device.append)
    with config.train_func_context():
        pass
    assert config.train_func_context is contextlib.nullcontext and not set_device
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: GPU_BACKEND)
    assert precision.collective_device() == torch.device("cpu")
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")    # a NCCL-only group
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert precision.collective_device() == torch.device("cuda", 0)


def test_build_run_leaves_nothing_on_the_device_until_place_model(synthetic_root):
    """A trial waiting for its GPU must hold no memory there: build_run makes the data, model,
    optimiser and input transforms on the CPU (here `meta` stands for the GPU: any tensor moved
    there would show); place_model, called once the lease is held, moves them."""
    from vidtune.datasets.index import build_index
    from vidtune.trainer.training.run import build_run, place_model

    cfg = _small(synthetic_root, channels_last=True)
    device = torch.device("meta")
    run = build_run(cfg, build_index(cfg.data), device=device)

    def on_device() -> list[str]:
        modules = {"model": run.model, "train_transform": run.train_transform,
                   "val_transform": run.val_transform}
        return [f"{owner}.{name}" for owner, module in modules.items()
                for name, t in (*module.named_parameters(), *module.named_buffers()) if t.device == device]

    assert on_device() == []
    place_model(run)
    assert {"train_transform.0.scale", "val_transform.0.shift"} <= set(on_device())


def test_a_bf16_checkpoint_resumes_in_fp16_with_a_fresh_scaler(synthetic_root, tmp_path):
    """A bf16 run's checkpoint records its precision and an empty scaler state (bf16 needs no
    loss scaling); restored where fp16 is chosen (a T4), the run starts a fresh GradScaler
    instead of failing ("The source state dict is empty"), and the weights come back."""
    from vidtune.datasets.index import build_index
    from vidtune.trainer.training.checkpointing import saved_precision
    from vidtune.trainer.training.run import build_run, place_model, save_run_checkpoint

    cpu = torch.device("cpu")
    index = build_index(_small(synthetic_root).data)
    trained = build_run(_small(synthetic_root, precision="bf16"), index, device=cpu)
    place_model(trained)
    save_run_checkpoint(trained, tmp_path, epoch=1)
    state = load_checkpoint(tmp_path)
    assert state["scaler"] == {} and saved_precision(state) == "bf16"

    resumed = build_run(_small(synthetic_root, precision="fp16", seed=1), index, device=cpu)
    place_model(resumed, state)
    assert resumed.policy.name == "fp16" and resumed.scaler.is_enabled()
    assert resumed.scaler.get_scale() == torch.amp.GradScaler("cpu").get_scale()
    _assert_same_state(resumed.model, trained.model)


@pytest.mark.filterwarnings("ignore:torch.cuda.amp.GradScaler is enabled, but CUDA is not available")
def test_a_run_decides_its_precision_once_for_all_ranks_and_keeps_its_checkpoints(monkeypatch, capsys):
    """`auto` on an H100 (faked) is bf16 for a fresh run; a resumed run keeps the precision its
    checkpoint trained in (fp16: the trial began on a T4); with a T4 among the ranks (its choice
    reaching this rank through the all-reduce) every rank trains in fp16, a bf16 checkpoint too."""
    from types import SimpleNamespace

    from vidtune.trainer.training import run as run_module
    from vidtune.trainer.training.precision import BY_SUPPORT, choose_precision

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (9, 0))

    def on_h100(state):
        policy = choose_precision("auto", "cuda:0")
        run = SimpleNamespace(cfg=TrainConfig(), device=torch.device("cuda", 0), policy=policy,
                              scaler=policy.make_scaler(), rank=0)
        run_module.agree_precision(run, state)
        return run.policy

    assert on_h100(None).name == "bf16"
    assert on_h100({"precision": "bf16"}).name == "bf16"
    kept = on_h100({"precision": "fp16"})
    assert (kept.name, kept.use_scaler, kept.requested) == ("fp16", True, "auto")
    t4 = float(BY_SUPPORT.index("fp16"))
    monkeypatch.setattr(run_module, "all_reduce_floats", lambda values, op: [min(values[0], t4)])
    assert on_h100(None).name == "fp16"
    capsys.readouterr()
    assert on_h100({"precision": "bf16"}).name == "fp16"
    assert "checkpoint trained in bf16" in capsys.readouterr().out


def test_shard_sampler_covers_every_item_once():
    shards = [list(ShardSampler(10, r, 3)) for r in range(3)]
    assert sorted(sum(shards, [])) == list(range(10))
    assert [len(s) for s in shards] == [4, 3, 3]


def test_out_of_memory_is_recognised():
    assert is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    try:
        torch.empty(2**50, dtype=torch.uint8)  # a real CPU allocator failure (RuntimeError)
    except RuntimeError as e:
        assert is_out_of_memory(e)
    assert not is_out_of_memory(RuntimeError("shape mismatch"))


# ---------------------------------------------------------------- on Ray (slow)

def _small(root, **changes) -> TrainConfig:
    """Tiny model, short clips, fp32: a Ray trial that trains in seconds on a CPU."""
    data = DataConfig(root=str(root), loader_workers=1)
    return TrainConfig(data=data, **{"model": "tiny", "precision": "fp32", "lr": 1e-3, **changes})


def _collecting_callback():
    """A Train callback (runs in the controller actor) that forwards rank 0's reports to a
    queue the test reads; the same path TuneReportCallback takes."""
    queue = Queue(actor_options={"num_cpus": 0})

    class Collect(ray.train.UserCallback):
        def __init__(self, q):
            self.q = q

        def after_report(self, run_context, metrics, checkpoint):
            self.q.put((dict(metrics[0]), checkpoint.path if checkpoint else None))

    def drain():
        items = []
        while not queue.empty():
            items.append(queue.get())
        queue.shutdown()
        return items

    return Collect(queue), drain


@pytest.mark.slow
def test_ray_workers_import_vidtune_from_the_installed_package_beside_hugging_faces(ray_session):
    """Nothing ships the code on PYTHONPATH: a Ray worker, whose cwd is elsewhere, imports
    `vidtune.datasets` from the installed package (this clone, through the editable install) and
    `datasets` is Hugging Face's, in one process."""
    @ray_session.remote(num_cpus=0)
    def where():
        import os  # in the Ray worker, on purpose: what it finds is the test

        import datasets
        import vidtune.datasets.index

        return datasets.__file__, vidtune.datasets.index.__file__, os.environ.get("PYTHONPATH", "")

    hf, ours, pythonpath = ray_session.get(where.remote())
    assert Path(ours).resolve() == REPO_ROOT / "datasets" / "index.py"
    assert "site-packages" in Path(hf).parts and Path(hf).resolve().parent != REPO_ROOT / "datasets"
    assert str(REPO_ROOT) not in pythonpath.split(os.pathsep)


def _actors_had(class_name: str) -> int:
    """Actors of `class_name` this Ray has had, alive or dead."""
    from ray.util.state import list_actors

    return len(list_actors(address=ray.get_runtime_context().gcs_address,
                           filters=[("class_name", "=", class_name)], limit=10_000))


UNUSED_ACTORS = ("DatasetManager", "PlacementGroupCleaner")   # Ray Train's; trainer.cluster.torch_trainer


@pytest.mark.slow
def test_fit_reports_checkpoints_and_resumes_at_the_next_epoch(ray_session, synthetic_root, tmp_path):
    """A 1-epoch fit reports every metric key and a checkpoint; rerun under the same name with
    epochs=2, the worker restores it and runs epoch 2 only; with that latest checkpoint damaged,
    a third run falls back to epoch 1's."""
    callback, drain = _collecting_callback()
    unused_before = [_actors_had(name) for name in UNUSED_ACTORS]
    first = build_torch_trainer(_small(synthetic_root, epochs=1, batch_size=8, cpu_threads=2), name="resume",
                                storage_path=str(tmp_path), callbacks=[callback]).fit()
    reports = drain()
    assert [_actors_had(name) for name in UNUSED_ACTORS] == unused_before
    assert [m["epoch"] for m, _ in reports] == [1]
    metrics, ckpt_path = reports[0]
    assert set(metrics) == set(METRIC_KEYS)
    assert metrics["oom"] == 0 and metrics["batch_size"] == 8 and isinstance(metrics["node_id"], str)
    # the CPU: no GPU ids
    assert metrics["diverged"] == 0 and metrics["gpu_ids"] == "" and metrics["node_ip"]
    assert (0.0 <= metrics["val_acc"] <= 1.0 and metrics["clips_per_s"] > 0
            and math.isfinite(metrics["train_loss"]))
    assert metrics["torch_threads"] == 2                       # --cpu-threads, not the 1 CPU Ray reserved
    assert 0.0 <= metrics["other_cpu_cores"] < 2.0             # measured (not NaN) on Linux
    saved = load_checkpoint(first.checkpoint.path)
    assert saved["epoch"] == 1 and Path(ckpt_path).name == "epoch_0001"

    callback, drain = _collecting_callback()
    second = build_torch_trainer(_small(synthetic_root, epochs=2, batch_size=8), name="resume",
                                 storage_path=str(tmp_path), callbacks=[callback]).fit()
    second_reports = drain()
    assert [m["epoch"] for m, _ in second_reports] == [2]
    assert [m["resumed_from_epoch"] for m, _ in second_reports] == [1]    # MLflow tags the restart from it
    assert [m["torch_threads"] for m, _ in second_reports] == [1]         # default: the CPUs Ray reserved
    assert metrics["resumed_from_epoch"] == 0                              # the first run started fresh
    resumed = load_checkpoint(second.checkpoint.path)
    assert resumed["epoch"] == 2
    # training continued from the saved optimizer state (AdamW's step count goes on)
    steps_1 = saved["optimizer"]["state"][0]["step"].item()
    assert resumed["optimizer"]["state"][0]["step"].item() == 2 * steps_1

    # The latest checkpoint cut short (a full disk): the rerun falls back to the epoch-1 one
    # (two are kept) and says so in its first report; its new folder does not reuse the name.
    latest = Path(second.checkpoint.path) / "checkpoint.pt"
    latest.write_bytes(latest.read_bytes()[:1000])
    callback, drain = _collecting_callback()
    build_torch_trainer(_small(synthetic_root, epochs=2, batch_size=8), name="resume",
                        storage_path=str(tmp_path), callbacks=[callback]).fit()
    third_reports = drain()
    assert [(m["epoch"], m["resumed_from_epoch"], m["damaged_checkpoints"])
            for m, _ in third_reports] == [(2, 1, 1)]
    assert Path(third_reports[0][1]).name.startswith("epoch_0002-")


@pytest.mark.slow
@pytest.mark.alone     # asserts the CPU load of processes other than its own workers
def test_two_worker_ddp_matches_one_worker(ray_session, synthetic_root, tmp_path):
    """Same global batch (8 = 2 x 4), same data order, same init: the 2-worker DDP run ends where
    the 1-worker run does, within augmentation/dropout noise (each rank draws its own)."""
    results = {}
    for workers, batch in ((1, 8), (2, 4)):
        cfg = _small(synthetic_root, epochs=1, batch_size=batch, lr=3e-3, warmup_frac=0.0)
        result = build_torch_trainer(cfg, num_workers=workers, name=f"ddp{workers}",
                                     storage_path=str(tmp_path)).fit()
        results[workers] = (result.metrics, load_checkpoint(result.checkpoint.path))
    (m1, c1), (m2, c2) = results[1], results[2]
    assert m1["epoch"] == m2["epoch"] == 1
    assert abs(m1["train_loss"] - m2["train_loss"]) < 0.1, (m1, m2)
    assert abs(m1["val_loss"] - m2["val_loss"]) < 0.1, (m1, m2)
    assert abs(m1["val_acc"] - m2["val_acc"]) <= 0.3, (m1, m2)
    # The other worker of the same run is not "other load": both workers' CPU comes off the node's
    # (counted, the other worker would show as about a core of its own).
    assert 0.0 <= m2["other_cpu_cores"] < 0.8, m2["other_cpu_cores"]
    # Both took the same number of optimizer steps (each DDP step = one global batch of 8).
    assert c1["optimizer"]["state"][0]["step"] == c2["optimizer"]["state"][0]["step"]


@pytest.mark.slow
def test_out_of_memory_reports_oom_and_returns(ray_session, synthetic_root, tmp_path):
    """A model whose forward really runs out of memory (the CPU allocator refuses 1 PiB): the
    trial reports oom=1 with worst-case metrics and no checkpoint, and fit() returns normally."""
    def loop_with_greedy_model(config):
        # Runs in the Ray worker: register a model whose forward asks for 1 PiB.
        class Greedy(nn.Module):
            def __init__(self, num_classes=2):
                super().__init__()
                self.inner = models.build_model("tiny", num_classes=num_classes)
                self.head = self.inner.head

            def forward(self, x):
                torch.empty(2**50, dtype=torch.uint8, device=x.device)
                return self.inner(x)

        models._REGISTRY["greedy"] = dataclasses.replace(models._REGISTRY["tiny"], builder=Greedy)
        train_loop_per_worker(config)

    callback, drain = _collecting_callback()
    cfg = _small(synthetic_root, epochs=2, batch_size=4).with_overrides(model="greedy")
    result = build_torch_trainer(cfg, name="oom", storage_path=str(tmp_path), callbacks=[callback],
                                 train_loop=loop_with_greedy_model).fit()
    reports = drain()
    assert len(reports) == 1
    metrics, checkpoint = reports[0]
    assert checkpoint is None and result.checkpoint is None and result.error is None
    assert set(metrics) == set(METRIC_KEYS)
    assert metrics["oom"] == 1 and metrics["epoch"] == 1 and metrics["batch_size"] == 4
    assert metrics["val_acc"] == metrics["val_auc"] == metrics["clips_per_s"] == 0.0
    assert math.isnan(metrics["train_loss"]) and math.isnan(metrics["val_loss"])
    assert metrics["peak_mem_mb"] > 0


@pytest.mark.slow
def test_out_of_memory_while_building_the_model_is_a_report(ray_session, synthetic_root, tmp_path):
    """A model that runs out of memory as it is built, before any epoch (as moving it to a full
    GPU does): one oom=1 report, no checkpoint, and fit() returns normally instead of raising an
    error that Ray would retry."""
    def loop_with_unbuildable_model(config):
        # Runs in the Ray worker: register a model whose builder runs out of memory.
        def build(num_classes=2):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

        models._REGISTRY["unbuildable"] = dataclasses.replace(models._REGISTRY["tiny"], builder=build)
        train_loop_per_worker(config)

    callback, drain = _collecting_callback()
    cfg = _small(synthetic_root, epochs=2, batch_size=4).with_overrides(model="unbuildable")
    result = build_torch_trainer(cfg, name="setup-oom", storage_path=str(tmp_path), callbacks=[callback],
                                 train_loop=loop_with_unbuildable_model).fit()
    reports = drain()
    assert len(reports) == 1 and result.error is None and result.checkpoint is None
    metrics, checkpoint = reports[0]
    assert checkpoint is None and set(metrics) == set(METRIC_KEYS)
    assert (metrics["oom"], metrics["diverged"], metrics["epoch"], metrics["batch_size"]) == (1, 0, 1, 4)
    assert metrics["val_acc"] == metrics["clips_per_s"] == 0.0 and metrics["gpu_ids"] == ""


@pytest.mark.slow
def test_a_learning_rate_of_1e6_ends_the_run_as_diverged(ray_session, synthetic_root, tmp_path):
    """The tiny model at lr 1e6 (fp32, no GradScaler) turns its weights to NaN in epoch 1: the run
    reports diverged=1 once, with no accuracy, no speed and no checkpoint, and fit() returns
    normally (no error for Ray to retry). Before, it trained on and reported the share of one
    class as its val_acc, every epoch, with checkpoints."""
    callback, drain = _collecting_callback()
    cfg = _small(synthetic_root, epochs=2, batch_size=8, lr=1e6)
    result = build_torch_trainer(cfg, name="diverges", storage_path=str(tmp_path), callbacks=[callback]).fit()
    reports = drain()
    assert len(reports) == 1 and result.error is None and result.checkpoint is None
    metrics, checkpoint = reports[0]
    assert checkpoint is None and set(metrics) == set(METRIC_KEYS)
    assert (metrics["diverged"], metrics["oom"], metrics["epoch"]) == (1, 0, 1)
    assert not math.isfinite(metrics["train_loss"]) and math.isnan(metrics["val_loss"])
    assert metrics["val_acc"] == metrics["clips_per_s"] == metrics["steady_clips_per_s"] == 0.0
    assert metrics["gpu_ids"] == "" and isinstance(metrics["node_id"], str)


def test_a_workers_cpus_split_into_torch_threads_and_loaders():
    """On the CPU, as before: a GPU-less worker given 8 CPUs decodes on 7, one with a CPU or less
    still decodes on 2 beside training. On a GPU the rule changed: the old default 0.9 CPU gave a
    GPU worker 1 thread and 2 loaders, which starve a large GPU. Its process mostly launches
    kernels, so it keeps 1 torch thread (2 from 6 CPUs) and the rest decode, at least 4 loaders
    where its GPU's share of the node has the cores (the trial starting behind it on that GPU only
    waits on the lease meanwhile). --cpu-threads and --loader-workers win, 0 included."""
    from vidtune.trainer.cluster.cpu_share import CpuPlan, cpu_plan
    from vidtune.trainer.training.run import loader_workers

    grants = (0.5, 0.9, 1, 3, 4, 8, 16.0)
    assert [loader_workers(None, cpus) for cpus in grants] == [2, 2, 2, 2, 3, 7, 15]
    assert [(p.threads, p.loaders) for p in (cpu_plan(cpus, on_gpu=False) for cpus in grants)] == [
        (1, 2), (1, 2), (1, 2), (3, 2), (4, 3), (8, 7), (16, 15)]
    # 8 CPUs a GPU (g5.2xlarge): the old 0.9, the new default 3.5 (two trials a GPU), one trial a GPU
    assert [cpu_plan(cpus, on_gpu=True, node_cpus_per_gpu=8) for cpus in (0.9, 3.5, 7.5)] == [
        CpuPlan(1, 4), CpuPlan(1, 4), CpuPlan(2, 5)]
    assert cpu_plan(1.5, on_gpu=True, node_cpus_per_gpu=4) == CpuPlan(1, 3)   # 4 cores a GPU: no more
    assert cpu_plan(0.9, on_gpu=True, node_cpus_per_gpu=2) == CpuPlan(1, 2)   # at least 2, as on the CPU
    assert cpu_plan(12, on_gpu=True, node_cpus_per_gpu=12) == CpuPlan(2, 10)
    assert cpu_plan(3.5, on_gpu=True, node_cpus_per_gpu=8, threads=3, loaders=0) == CpuPlan(3, 0)
    assert loader_workers(0, 8) == 0 and loader_workers(5, 1) == 5
    assert DataConfig().loader_workers is None      # the default is decided where the CPUs are known


def test_a_gpu_worker_sets_its_threads_and_loaders_from_the_cpus_ray_granted(monkeypatch):
    """The worker's own step (`_use_allocated_cpus`): Ray's grant and the node's CPUs per GPU, as
    Ray reports them, give torch's threads and the loader count the run is built with."""
    from types import SimpleNamespace

    import ray

    from vidtune.trainer.cluster import worker
    from vidtune.trainer.cluster.cpu_share import CpuPlan

    context = SimpleNamespace(get_assigned_resources=lambda: {"CPU": 3.5, "GPU": 0.6},
                              get_node_id=lambda: "node-b")
    monkeypatch.setattr(ray, "get_runtime_context", lambda: context)
    monkeypatch.setattr(ray, "nodes", lambda: [{"NodeID": "node-a", "Resources": {"CPU": 4.0}},
                                                {"NodeID": "node-b", "Resources": {"CPU": 16.0, "GPU": 2.0}}])
    before = torch.get_num_threads()
    try:
        cfg = TrainConfig(data=DataConfig(root="unused"))
        assert worker._use_allocated_cpus(cfg, on_gpu=True) == CpuPlan(1, 4)
        assert torch.get_num_threads() == 1
        assert worker._use_allocated_cpus(cfg, on_gpu=False) == CpuPlan(3, 2)   # the CPU rule
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)
