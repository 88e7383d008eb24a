"""Checkpoints are loaded with torch.load(weights_only=True): a malicious pickle is refused with a
clear error and its payload never runs (the --weights file and Kinetics cache cases are in
test_models.py)."""
from __future__ import annotations

import os
import pickle
import re
import shlex
import zipfile

import pytest
import torch

from vidtune.trainer.serving.scoring import Predictor
from vidtune.trainer.training.checkpointing import FORMAT, CheckpointError, load_checkpoint


class _Payload:
    """Unpickling this calls `fn(*args)`, as a malicious checkpoint would (here: create a marker)."""

    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


def _system_checkpoint(folder, marker):
    """A zip-format checkpoint with vidtune's marker, the payload (os.system) among its metrics."""
    folder.mkdir(parents=True)
    torch.save({"format": FORMAT, "version": 1, "epoch": 1, "model": {"w": torch.zeros(2)},
                "metrics": {"val_acc": _Payload(os.system, f"touch {shlex.quote(str(marker))}")}},
               folder / "checkpoint.pt")
    return folder


def _pickle_checkpoint(protocol):
    def make(folder, marker):
        """A plain (legacy-format) pickle named checkpoint.pt whose payload is exec."""
        folder.mkdir(parents=True)
        with open(folder / "checkpoint.pt", "wb") as f:
            pickle.dump(_Payload(exec, f"open({str(marker)!r}, 'w').close()"), f, protocol=protocol)
        return folder
    return make


@pytest.mark.filterwarnings("ignore:Detected pickle protocol 4:UserWarning")
@pytest.mark.parametrize("make, refusal", [
    (_system_checkpoint, "refused: it holds Python objects other than tensors and plain data (posix.system), "
                         "and loading those could run code"),
    (_pickle_checkpoint(2), "refused: it holds Python objects other than tensors and plain data (exec), "
                            "and loading those could run code"),
    # protocol 4 framing is rejected before the payload is reached: read as a damaged file
    (_pickle_checkpoint(4), "cannot be read (Unsupported operand 149); it is damaged or not a torch file"),
], ids=["os.system", "exec-protocol2", "exec-protocol4"])
def test_a_malicious_checkpoint_is_refused_and_runs_no_code(tmp_path, make, refusal):
    marker = tmp_path / "marker"
    folder = make(tmp_path / "ckpt", marker)
    for path in (folder, folder / "checkpoint.pt"):      # a checkpoint folder or its file
        with pytest.raises(CheckpointError) as info:
            load_checkpoint(path)
        msg = str(info.value)
        assert msg.startswith(f"checkpoint {folder / 'checkpoint.pt'} {refusal}")
        assert "weights_only=False" not in msg       # torch's advice to load unsafely is not passed on
        assert not marker.exists()
    # predict (and a resumed run, through load_checkpoint) refuse it the same way
    with pytest.raises(CheckpointError, match=re.escape(refusal)):
        Predictor.from_checkpoint(folder, torch.device("cpu"))
    assert not marker.exists()
    # The payload is live: an unsafe unpickling of the same file runs it.
    file = folder / "checkpoint.pt"
    if zipfile.is_zipfile(file):
        torch.load(file, weights_only=False)
    else:
        pickle.loads(file.read_bytes())
    assert marker.exists()
