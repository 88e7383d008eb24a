"""The search CLI: help, config files, presets, and every bad input failing fast (exit code 2,
a message naming the flag / key / file, no traceback), mostly in-process with --dry-run."""
from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
import tempfile
import typing
from pathlib import Path

import pytest

from vidtune.datasets.config import DataConfig
from vidtune.datasets.index import build_index
from vidtune.flags import ConfigError
from vidtune.trainer.ray_setup import launch
from vidtune.trainer.training.config import TrainConfig
from vidtune.tune import search
from vidtune.tune.config import demo
from vidtune.tune.config.options import (
    SEARCHED,
    SMOKE_TEST,
    SearchOptions,
    base_config,
    build_parser,
    parse_options,
)

REPO = Path(__file__).resolve().parents[1]


def _fails(capsys, argv: list[str], *needles: str, before_data: bool = False) -> str:
    """`vidtune search ARGV` exits 2 with one error naming every needle; `before_data`: refused
    before the dataset was read (no demo videos made, nothing indexed)."""
    assert search.main(argv) == 2
    out, err = capsys.readouterr()
    assert err.startswith("vidtune search: error: ") and "Traceback" not in err
    for needle in needles:
        assert needle in err, err
    if before_data:
        assert "demo:" not in out and "Probed" not in out, out
    return err


def test_every_flag_has_help_and_the_help_is_grouped():
    parser = build_parser()
    flags = [a for a in parser._actions if a.option_strings and a.dest != "help"]
    assert len(flags) >= 40
    for action in flags:
        assert action.help and len(action.help) > 10, action.option_strings
        assert all(f == f.lower() and "_" not in f for f in action.option_strings)
    text = parser.format_help()
    for group in ("data:", "model and training:", "search space:", "search:", "where it runs:", "tracking:",
                  "run:"):
        assert group in text
    # Every option of the search, nested ones included, has a flag whose dest is its path.
    dests = {a.dest for a in flags}
    assert _leaf_paths(SearchOptions) - set(SEARCHED) == dests
    # Every training option is reachable from the search, except those the search draws.
    assert {"train." + p for p in _leaf_paths(TrainConfig)} - set(SEARCHED) <= dests


def _leaf_paths(cls, prefix=""):
    hints = typing.get_type_hints(cls)
    out = set()
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            out |= _leaf_paths(hints[f.name], prefix + f.name + ".")
        else:
            out.add(prefix + f.name)
    return out


def test_training_options_reach_the_trials(tmp_path):
    opts = parse_options(["--grad-accum", "2", "--channels-last", "--warmup-frac", "0.2", "--label-smoothing",
                          "0.1", "--freeze-backbone-epochs", "1", "--no-cache", "--height", "64", "--seed",
                          "7", "--cpu-threads", "3"])
    t = opts.train
    assert (t.grad_accum_steps, t.channels_last, t.warmup_frac, t.label_smoothing, t.freeze_backbone_epochs,
            t.data.clip_cache, t.data.height, t.seed, t.cpu_threads) == \
        (2, True, 0.2, 0.1, 1, False, 64, 7, 3)
    from vidtune.tune.running.trial import trial_config  # imports Ray: only in the test that needs it

    cfg = trial_config(base_config(opts), {"batch_size": 4, "lr": 1e-3})
    assert cfg.grad_accum_steps == 2 and cfg.batch_size == 4 and cfg.lr == 1e-3 and not cfg.data.clip_cache
    toml = tmp_path / "s.toml"
    toml.write_text("no-cache = true\ngrad_accum = 3\n")
    opts = parse_options(["--config", str(toml)])
    assert not opts.train.data.clip_cache and opts.train.grad_accum_steps == 3
    toml.write_text("cache = false\n")
    assert not parse_options(["--config", str(toml)]).train.data.clip_cache


