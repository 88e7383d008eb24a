"""Shared fixtures: one generated dataset and one Ray session for the whole test run."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]   # first on sys.path: pyproject's pytest `pythonpath`

# Train polls its workers every 2 s by default; each report and the end of fit() wait on it.
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")


@pytest.fixture(scope="session")
def synthetic_root(tmp_path_factory) -> Path:
    """A small learnable RWF-2000-layout dataset of real encoded videos, made once per session."""
    from vidtune.datasets.synthetic import generate

    out = tmp_path_factory.mktemp("synthetic") / "rwf"
    return generate(out, videos=48, seed=0)


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray for the whole run (ray.init costs ~3 s; a second init in a process fails)."""
    import ray

    from vidtune.trainer.launch import init_ray

    init_ray(num_cpus=2)
    yield ray
    ray.shutdown()


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` run where torch sees a CUDA device (`pytest -m gpu` on a GPU machine)
    and are skipped, saying why, everywhere else."""
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="gpu: needs a CUDA device; torch.cuda.is_available() is False here")
    for item in gpu_items:
        item.add_marker(skip)
