"""Shared fixtures: one generated dataset and one Ray session for the whole test run."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
# This project's `datasets` must shadow Hugging Face's, as it does when run from the repository root.
if str(REPO_ROOT) not in sys.path[:1]:
    sys.path.insert(0, str(REPO_ROOT))

# Train polls its workers every 2 s by default; each report and the end of fit() wait on it.
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")


@pytest.fixture(scope="session")
def synthetic_root(tmp_path_factory) -> Path:
    """A small learnable RWF-2000-layout dataset of real encoded videos, made once per session."""
    from datasets.synthetic import generate

    out = tmp_path_factory.mktemp("synthetic") / "rwf"
    return generate(out, videos=48, seed=0)


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray for the whole run (ray.init costs ~3 s; a second init in a process fails)."""
    import ray

    from trainer.launch import init_ray

    init_ray(num_cpus=2)
    yield ray
    ray.shutdown()
