"""vidtune.trainer.commands.train: bad input is refused before Ray starts (exit 2, the flag named); a real run
prints one line per epoch and the best checkpoint, which trainer.serving.predict then uses."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from vidtune.datasets.config import DataConfig
from vidtune.trainer.commands import train, train_run
from vidtune.trainer.models.registry import build_model
from vidtune.trainer.ray_setup.launch import TRAIN_FLAGS, ConfigError, validate_config
from vidtune.trainer.serving import predict
from vidtune.trainer.training.config import TrainConfig
from vidtune.tune.config.options import build_parser as search_parser

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
    other = tmp_path / "resnet.pth"
    torch.save(nn.Sequential(nn.Conv2d(3, 8, 3), nn.Linear(8, 2)).state_dict(), other)
    with pytest.raises(ConfigError, match=r"--weights: .*resnet.pth.*'tiny'"):
        validate_config(_cfg(tmp_path, weights=str(other)))
    junk = tmp_path / "junk.pth"
    junk.write_bytes(b"not a torch file")
    with pytest.raises(ConfigError, match=r"--weights: .*junk.pth"):
        validate_config(_cfg(tmp_path, weights=str(junk)))


@pytest.mark.parametrize("content, says", [(b"hello world\nnot weights\n", "it starts with 'hello world'"),
                                           (b"", "it is empty"), (bytes(range(3, 200)), "it is neither a zip "
                                                                  "archive nor a pickle")])
def test_a_weights_file_that_is_not_a_checkpoint_says_so(tmp_path, content, says):
    """Was: '--weights: ... KeyError: 101' (torch reading a text file as a pickle)."""
    text = tmp_path / "notes.txt"
    text.write_bytes(content)
    with pytest.raises(ConfigError) as e:
        validate_config(_cfg(tmp_path, weights=str(text)))
    assert str(e.value).startswith(f"--weights: weights file {text} is not a PyTorch checkpoint ({says})")
    assert "KeyError" not in str(e.value)


def test_validate_config_accepts_weights_of_the_same_model(tmp_path):
    good = tmp_path / "tiny.pth"
    torch.save(build_model("tiny").state_dict(), good)
    validate_config(_cfg(tmp_path, weights=str(good)))  # no error


def test_cli_bad_input_exits_2_before_ray(tmp_path):
    """Run as the user does (`python -m`, from the repository root): exit 2, the flag named,
    and no Ray started (it would print Ray's banner and take seconds)."""
    env = {**os.environ, "PYTHONPATH": ""}
    proc = subprocess.run(
        [sys.executable, "-m", "vidtune.trainer.commands.train", "--data", str(tmp_path),
         "--batch-size", "0"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2, proc.stderr
    assert "--batch-size" in proc.stderr and "got 0" in proc.stderr
    assert "Started a local Ray instance" not in proc.stdout + proc.stderr


@pytest.mark.parametrize("name", ["../x", "/etc", "a/b", ".", " padded"])
def test_cli_a_name_that_leaves_storage_exits_2_before_ray(synthetic_root, tmp_path, capsys, monkeypatch,
                                                           name):
    """--name is one folder under --storage, as the search's is: `../x` would write beside it."""
    monkeypatch.setattr(train_run, "init_ray", lambda *a, **kw: pytest.fail("Ray was started"))
    code = train.main(["--data", str(synthetic_root), "--storage", str(tmp_path / "runs"), "--name", name])
    err = capsys.readouterr().err
    assert code == 2, err
    assert f"--name: {name!r} is not a folder name: the run's folder is --storage/NAME" in err, err
    assert not (tmp_path / "x").exists()


def test_cli_missing_data_exits_2(tmp_path, capsys):
    assert train.main(["--data", str(tmp_path / "missing")]) == 2
    assert "--data" in capsys.readouterr().err


def test_cli_batch_larger_than_dataset_exits_2(synthetic_root, capsys):
    assert train.main(["--data", str(synthetic_root), "--batch-size", "1000"]) == 2
    err = capsys.readouterr().err
    assert "--batch-size" in err and "1000" in err


def test_cli_num_frames_above_the_shortest_video_exits_2_before_ray(synthetic_root, capsys, monkeypatch):
    """The search's check, shared (trainer.ray_setup.launch.check_training_inputs): a clip longer than the
    shortest video is refused before Ray starts, after the data report."""
    def no_ray(*args, **kwargs):
        raise AssertionError("vidtune train started Ray despite a clip longer than every video")

    monkeypatch.setattr(train_run, "init_ray", no_ray)
    assert train.main(["--data", str(synthetic_root), "--model", "swin3d_t", "--weights", "none",
                       "--num-frames", "1000"]) == 2
    captured = capsys.readouterr()
    assert "--num-frames: 1000 frames per clip is more than the shortest usable video" in captured.err
    assert captured.out.startswith("Dataset ")          # the data report came first


def test_cli_flags_reach_the_config():
    args = train.build_parser().parse_args(
        ["--data", "d", "--height", "48", "--width", "48", "--num-frames", "4", "--grad-accum", "2",
         "--precision", "bf16", "--freeze-backbone-epochs", "1", "--channels-last", "--positive-class",
         "Violence", "--cache-dir", "/tmp/c", "--cache-format", "raw"])
    cfg = train.config_from_args(args)
    assert (cfg.data.height, cfg.data.width, cfg.data.num_frames) == (48, 48, 4)
    assert cfg.grad_accum_steps == 2 and cfg.precision == "bf16" and cfg.channels_last
    assert cfg.freeze_backbone_epochs == 1 and cfg.data.positive_class == "Violence"
    assert (cfg.data.clip_cache, cfg.data.clip_cache_dir, cfg.data.clip_cache_format) == \
        (True, "/tmp/c", "raw")
    no_cache = train.config_from_args(train.build_parser().parse_args(["--data", "d", "--no-cache"]))
    assert no_cache.data.clip_cache is False
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg


def test_every_flag_has_help():
    for action in train.build_parser()._actions:
        assert action.help, action.option_strings


def test_train_and_search_share_the_training_flags():
    """One declaration per option: the same flag, the same default, in both CLIs."""
    def flags(parser):
        return {o: a.dest.removeprefix("train.") for a in parser._actions for o in a.option_strings}

    train_flags, search_flags = flags(train.build_parser()), flags(search_parser())
    training = {spec.flag for spec in TRAIN_FLAGS}
    shared = {f: d for f, d in train_flags.items() if f in search_flags and f in training}
    assert {"--grad-accum", "--height", "--cache-format", "--precision", "--epochs", "--data"} <= set(shared)
    assert all(search_flags[f] == d for f, d in shared.items())
    assert "--batch-size" in train_flags and "--batch-size" not in search_flags   # the search draws it


def test_negative_values_reach_the_range_check(capsys, tmp_path):
    assert train.main(["--data", str(tmp_path), "--lr", "-1e-3"]) == 2
    assert "--lr: got -0.001; it must be a number > 0" in capsys.readouterr().err


@pytest.mark.slow
def test_cli_trains_prints_epochs_and_checkpoint_then_predict_uses_it(ray_session, synthetic_root, tmp_path,
                                                                       capsys):
    """`vidtune train` end to end (in-process, on the shared Ray): one line per epoch,
    the best checkpoint's path at the end; trainer.serving.predict scores 2 videos with it and names a
    missing one."""
    code = train.main(["--data", str(synthetic_root), "--epochs", "1", "--batch-size", "8", "--precision",
                       "fp32", "--loader-workers", "1", "--storage", str(tmp_path), "--name", "cli"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert re.search(r"^epoch 1/1  train_loss [0-9.]+  val_loss [0-9.]+  val_acc [0-9.]+ .* clips/s", out,
                     flags=re.M), out
    match = re.search(r"^best checkpoint \(epoch 1, val_acc [0-9.]+\): (\S+)$", out, flags=re.M)
    assert match, out
    checkpoint = Path(match.group(1))
    assert (checkpoint / "checkpoint.pt").is_file() and checkpoint.is_relative_to(tmp_path)

    videos = sorted((synthetic_root / "val").rglob("*.mp4"))[:2]
    missing = tmp_path / "gone.mp4"
    code = predict.main(["--checkpoint", str(checkpoint), str(videos[0]), str(missing), str(videos[1])])
    out, err = capsys.readouterr()
    assert code == 1 and "gone.mp4" in err
    # The centred clip, as validation scored it (trainer/serving/scoring_rule.py)
    scores = [float(x) for x in re.findall(r": P\(Fight\) ([0-9.]+) \(centre clip\)", out)]
    assert len(scores) == 2 and all(0.0 <= s <= 1.0 for s in scores), out


# --config: retrain a search's best trial from its best_config.json; flags override the file.

def _best_config(path: Path, train_config: TrainConfig, **row) -> Path:
    """A best_config.json as the search writes it (vidtune.tune.summary.summarise): the best
    trial's row, the objective, and that trial's full TrainConfig."""
    doc = {"trial_id": "a1b2c_00003", "name": "t03-bs16-lr1.5e-4", "search": "vidtune-search-demo",
           "batch_size": train_config.batch_size,
           "lr": train_config.lr, "weight_decay": train_config.weight_decay, "best_val_acc": 0.875,
           "best_val_f1": 0.86, "speed_clips_per_s": 41.5, "epoch_time_s": 3.2, "epochs": train_config.epochs,
           "status": "DONE",
           "checkpoint": "/tmp/ray/ckpt", "objective": "val_acc", "train_config": train_config.to_dict(),
           **row}
    path.write_text(json.dumps(doc, indent=2, sort_keys=True, default=str))
    return path


def _searched(root) -> TrainConfig:
    return TrainConfig(data=DataConfig(root=str(root), height=64, width=64, num_frames=8, loader_workers=1,
                                       clip_cache=False),
                       model="tiny", epochs=5, batch_size=16, lr=1.5e-4, weight_decay=0.01,
                       grad_accum_steps=2, precision="fp32", seed=7)


def _from_cli(argv) -> TrainConfig:
    return train.config_from_args(train.parse_args(argv))


def test_config_best_config_json_flags_override(tmp_path):
    searched = _searched(tmp_path / "videos")
    file = _best_config(tmp_path / "best_config.json", searched)
    assert _from_cli(["--config", str(file)]) == searched
    assert _from_cli(["--config", str(file), "--epochs", "1", "--batch-size", "2"]) == \
        searched.with_overrides(epochs=1, batch_size=2)
    # the data root comes from the file unless --data is given; the file's other data fields stay
    other = _from_cli(["--config", str(file), "--data", str(tmp_path / "elsewhere"), "--cache-dir", "/tmp/c"])
    assert other.data == DataConfig(**{**searched.data.to_dict(), "root": str(tmp_path / "elsewhere"),
                                       "clip_cache_dir": "/tmp/c"})
    assert other.with_overrides(data=searched.data) == searched


def test_config_flat_flag_keys_toml_and_nested_yaml(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text(f'data = "{tmp_path}"\nbatch-size = 4\ngrad-accum = 3\nlr = 1\nno-cache = true\n'
                    'height = 48\nwidth = 48\nprecision = "bf16"\nchannels-last = true\n')
    cfg = _from_cli(["--config", str(toml), "--lr", "0.01"])
    assert cfg == TrainConfig(data=DataConfig(root=str(tmp_path), clip_cache=False, height=48, width=48),
                              batch_size=4, grad_accum_steps=3, lr=0.01, precision="bf16", channels_last=True)
    yaml_file = tmp_path / "run.yaml"
    yaml_file.write_text(f"epochs: 2\nweight_decay: 0\ndata:\n  root: {tmp_path}\n  clip_cache_format: raw\n")
    cfg = _from_cli(["--config", str(yaml_file)])
    assert (cfg.epochs, cfg.weight_decay, cfg.data.root, cfg.data.clip_cache_format) == \
        (2, 0.0, str(tmp_path), "raw")
    assert cfg.batch_size == TrainConfig().batch_size


@pytest.mark.parametrize(
    "text, expected",
    [
        ('{"train_config": {"batch_size": 8, "dropout": 0.1, "data": {"root": "d", "fps": 5}}}',
         ["train_config.dropout", "train_config.data.fps"]),
        ('{"batch_size": "eight"}', ["batch_size", "give an integer"]),
        ('{"data": {"clip_cache": "yes"}}', ["data.clip_cache", "give true or false"]),
        ('{"batch-size": 4, "batch_size": 8}', ["batch-size and batch_size", "--batch-size", "keep one"]),
        ('{"trial_id": "x", "batch_size": 8}', ["'trial_id'", "train_config"]),
        ('{"train_config": "bs=8"}', ["train_config must be an object"]),
        ('{"lr": 3e-4,', ["cannot be read as JSON"]),
        ('[1, 2]', ["must hold an object"]),
    ],
)
def test_config_bad_file_exits_2_naming_file_and_key(tmp_path, capsys, text, expected):
    file = tmp_path / "best_config.json"
    file.write_text(text)
    assert train.main(["--config", str(file)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"vidtune train: error: --config: {file}"), err
    assert all(x in err for x in expected), err


def test_config_missing_or_unknown_type_exits_2(tmp_path, capsys):
    assert train.main(["--config", str(tmp_path / "nowhere.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("vidtune train: error: --config: ") and "nowhere.json is not a file" in err
    ini = tmp_path / "run.ini"
    ini.write_text("[x]\n")
    assert train.main(["--config", str(ini)]) == 2
    assert "use .json, .toml, .yaml or .yml" in capsys.readouterr().err


def test_config_prints_the_trial_and_blames_the_file_for_its_values(tmp_path, capsys):
    """The start line names the trial and search; a value the file set that fails a check names
    the key and file (before Ray: the data folder is checked before anything starts)."""
    file = _best_config(tmp_path / "best_config.json", _searched(tmp_path / "gone"))
    assert train.main(["--config", str(file)]) == 2
    out, err = capsys.readouterr()
    assert out.startswith(f"config: {file} (the best trial t03-bs16-lr1.5e-4 of search vidtune-search-demo, "
                          "val_acc 0.875)"), out
    assert err.startswith("vidtune train: error: --data: ") and "does not exist" in err, err
    assert f"set by train_config.data.root in {file}" in err, err
    file = _best_config(tmp_path / "best_config.json", _searched(tmp_path).with_overrides(batch_size=0))
    assert train.main(["--config", str(file)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("vidtune train: error: --batch-size: got 0"), err
    assert f"train_config.batch_size in {file}" in err, err
    # a flag given is blamed as a flag
    assert train.main(["--config", str(file), "--batch-size", "-1"]) == 2
    err = capsys.readouterr().err
    assert "--batch-size: got -1" in err and str(file) not in err, err


# -- the search's resource checks, shared (trainer.cluster.capacity), before Ray starts -----------------

def _no_ray(monkeypatch, machine=(8.0, 1.0)):
    """`vidtune train` on a machine of `machine` (CPUs, GPUs), where starting Ray fails the test."""
    from vidtune.trainer.cluster.capacity import ClusterCapacity

    def no_ray(*args, **kwargs):
        raise AssertionError("vidtune train started Ray for a run the machine cannot hold")

    monkeypatch.setattr(train_run, "init_ray", no_ray)
    monkeypatch.setattr(train, "local_capacity", lambda: ClusterCapacity((machine,), machine))


@pytest.mark.parametrize("argv, machine, needles", [
    # NCCL refuses two ranks of one run on one GPU
    (["--workers", "2", "--gpus-per-worker", "0.5"], (8.0, 1.0),
     ["--gpus-per-worker: 0.5 GPU per worker with --workers 2", "--gpus-per-worker 1"]),
    (["--gpus-per-worker", "1.5"], (8.0, 2.0), ["--gpus-per-worker: 1.5 GPUs per worker", "whole number"]),
    # more workers than GPUs: Train would retry placing them forever
    (["--workers", "2"], (8.0, 1.0), ["--workers: the run asks for 2 GPU(s) (--workers 2 x 1 per worker) "
                                      "but this machine has 1", "--address"]),
    (["--workers", "2", "--gpus-per-worker", "1"], (8.0, 1.0),
     ["--gpus-per-worker: the run asks for 2 GPU(s)"]),
    (["--workers", "3"], (2.0, 0.0), ["--workers/--cpus-per-worker: the run asks for 3 CPUs", "has 2"]),
    (["--cpus-per-worker", "4"], (2.0, 0.0), ["--workers/--cpus-per-worker:", "--cpus-per-worker 4"]),
])
def test_cli_resources_the_machine_cannot_hold_exit_2_before_ray(synthetic_root, capsys, monkeypatch, argv,
                                                                 machine, needles):
    _no_ray(monkeypatch, machine)
    assert train.main(["--data", str(synthetic_root), *argv]) == 2
    err = capsys.readouterr().err
    assert all(n in err for n in needles), err


def test_cli_on_a_cluster_checks_its_nodes_and_the_autoscalers_once_connected(synthetic_root, capsys,
                                                                                monkeypatch):
    """With --address the machine is not the cluster: the check runs once connected, on the nodes
    alive and those the autoscaler may start, and a refusal is still exit 2 before any worker."""
    from vidtune.trainer.cluster.capacity import AUTOSCALER_CONFIG, ClusterCapacity, NodeType

    read = []
    head = (4.0, 0.0)

    def capacity(config):
        read.append(config)
        return ClusterCapacity((head,), head, (NodeType("gpu", 8.0, 1.0, 2),))

    class Built(Exception):
        pass

    def no_trainer(cfg, **kw):
        raise Built(kw["num_workers"], kw["use_gpu"], kw["resources_per_worker"])

    monkeypatch.setattr(train_run, "init_ray", lambda **kw: True)
    monkeypatch.setattr(train, "local_capacity", lambda: pytest.fail("the local machine was checked"))
    monkeypatch.setattr(train_run, "read_capacity", capacity)
    monkeypatch.setattr(train_run, "build_torch_trainer", no_trainer)
    monkeypatch.setattr(train_run, "_epoch_printer", lambda epochs: (None, lambda: None))
    assert train.main(["--data", str(synthetic_root), "--address", "auto", "--workers", "3"]) == 2
    assert "--workers: the run asks for 3 GPU(s)" in capsys.readouterr().err and read == [AUTOSCALER_CONFIG]
    with pytest.raises(Built) as built:       # two GPU nodes to come: the run waits for them
        train.main(["--data", str(synthetic_root), "--address", "auto", "--workers", "2"])
    assert built.value.args == (2, True, {"CPU": 1.0, "GPU": 1.0})
