"""trainer.train: bad input is refused before Ray starts (exit 2, the flag named); a real run
prints one line per epoch and the best checkpoint, which trainer.predict then uses."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from datasets.config import DataConfig
from trainer import train
from trainer.config import TrainConfig
from trainer.launch import ConfigError, validate_config

REPO_ROOT = Path(__file__).resolve().parents[1]


def _cfg(root, **changes) -> TrainConfig:
    base = TrainConfig().with_overrides(data=DataConfig(root=str(root)))
    return base.with_overrides(**changes)


@pytest.mark.parametrize(
    "changes, flag",
    [
        ({"model": "resnet9000"}, "--model"),
        ({"batch_size": 0}, "--batch-size"),
        ({"lr": 0.0}, "--lr"),
        ({"lr": float("nan")}, "--lr"),
        ({"epochs": 0}, "--epochs"),
        ({"grad_accum_steps": 0}, "--grad-accum"),
        ({"precision": "fp8"}, "--precision"),
        ({"label_smoothing": 1.0}, "--label-smoothing"),
        ({"weights": "/no/such/weights.pth"}, "--weights"),
        ({"data": "SIZE"}, "--height"),
        ({"data": "CACHE_GB"}, "--cache-max-gb"),
        ({"data": "CACHE_FORMAT"}, "--cache-format"),
    ],
)
def test_validate_config_names_the_flag(tmp_path, changes, flag):
    if changes.get("data") == "SIZE":  # tiny (an MViT) takes only its own 64 x 64 clips
        changes = {"data": DataConfig(root=str(tmp_path), height=48, width=48)}
    elif changes.get("data") == "CACHE_GB":
        changes = {"data": DataConfig(root=str(tmp_path), clip_cache_max_gb=-1.0)}
    elif changes.get("data") == "CACHE_FORMAT":
        changes = {"data": DataConfig(root=str(tmp_path), clip_cache_format="png")}
    with pytest.raises(ConfigError) as e:
        validate_config(_cfg(tmp_path, **changes))
    assert e.value.flag == flag
    assert str(e.value).startswith(flag)


def test_validate_config_missing_data_folder(tmp_path):
    with pytest.raises(ConfigError, match=r"--data: .*does not exist"):
        validate_config(_cfg(tmp_path / "nowhere"))


def test_validate_config_refuses_weights_of_another_architecture(tmp_path):
    from torch import nn

    other = tmp_path / "resnet.pth"
    torch.save(nn.Sequential(nn.Conv2d(3, 8, 3), nn.Linear(8, 2)).state_dict(), other)
    with pytest.raises(ConfigError, match=r"--weights: .*resnet.pth.*'tiny'"):
        validate_config(_cfg(tmp_path, weights=str(other)))
    junk = tmp_path / "junk.pth"
    junk.write_bytes(b"not a torch file")
    with pytest.raises(ConfigError, match=r"--weights: .*junk.pth"):
        validate_config(_cfg(tmp_path, weights=str(junk)))


def test_validate_config_accepts_weights_of_the_same_model(tmp_path):
    from trainer.models import build_model

    good = tmp_path / "tiny.pth"
    torch.save(build_model("tiny").state_dict(), good)
    validate_config(_cfg(tmp_path, weights=str(good)))  # no error


def test_cli_bad_input_exits_2_before_ray(tmp_path):
    """Run as the user does (`python -m`, from the repository root): exit 2, the flag named,
    and no Ray started (it would print Ray's banner and take seconds)."""
    env = {**os.environ, "PYTHONPATH": ""}
    proc = subprocess.run(
        [sys.executable, "-m", "trainer.train", "--data", str(tmp_path), "--batch-size", "0"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2, proc.stderr
    assert "--batch-size" in proc.stderr and "got 0" in proc.stderr
    assert "Started a local Ray instance" not in proc.stdout + proc.stderr


def test_cli_missing_data_exits_2(tmp_path, capsys):
    assert train.main(["--data", str(tmp_path / "missing")]) == 2
    assert "--data" in capsys.readouterr().err


def test_cli_batch_larger_than_dataset_exits_2(synthetic_root, capsys):
    assert train.main(["--data", str(synthetic_root), "--batch-size", "1000"]) == 2
    err = capsys.readouterr().err
    assert "--batch-size" in err and "1000" in err


def test_cli_flags_reach_the_config():
    args = train.build_parser().parse_args(
        ["--data", "d", "--height", "48", "--width", "48", "--num-frames", "4", "--grad-accum", "2", "--precision", "bf16",
         "--freeze-backbone-epochs", "1", "--channels-last", "--positive-class", "Violence",
         "--cache-dir", "/tmp/c", "--cache-format", "raw"])
    cfg = train.config_from_args(args)
    assert (cfg.data.height, cfg.data.width, cfg.data.num_frames) == (48, 48, 4)
    assert cfg.grad_accum_steps == 2 and cfg.precision == "bf16" and cfg.channels_last
    assert cfg.freeze_backbone_epochs == 1 and cfg.data.positive_class == "Violence"
    assert (cfg.data.clip_cache, cfg.data.clip_cache_dir, cfg.data.clip_cache_format) == (True, "/tmp/c", "raw")
    assert train.config_from_args(train.build_parser().parse_args(["--data", "d", "--no-cache"])).data.clip_cache is False
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg


def test_every_flag_has_help():
    for action in train.build_parser()._actions:
        assert action.help, action.option_strings


def test_train_and_search_share_the_training_flags():
    """One declaration per option: the same flag, the same default, in both CLIs."""
    from tune.options import build_parser as search_parser

    def flags(parser):
        return {o: a.dest.removeprefix("train.") for a in parser._actions for o in a.option_strings}

    train_flags, search_flags = flags(train.build_parser()), flags(search_parser())
    from trainer.launch import TRAIN_FLAGS

    training = {spec.flag for spec in TRAIN_FLAGS}
    shared = {f: d for f, d in train_flags.items() if f in search_flags and f in training}
    assert {"--grad-accum", "--height", "--cache-format", "--precision", "--epochs", "--data"} <= set(shared)
    assert all(search_flags[f] == d for f, d in shared.items())
    assert "--batch-size" in train_flags and "--batch-size" not in search_flags   # the search draws it


def test_negative_values_reach_the_range_check(capsys, tmp_path):
    assert train.main(["--data", str(tmp_path), "--lr", "-1e-3"]) == 2
    assert "--lr: got -0.001; it must be a number > 0" in capsys.readouterr().err


@pytest.mark.slow
def test_cli_trains_prints_epochs_and_checkpoint_then_predict_uses_it(ray_session, synthetic_root, tmp_path, capsys):
    """`python -m trainer.train` end to end (in-process, on the shared Ray): one line per epoch,
    the best checkpoint's path at the end; trainer.predict scores 2 videos with it and names a
    missing one."""
    import re

    from trainer import predict

    code = train.main(["--data", str(synthetic_root), "--epochs", "1", "--batch-size", "8", "--precision", "fp32",
                       "--loader-workers", "1", "--storage", str(tmp_path), "--name", "cli"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert re.search(r"^epoch 1/1  train_loss [0-9.]+  val_loss [0-9.]+  val_acc [0-9.]+ .* clips/s", out, flags=re.M), out
    match = re.search(r"^best checkpoint \(epoch 1, val_acc [0-9.]+\): (\S+)$", out, flags=re.M)
    assert match, out
    checkpoint = Path(match.group(1))
    assert (checkpoint / "checkpoint.pt").is_file() and checkpoint.is_relative_to(tmp_path)

    videos = sorted((synthetic_root / "val").rglob("*.mp4"))[:2]
    missing = tmp_path / "gone.mp4"
    code = predict.main(["--checkpoint", str(checkpoint), str(videos[0]), str(missing), str(videos[1])])
    out, err = capsys.readouterr()
    assert code == 1 and "gone.mp4" in err
    scores = [float(x) for x in re.findall(r": P\(Fight\) max ([0-9.]+)", out)]
    assert len(scores) == 2 and all(0.0 <= s <= 1.0 for s in scores), out