def test_flags_override_the_config_file_which_overrides_the_preset(tmp_path):
    toml = tmp_path / "search.toml"
    toml.write_text('epochs = 7\nbatch-sizes = [2, 6]\nlr_min = 1e-5\nobjective = "val_f1"\nsmoke-test = '
                    'true\n')
    opts = parse_options(["--config", str(toml), "--epochs", "9"])
    assert opts.train.epochs == 9                             # flag beats file
    # file beats preset
    assert opts.space.batch_sizes == (2, 6) and opts.space.lr_min == 1e-5 and opts.objective == "val_f1"
    assert opts.num_samples == SMOKE_TEST["num_samples"]      # preset beats defaults
    yaml = tmp_path / "search.yaml"
    yaml.write_text("batch_sizes: 4,8\nnum-samples: 12\nsearch-weight-decay: true\n")
    opts = parse_options(["--config", str(yaml)])
    assert opts.space.batch_sizes == (4, 8) and opts.num_samples == 12 and opts.space.search_weight_decay


def test_smoke_test_preset_shrinks_everything():
    opts = parse_options(["--smoke-test"])
    assert opts.num_samples == 2 and opts.train.epochs == 1 and opts.space.batch_sizes == (4,)
    assert opts.train.data.loader_workers == 1 and not opts.early_stop
    assert parse_options(["--smoke-test", "--epochs", "2"]).train.epochs == 2


@pytest.mark.parametrize("text, needle", [
    ("lr-mni = 1e-4\n", "unknown option 'lr-mni' in"),
    ("epochs = 'ten'\n", "epochs (in"),
    ("batch-sizes = [4, 'x']\n", "batch-sizes (in"),
    ("lr = 1e-3\n", "the search chooses it: set lr-min and lr-max"),
    ("cache-format = 'png'\n", "choose one of auto, jpeg, raw"),
    ("epochs = \n", "cannot be parsed"),
])
def test_config_file_errors_name_the_key_and_the_file(tmp_path, capsys, text, needle):
    cfg = tmp_path / "bad.toml"
    cfg.write_text(text)
    err = _fails(capsys, ["--config", str(cfg), "--dry-run"], needle)
    assert str(cfg) in err


def test_config_file_must_exist_and_be_toml_or_yaml(tmp_path, capsys):
    _fails(capsys, ["--config", str(tmp_path / "nope.toml")], "--config:", "nope.toml is not a file")
    (tmp_path / "opts.json").write_text("{}")
    _fails(capsys, ["--config", str(tmp_path / "opts.json")], "--config:", "unknown file type '.json'")


@pytest.mark.parametrize("argv, needles", [
    (["--data", "/nonexistent/videos"], ["--data:", "/nonexistent/videos does not exist"]),
    (["--batch-sizes", ","], ["--batch-sizes:", "empty list"]),
    (["--batch-sizes", "0,8"], ["--batch-sizes:", "each >= 1"]),
    (["--lr-min", "-1e-3"], ["--lr-min:", "got -0.001", "> 0"]),
    (["--epochs", "0"], ["--epochs:", ">= 1"]),
    (["--warmup-frac", "1"], ["--warmup-frac:", "< 1"]),
    (["--storage", "/proc/self/status/results"], ["--storage:", "not a folder"]),
    (["--lr-min", "1e-2", "--lr-max", "1e-3"], ["--lr-min/--lr-max:", "inverted"]),
    (["--lr-min", "-1"], ["--lr-min:", "> 0"]),
    (["--num-samples", "0"], ["--num-samples:"]),
    (["--search-weight-decay", "--weight-decay-min", "0.5", "--weight-decay-max", "0.1"],
     ["--weight-decay-min/--weight-decay-max:"]),
    (["--gpus-per-worker", "1", "--gpus-per-trial", "0.5", "--workers-per-trial", "2"],
     ["--gpus-per-trial:", "disagrees"]),
    (["--cache-max-gb", "-1"], ["--cache-max-gb:", ">= 0"]),
    (["--cpu-threads", "0"], ["--cpu-threads:", ">= 1"]),
    (["--cache-max-gb", "nan"], ["--cache-max-gb:"]),
    (["--cache-dir", "/proc/self/status/cache"], ["--cache-dir:", "not a folder"]),
    (["--name", "../../etc"], ["--name:", "'../../etc' is not a folder name"]),
    (["--name", "a/b"], ["--name:", "'a/b' is not a folder name"]),
    (["--name", "."], ["--name:", "'.' is not a folder name"]),
    (["--name", ""], ["--name:", "'' is not a folder name"]),
    (["--epochs", "3", "--grace-period", "4"], ["--grace-period:", "4 is above --epochs 3"]),
    (["--trust-state"], ["--trust-state:", "only with --resume"]),
    (["--mlflow-uri", "http://127.0.0.1:9"], ["--mlflow-uri:", "cannot reach http://127.0.0.1:9"]),
    (["--time-budget", "2 hours"], ["--time-budget:", "'2 hours'"]),
])
def test_bad_options_fail_before_anything_runs(capsys, argv, needles):
    """Refused before the dataset is read: without --data, before the demo's videos are made or
    indexed (a bad --cache-dir or --storage was refused only after them: 18 s on a new machine)."""
    _fails(capsys, argv + ["--dry-run"], *needles, before_data=True)


