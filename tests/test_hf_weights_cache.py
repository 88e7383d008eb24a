"""`--weights-cache PATH`: the Hugging Face hub cache the driver fetches `hf:` checkpoints into and
every Ray worker loads them from; checked before Ray starts, named by the refusal of a checkpoint
that cannot be had, kept by a resume. No network: a folder laid out like the hub cache, offline."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_hf_models import fill_hub_cache, save_tiny
from tests.test_saved_options import _started_search
from vidtune.datasets.config import DataConfig
from vidtune.flags import ConfigError
from vidtune.trainer.commands import train
from vidtune.trainer.models import hf_models
from vidtune.trainer.models import registry as models
from vidtune.trainer.ray_setup.launch import validate_config, worker_env_vars
from vidtune.trainer.training.config import TrainConfig
from vidtune.tune import search

pytest.importorskip("transformers")
REPO_ID = "vidtune-test/weights-cache-videomae"    # its own: get_spec remembers a hub id's folder


@pytest.fixture
def offline(monkeypatch, tmp_path):
    """The hub unreachable (HF_HUB_OFFLINE, as huggingface_hub read it at import too), an empty
    HF_HOME, no HF_HUB_CACHE (restored after the test: --weights-cache sets it)."""
    from huggingface_hub import constants

    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "empty-hf-home"))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty-hf-home" / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory) -> Path:
    """A hub cache (as --weights-cache names it) holding the tiny VideoMAE as hub id REPO_ID."""
    cache = tmp_path_factory.mktemp("shared") / "hf-cache"
    fill_hub_cache(cache, REPO_ID, save_tiny("videomae", tmp_path_factory.mktemp("videomae")))
    return cache


def test_a_weights_cache_that_is_no_writable_folder_stops_train_and_search_in_one_line(
        synthetic_root, tmp_path, capsys, monkeypatch, no_ray):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    a_file = tmp_path / "cache.txt"
    a_file.write_text("x")
    for bad, says in ((str(a_file), f"{a_file} is not a folder"), ("s3://bucket/hf", "is a URI")):
        assert train.main(["--data", str(synthetic_root), "--weights-cache", bad]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "--weights-cache: " in err and says in err, err
        assert search.main(["--data", str(synthetic_root), "--weights-cache", bad, "--storage",
                            str(tmp_path / "results"), "--num-samples", "1", "--epochs", "1"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "--weights-cache: " in err and says in err, err
    assert "HF_HUB_CACHE" not in os.environ                # refused before it was used


def test_the_driver_reads_a_hub_id_from_the_weights_cache_and_the_workers_get_it(offline, hub_cache,
                                                                                 tmp_path):
    base = dict(data=DataConfig(root=str(tmp_path)), model=f"hf:{REPO_ID}")
    with pytest.raises(ConfigError) as refused:          # not in HF_HOME's cache: the refusal names both
        validate_config(TrainConfig(**base))
    line = str(refused.value)
    assert "\n" not in line and line.startswith(f"--model: Hugging Face model '{REPO_ID}'")
    assert "--weights-cache" in line and "HF_HOME" in line and str(tmp_path / "empty-hf-home") in line

    validate_config(TrainConfig(**base, weights_cache=str(hub_cache)))
    assert os.environ["HF_HUB_CACHE"] == str(hub_cache.resolve())
    assert hf_models.local_checkpoint(REPO_ID).is_relative_to(hub_cache)
    spec = models.get_spec(f"hf:{REPO_ID}")
    assert (spec.num_frames, spec.height, spec.width) == (8, 32, 32)
    env = worker_env_vars()
    assert env["HF_HUB_CACHE"] == str(hub_cache.resolve()) and env["HF_HUB_OFFLINE"] == "1"


@pytest.mark.usefixtures("own_key")
def test_a_resume_keeps_the_weights_cache_of_the_search(synthetic_root, tmp_path, capsys, monkeypatch,
                                                        no_ray):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    cache = tmp_path / "shared-hf-cache"
    _started_search(tmp_path, synthetic_root, "--weights-cache", str(cache))
    argv = ["--resume", "--name", "s", "--storage", str(tmp_path), "--dry-run"]
    assert search.main(argv) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    doc = json.loads(out.split("resolved configuration:\n", 1)[1].rsplit("\ndry run:", 1)[0])
    assert doc["train"]["weights_cache"] == str(cache)
    assert os.environ["HF_HUB_CACHE"] == str(cache)        # and the resumed driver uses it
    # the cache mounted elsewhere (another cluster): a resume line may give its new place
    moved = tmp_path / "mounted-elsewhere"
    assert search.main([*argv, "--weights-cache", str(moved)]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    doc = json.loads(out.split("resolved configuration:\n", 1)[1].rsplit("\ndry run:", 1)[0])
    assert doc["train"]["weights_cache"] == str(moved) and os.environ["HF_HUB_CACHE"] == str(moved)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_ray_workers_load_the_hub_id_from_the_weights_cache(hub_cache, shared_ray, synthetic_root, tmp_path):
    """`vidtune train --model hf:ORG/NAME --weights-cache CACHE`, offline with an empty HF_HOME,
    joined to the session's Ray: its workers find the checkpoint only through the cache the
    driver hands them."""
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "HF_HUB_CACHE")}
    env.update(HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "empty-hf-home"), PYTHONPATH="")
    out = subprocess.run([sys.executable, "-m", "vidtune.trainer.commands.train",
                          "--data", str(synthetic_root),
                          "--model", f"hf:{REPO_ID}", "--weights-cache", str(hub_cache), "--epochs", "1",
                          "--batch-size", "8", "--precision", "fp32", "--loader-workers", "1", "--address",
                          shared_ray, "--storage", str(tmp_path / "results"), "--name", "hf"],
                         cwd=Path(__file__).resolve().parents[1], env=env, capture_output=True, text=True,
                         timeout=230)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "best checkpoint (epoch 1" in out.stdout
    assert not (tmp_path / "empty-hf-home").exists()       # nothing was looked for or written there
