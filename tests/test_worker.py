"""The Ray Train worker: checkpoints resume exactly, the tiny model learns the synthetic data
(and not shuffled labels), 2-worker DDP matches 1 worker, out of memory is a report, not a crash."""
from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch

from trainer.checkpointing import CheckpointError, load_checkpoint, restore_training_state, save_checkpoint
from trainer.config import TrainConfig
from trainer.models import build_model, get_spec
from trainer.loop import make_optimizer, make_scheduler
from trainer.worker import METRIC_KEYS, ShardSampler

REPO_ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------- checkpoints (no Ray)

def _training_objects(cfg: TrainConfig, seed: int = 0):
    torch.manual_seed(seed)
    model = build_model("tiny")
    optimizer = make_optimizer(model, cfg.lr, cfg.weight_decay, torch.device("cpu"))
    scheduler = make_scheduler(optimizer, cfg.epochs * 3, cfg.warmup_frac)
    # An enabled scaler (as for fp16) so its state is not trivially empty.
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=2)
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
    """Stop after "epoch 1" (3 steps), restore into fresh objects, run "epoch 2": the result is
    bit-identical to an uninterrupted run's state after epoch 2."""
    cfg = TrainConfig(epochs=2, lr=1e-3, warmup_frac=0.3)
    straight = _training_objects(cfg)
    for s in range(6):
        _step(*straight, seed=s)

    first = _training_objects(cfg)
    for s in range(3):
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
    assert resumed[2].last_epoch == scheduler.last_epoch == 3
    for s in range(3, 6):
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


def test_shard_sampler_covers_every_item_once():
    shards = [list(ShardSampler(10, r, 3)) for r in range(3)]
    assert sorted(sum(shards, [])) == list(range(10))
    assert [len(s) for s in shards] == [4, 3, 3]