def test_bad_stores_fail_fast(capsys, synthetic_root, tmp_path):
    data = ["--data", str(synthetic_root), "--dry-run"]
    _fails(capsys, data + ["--mlflow-uri", "http://127.0.0.1:9"], "--mlflow-uri:", "cannot reach "
           "http://127.0.0.1:9")
    _fails(capsys, data + ["--mlflow-uri", f"sqlite:///{tmp_path}/no/such/mlruns.db"], "--mlflow-uri:",
           "does not exist")
    _fails(capsys, data + ["--optuna-storage", f"sqlite:///{tmp_path}/gone/optuna.db"], "--optuna-storage:")
    _fails(capsys, data + ["--optuna-storage", "optuna.db"], "--optuna-storage:", "database URL")
    _fails(capsys, data + ["--artifact-location", f"{tmp_path}/no/such/artifacts"], "--artifact-location:",
           "does not exist")
    (tmp_path / "a-file").write_text("")
    _fails(capsys, data + ["--artifact-location", str(tmp_path / "a-file")], "--artifact-location:",
           "is a file")


def test_bad_data_fails_with_the_dropped_file_report(capsys, synthetic_root, tmp_path):
    """build_index runs on the driver first: a split/class left empty by broken files fails fast."""
    root = tmp_path / "rwf"
    videos = sorted(p for p in synthetic_root.rglob("*") if p.suffix in (".mp4", ".avi"))
    for split in ("train", "val"):
        for cls in ("Fight", "NonFight"):
            (root / split / cls).mkdir(parents=True)
    for cls in ("Fight", "NonFight"):
        src = [v for v in videos if v.parent.name == cls][0]
        shutil.copy(src, root / "train" / cls / src.name)
    shutil.copy([v for v in videos if v.parent.name == "NonFight"][1], root / "val" / "NonFight" / "ok.mp4")
    (root / "val" / "Fight" / "broken.mp4").write_bytes(b"not a video at all")
    err = _fails(capsys, ["--data", str(root), "--dry-run", "--mlflow-uri", f"sqlite:///{tmp_path}/m.db"],
                 "broken.mp4")
    assert "val" in err


def test_unknown_model_is_named(capsys, synthetic_root):
    _fails(capsys, ["--data", str(synthetic_root), "--model", "resnet", "--dry-run"], "--model:", "resnet")


def test_resume_needs_an_interrupted_search(capsys, synthetic_root, tmp_path):
    _fails(capsys, ["--data", str(synthetic_root), "--resume", "--storage", str(tmp_path), "--dry-run"],
           "--resume:", "no interrupted search")
    (tmp_path / "taken").mkdir()
    _fails(capsys, ["--data", str(synthetic_root), "--name", "taken", "--storage", str(tmp_path),
                    "--dry-run"], "--name:", "already exists")


