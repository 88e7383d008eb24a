"""The search CLI: help, config files, presets, and every bad input failing fast (exit code 2,
a message naming the flag / key / file, no traceback), mostly in-process with --dry-run."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tune import search
from tune.options import SMOKE_TEST, SearchOptions, UsageError, build_parser, parse_options

REPO = Path(__file__).resolve().parents[1]


def _fails(capsys, argv: list[str], *needles: str) -> str:
    assert search.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("vidtune search: error: ") and "Traceback" not in err
    for needle in needles:
        assert needle in err, err
    return err


def test_every_flag_has_help_and_the_help_is_grouped():
    parser = build_parser()
    flags = [a for a in parser._actions if a.option_strings and a.dest != "help"]
    assert len(flags) >= 40
    for action in flags:
        assert action.help and len(action.help) > 10, action.option_strings
        assert all(f == f.lower() and "_" not in f for f in action.option_strings)
    text = parser.format_help()
    for group in ("data:", "model and training:", "search space:", "search:", "where it runs:", "tracking:", "run:"):
        assert group in text
    # Every SearchOptions field (except the config path itself) can be set by a flag.
    dests = {a.dest for a in flags}
    assert set(SearchOptions.__dataclass_fields__) <= dests


def test_flags_override_the_config_file_which_overrides_the_preset(tmp_path):
    toml = tmp_path / "search.toml"
    toml.write_text('epochs = 7\nbatch-sizes = [2, 6]\nlr_min = 1e-5\nobjective = "val_f1"\nsmoke-test = true\n')
    opts = parse_options(["--config", str(toml), "--epochs", "9"])
    assert opts.epochs == 9                                   # flag beats file
    assert opts.batch_sizes == (2, 6) and opts.lr_min == 1e-5 and opts.objective == "val_f1"   # file beats preset
    assert opts.num_samples == SMOKE_TEST["num_samples"]      # preset beats defaults
    yaml = tmp_path / "search.yaml"
    yaml.write_text("batch_sizes: 4,8\nnum-samples: 12\nsearch-weight-decay: true\n")
    opts = parse_options(["--config", str(yaml)])
    assert opts.batch_sizes == (4, 8) and opts.num_samples == 12 and opts.search_weight_decay


def test_smoke_test_preset_shrinks_everything():
    opts = parse_options(["--smoke-test"])
    assert opts.num_samples == 2 and opts.epochs == 1 and opts.batch_sizes == (4,)
    assert parse_options(["--smoke-test", "--epochs", "2"]).epochs == 2


@pytest.mark.parametrize("text, needle", [
    ("lr-mni = 1e-4\n", "unknown option 'lr-mni' in"),
    ("epochs = 'ten'\n", "epochs (in"),
    ("batch-sizes = [4, 'x']\n", "batch-sizes (in"),
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
    (["--batch-sizes", ","], ["--batch-sizes:", "non-empty"]),
    (["--batch-sizes", "0,8"], ["--batch-sizes:", "positive"]),
    (["--lr-min", "1e-2", "--lr-max", "1e-3"], ["--lr-min/--lr-max:", "inverted"]),
    (["--lr-min", "-1"], ["--lr-min:", "> 0"]),
    (["--num-samples", "0"], ["--num-samples:"]),
    (["--search-weight-decay", "--weight-decay-min", "0.5", "--weight-decay-max", "0.1"], ["--weight-decay-min/--weight-decay-max:"]),
    (["--gpus-per-worker", "1", "--gpus-per-trial", "0.5", "--workers-per-trial", "2"], ["--gpus-per-trial:", "disagrees"]),
    (["--cache-max-gb", "-1"], ["--cache-max-gb:", ">= 0"]),
    (["--cache-max-gb", "nan"], ["--cache-max-gb:"]),
    (["--cache-dir", "/proc/self/status/cache"], ["--cache-dir:", "not a folder"]),
])
def test_bad_options_fail_before_anything_runs(capsys, argv, needles):
    _fails(capsys, argv + ["--dry-run"], *needles)


def test_bad_stores_fail_fast(capsys, synthetic_root, tmp_path):
    data = ["--data", str(synthetic_root), "--dry-run"]
    _fails(capsys, data + ["--mlflow-uri", "http://127.0.0.1:9"], "--mlflow-uri:", "cannot reach http://127.0.0.1:9")
    _fails(capsys, data + ["--mlflow-uri", f"sqlite:///{tmp_path}/no/such/mlruns.db"], "--mlflow-uri:", "does not exist")
    _fails(capsys, data + ["--optuna-storage", f"sqlite:///{tmp_path}/gone/optuna.db"], "--optuna-storage:")
    _fails(capsys, data + ["--optuna-storage", "optuna.db"], "--optuna-storage:", "database URL")


def test_bad_data_fails_with_the_dropped_file_report(capsys, synthetic_root, tmp_path):
    """build_index runs on the driver first: a split/class left empty by broken files fails fast."""
    root = tmp_path / "rwf"
    videos = sorted(p for p in synthetic_root.rglob("*") if p.suffix in (".mp4", ".avi"))
    for split in ("train", "val"):
        for cls in ("Fight", "NonFight"):
            (root / split / cls).mkdir(parents=True)
    for i, cls in enumerate(("Fight", "NonFight")):
        src = [v for v in videos if v.parent.name == cls][0]
        shutil.copy(src, root / "train" / cls / src.name)
    shutil.copy([v for v in videos if v.parent.name == "NonFight"][1], root / "val" / "NonFight" / "ok.mp4")
    (root / "val" / "Fight" / "broken.mp4").write_bytes(b"not a video at all")
    err = _fails(capsys, ["--data", str(root), "--dry-run", "--mlflow-uri", f"sqlite:///{tmp_path}/m.db"], "broken.mp4")
    assert "val" in err


def test_unknown_model_is_named(capsys, synthetic_root):
    _fails(capsys, ["--data", str(synthetic_root), "--model", "resnet", "--dry-run"], "--model:", "resnet")


def test_resume_needs_an_interrupted_search(capsys, synthetic_root, tmp_path):
    _fails(capsys, ["--data", str(synthetic_root), "--resume", "--storage", str(tmp_path), "--dry-run"],
           "--resume:", "no interrupted search")
    (tmp_path / "taken").mkdir()
    _fails(capsys, ["--data", str(synthetic_root), "--name", "taken", "--storage", str(tmp_path), "--dry-run"],
           "--name:", "already exists")


def test_dry_run_by_path_prints_the_resolved_configuration(synthetic_root, tmp_path):
    """Run as `python tune/search.py` from another folder: the repository's `datasets` must win
    over Hugging Face's (installed too), and nothing starts."""
    out = subprocess.run(
        [sys.executable, str(REPO / "tune" / "search.py"), "--data", str(synthetic_root), "--dry-run",
         "--batch-sizes", "2,4", "--lr-min", "1e-4", "--lr-max", "1e-2", "--objective", "pareto", "--epochs", "4"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout.split("resolved configuration:\n", 1)[1].rsplit("\ndry run:", 1)[0])
    assert doc["search"]["batch_sizes"] == [2, 4] and doc["search"]["lr"] == [1e-4, 1e-2]
    assert doc["search"]["early_stop"] == "off"               # never with pareto
    assert doc["train_config"]["data"]["root"] == str(synthetic_root)
    assert doc["experiment"].startswith(str(tmp_path / "vidtune-results"))
    assert not (tmp_path / "mlruns.db").exists() and not (tmp_path / "vidtune-results").exists()
    assert doc["clip_cache"]["enabled"] is True and doc["clip_cache"]["format"].startswith("auto")


def test_unwritable_cache_dir_is_named(capsys, tmp_path, monkeypatch):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    real_access = os.access
    # CI runs as root, which writes anywhere: make this folder read-only to the check as it is to users
    monkeypatch.setattr(os, "access", lambda p, mode: False if Path(p) == locked else real_access(p, mode))
    _fails(capsys, ["--cache-dir", str(locked / "cache"), "--dry-run"], "--cache-dir:", "not writable")


@pytest.mark.slow
def test_more_gpus_per_trial_than_the_cluster_has(ray_session, capsys, synthetic_root, tmp_path):
    """Checked right after connecting, before any trial starts."""
    err = _fails(capsys, ["--data", str(synthetic_root), "--gpus-per-trial", "2", "--storage", str(tmp_path),
                          "--mlflow-uri", f"sqlite:///{tmp_path}/m.db"], "--gpus-per-trial:", "the Ray cluster has 0")
    assert "2 GPU(s)" in err
    assert not (tmp_path / "m.db").exists()                    # no MLflow run was opened


def test_usage_error_names_its_flag():
    e = UsageError("--lr-min", "bad")
    assert e.flag == "--lr-min" and str(e) == "--lr-min: bad"


def test_autoscaling_cluster_config_may_add_gpus(tmp_path):
    """On the head of an autoscaling cluster, 0 GPUs at connect time is not an error when a
    worker node type can bring GPUs (cluster.yaml leaves resources for AWS to detect)."""
    from tune.runner import autoscaler_may_add_gpus

    cfg = tmp_path / "ray_bootstrap_config.yaml"
    assert not autoscaler_may_add_gpus(cfg)                      # not a cluster head
    cfg.write_text("head_node_type: head\navailable_node_types:\n  head: {resources: {}, max_workers: 0}\n"
                   "  gpu: {resources: {}, max_workers: 2}\n")
    assert autoscaler_may_add_gpus(cfg)
    cfg.write_text("head_node_type: head\navailable_node_types:\n  head: {resources: {}}\n"
                   "  cpu: {resources: {CPU: 8, GPU: 0}, max_workers: 4}\n  gpu: {resources: {GPU: 1}, max_workers: 0}\n")
    assert not autoscaler_may_add_gpus(cfg)


def test_without_data_the_demo_dataset_is_generated_once(monkeypatch, tmp_path, capsys):
    from tune import demo

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    mlflow = ["--mlflow-uri", f"sqlite:///{tmp_path}/m.db", "--storage", str(tmp_path / "res")]
    assert search.main(["--dry-run", *mlflow]) == 0
    out = capsys.readouterr().out
    root = tmp_path / "cache" / "vidtune" / "demo-rwf"
    assert f"demo: generated the synthetic dataset in {root}" in out
    assert (root / demo.DONE_MARKER).exists() and not list(root.parent.glob("*.tmp-*"))
    doc = json.loads(out.split("resolved configuration:\n", 1)[1].rsplit("\ndry run:", 1)[0])
    assert doc["demo"] is True and doc["train_config"]["data"]["root"] == str(root)
    assert doc["train_config"]["model"] == "tiny"
    assert search.main(["--dry-run", *mlflow]) == 0              # second run: reused, not regenerated
    assert f"demo: using the synthetic dataset in {root}" in capsys.readouterr().out
