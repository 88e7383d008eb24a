"""An hf: search interrupted mid-trial resumes from the trial's checkpoint and finishes: the
same checkpoint, resume and MLflow path as a torchvision model (tests/test_faults.py), with the
tiny VideoMAE folder of tests/test_hf_models.py. This is also the suite's search of an hf: model
from start to end (Ray Train, the real loop, MLflow, the console's table), as a user runs it.
Joined to the session's Ray; bounded."""
from __future__ import annotations

import csv
import os
import signal

import pytest

from tests import test_faults
from tests.test_faults import _finish, _runs, _start, _wait_for_first_epoch
from tests.test_hf_models import save_tiny
from vidtune.tune.tracking.schema import RESUMED_TAG

pytest.importorskip("transformers")

# Room for the Ctrl-C to land mid-search: a tiny model trains an epoch in seconds, and on a loaded
# machine (the SLURM test beside it) the worker trained 3 more epochs between the first checkpoint
# and the interrupted search stopping it: with 4 epochs the trial was already at its last one.
EPOCHS = 8


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_an_interrupted_hf_search_resumes_from_its_checkpoint_and_finishes(shared_ray, synthetic_root,
                                                                           tmp_path, monkeypatch):
    # Each wait's deadline: test_faults' 300 s was not enough for the resume of a 3-epoch version
    # of this search on 2 cores shared with other searches (load average 12).
    monkeypatch.setattr(test_faults, "WAIT_S", 420)
    folder = save_tiny("videomae", tmp_path / "videomae")
    uri = f"sqlite:///{tmp_path / 'mlruns.db'}"
    storage = tmp_path / "results"
    args = ["--data", str(synthetic_root), "--model", f"hf:{folder}", "--num-samples", "1", "--epochs",
            str(EPOCHS), "--batch-sizes", "4", "--no-early-stop", "--loader-workers", "0",
            "--max-concurrent-trials", "1", "--no-log-model", "--storage", str(storage), "--mlflow-uri", uri,
            "--name", "h"]
    proc = _start(args, tmp_path, tmp_path / "first.log", shared_ray)
    _wait_for_first_epoch(proc, storage, "h")
    os.killpg(proc.pid, signal.SIGINT)                 # Ctrl-C: the search's whole process group
    out = _finish(proc, tmp_path / "first.log")
    assert proc.returncode == 130, out[-3000:]
    [row] = list(csv.DictReader((storage / "h" / "trials.csv").open()))
    assert row["status"] == "UNFINISHED" and int(row["epochs"]) < EPOCHS, row

    proc = _start([*args, "--resume"], tmp_path, tmp_path / "resume.log", shared_ray)
    out = _finish(proc, tmp_path / "resume.log")
    assert proc.returncode == 0, out[-3000:]
    [row] = list(csv.DictReader((storage / "h" / "trials.csv").open()))
    assert row["status"] == "DONE" and int(row["epochs"]) == EPOCHS, row
    table = out.split("\ntrials:\n", 1)[1]                       # the console's table says so too
    assert sum(line.rstrip().endswith(" DONE") for line in table.splitlines()) == 1, table
    client, _, [child] = _runs(uri)
    steps = sorted({m.step for m in client.get_metric_history(child.info.run_id, "val_acc")})
    assert steps == list(range(1, EPOCHS + 1))
    assert child.data.params["model"] == f"hf:{folder}"
    assert child.data.tags.get(RESUMED_TAG, "").startswith("restarted from its epoch-"), child.data.tags