@pytest.mark.slow   # a search process by path (about 8 s)
def test_dry_run_by_path_prints_the_resolved_configuration(synthetic_root, tmp_path):
    """Run as `vidtune search` from another folder: the repository's `datasets` must win
    over Hugging Face's (installed too), and nothing starts."""
    out = subprocess.run(
        [sys.executable, str(REPO / "tune" / "search.py"), "--data", str(synthetic_root), "--dry-run",
         "--batch-sizes", "2,4", "--lr-min", "1e-4", "--lr-max", "1e-2", "--objective", "pareto",
         "--epochs", "4"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout.split("resolved configuration:\n", 1)[1].rsplit("\ndry run:", 1)[0])
    assert doc["space"]["batch_sizes"] == [2, 4]
    assert (doc["space"]["lr_min"], doc["space"]["lr_max"]) == (1e-4, 1e-2)
    assert doc["early_stopping"] == "off" and doc["objective"] == "pareto"      # never ASHA with pareto
    assert doc["train"]["data"]["root"] == str(synthetic_root) and doc["train"]["epochs"] == 4
    assert "batch_size" not in doc["train"] and "lr" not in doc["train"]     # the search draws them
    assert doc["experiment"].startswith(str(tmp_path / "vidtune-results"))
    assert not (tmp_path / "mlruns.db").exists() and not (tmp_path / "vidtune-results").exists()
    assert doc["train"]["data"]["clip_cache"] is True
    assert doc["train"]["data"]["clip_cache_format"].startswith("auto")


def test_batch_sizes_larger_than_the_training_videos_fail_before_ray(capsys, synthetic_root, tmp_path):
    videos = len(build_index(DataConfig(root=str(synthetic_root))).train)
    err = _fails(capsys, ["--data", str(synthetic_root), "--batch-sizes", f"4,{videos + 1}", "--dry-run",
                          "--mlflow-uri", f"sqlite:///{tmp_path}/m.db"], "--batch-sizes:",
                 f"batch size {videos + 1}")
    assert f"{videos} training videos" in err and "--workers-per-trial" in err
    _fails(capsys, ["--data", str(synthetic_root), "--batch-sizes", str(videos // 2 + 1),
                    "--workers-per-trial", "2", "--dry-run", "--mlflow-uri", f"sqlite:///{tmp_path}/m.db"],
           "--batch-sizes:", "2 worker(s)")


def test_num_frames_above_the_shortest_video_fails_before_ray(capsys, synthetic_root, tmp_path):
    shortest = min(v.num_frames for v in build_index(DataConfig(root=str(synthetic_root))).train)
    args = ["--data", str(synthetic_root), "--model", "swin3d_t", "--weights", "none", "--dry-run",
            "--mlflow-uri", f"sqlite:///{tmp_path}/m.db"]
    _fails(capsys, args + ["--num-frames", "1000"], "--num-frames:", "1000 frames per clip is more than the "
           "shortest",
           f"{shortest} frames", "--min-frames 1000")
    # tiny: 8 frames only
    _fails(capsys, ["--data", str(synthetic_root), "--num-frames", "1000", "--dry-run"],
           "--num-frames:", "takes clips of exactly 8 frames")


def test_dry_run_checks_warm_start_without_batch_sizes(capsys, synthetic_root, tmp_path):
    """--warm-start is checked by --dry-run even when the batch sizes are left to the cluster's
    defaults: a missing folder, or one that is not a search, fails before Ray with nothing made."""
    storage = tmp_path / "results"
    args = ["--data", str(synthetic_root), "--dry-run", "--storage", str(storage),
            "--mlflow-uri", f"sqlite:///{tmp_path}/m.db"]
    _fails(capsys, args + ["--warm-start", str(tmp_path / "nowhere")], "--warm-start:")
    (tmp_path / "not-a-search").mkdir()
    _fails(capsys, args + ["--warm-start", str(tmp_path / "not-a-search")], "--warm-start:")
    assert not storage.exists() or not any(storage.iterdir())


def test_a_negative_time_budget_reaches_its_own_check(capsys, synthetic_root, tmp_path):
    """`--time-budget -5m` used to get argparse's "expected one argument"."""
    _fails(capsys, ["--data", str(synthetic_root), "--dry-run", "--time-budget", "-5m",
                    "--mlflow-uri", f"sqlite:///{tmp_path}/m.db"],
           "--time-budget: '-5m' is not a time budget")


def test_demo_preset_grace_period_follows_a_shorter_epochs():
    assert parse_options(["--epochs", "2"]).grace_period == 2 and parse_options([]).grace_period == 3


def test_read_only_storage_is_named(capsys, tmp_path, monkeypatch):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    real = tempfile.TemporaryFile

    def refuse(*a, dir=None, **kw):   # CI runs as root, which writes anywhere: refuse as the OS would a user
        if dir is not None and Path(dir) == locked:
            raise PermissionError(13, "Permission denied")
        return real(*a, dir=dir, **kw)

    monkeypatch.setattr(launch.tempfile, "TemporaryFile", refuse)
    _fails(capsys, ["--storage", str(locked / "results"), "--dry-run"], "--storage:", "not writable")
    _fails(capsys, ["--cache-dir", str(locked / "cache"), "--dry-run"], "--cache-dir:", "not writable")


@pytest.mark.slow
def test_more_gpus_per_trial_than_the_cluster_has(ray_session, capsys, synthetic_root, tmp_path):
    """Checked right after connecting, before any trial starts."""
    err = _fails(capsys, ["--data", str(synthetic_root), "--gpus-per-trial", "2", "--storage", str(tmp_path),
                          "--mlflow-uri", f"sqlite:///{tmp_path}/m.db"], "--gpus-per-trial:",
                 "the Ray cluster has 0")
    assert "2 GPU(s)" in err
    assert not (tmp_path / "m.db").exists()                    # no MLflow run was opened


def test_usage_error_names_its_flag():
    e = ConfigError("--lr-min", "bad")
    assert e.flag == "--lr-min" and str(e) == "--lr-min: bad"


def test_autoscaling_cluster_config_may_add_gpus(tmp_path):
    """On the head of an autoscaling cluster, 0 GPUs at connect time is not an error when a
    worker node type can bring GPUs (cluster.yaml leaves resources for AWS to detect)."""
    from vidtune.tune.running.cluster import (  # imports Ray: only in the test that needs it
        ClusterCapacity,
        read_node_types,
    )

    def may_add(cfg):
        return ClusterCapacity(((4.0, 0.0),), (4.0, 0.0), read_node_types(cfg)).may_add_gpus

    cfg = tmp_path / "ray_bootstrap_config.yaml"
    assert not may_add(cfg)                                      # not a cluster head
    cfg.write_text("head_node_type: head\navailable_node_types:\n  head: {resources: {}, max_workers: 0}\n"
                   "  gpu: {resources: {}, max_workers: 2}\n")
    assert may_add(cfg)
    cfg.write_text("head_node_type: head\navailable_node_types:\n  head: {resources: {}}\n"
                   "  cpu: {resources: {CPU: 8, GPU: 0}, max_workers: 4}\n  gpu: "
                   "{resources: {GPU: 1}, max_workers: 0}\n")
    assert not may_add(cfg)


@pytest.mark.slow   # generates the demo's 160 videos (about 12 s)
def test_without_data_the_demo_dataset_is_generated_once(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    mlflow = ["--mlflow-uri", f"sqlite:///{tmp_path}/m.db", "--storage", str(tmp_path / "res")]
    assert search.main(["--dry-run", *mlflow]) == 0
    out = capsys.readouterr().out
    root = tmp_path / "cache" / "vidtune" / "demo-rwf"
    assert f"demo: generated the synthetic dataset in {root}" in out
    assert (root / demo.DONE_MARKER).exists() and not list(root.parent.glob("*.tmp-*"))
    doc = json.loads(out.split("resolved configuration:\n", 1)[1].rsplit("\ndry run:", 1)[0])
    assert doc["demo"] is True and doc["train"]["data"]["root"] == str(root)
    assert doc["train"]["model"] == "tiny" and doc["train"]["epochs"] == 6      # the demo preset
    assert search.main(["--dry-run", *mlflow]) == 0              # second run: reused, not regenerated
    assert f"demo: using the synthetic dataset in {root}" in capsys.readouterr().out


def test_a_search_with_ray_token_authentication_off_says_so(monkeypatch, capsys):
    """vidtune never turns Ray's token authentication off; started with it off, it says so in one
    line before Ray starts (trainer.ray_setup.launch.init_ray, which the search and vidtune train call)."""
    import ray

    started = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: started.append(kw))
    # Ray's fixed ports free, whatever other Ray runs here (its own note: tests/test_listeners.py)
    monkeypatch.setattr(launch, "taken_fixed_ports", lambda **_: [])
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    assert launch.init_ray(num_cpus=1) and started
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "token authentication is off (RAY_AUTH_MODE=disabled)" in out
    for mode in ("token", "TOKEN"):
        monkeypatch.setenv("RAY_AUTH_MODE", mode)
        assert launch.auth_off_note() is None
    monkeypatch.delenv("RAY_AUTH_MODE")
    assert launch.auth_off_note() is None
    launch.init_ray(num_cpus=1)
    assert capsys.readouterr().out == ""
