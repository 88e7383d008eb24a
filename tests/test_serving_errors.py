"""A served vidtune model refuses what it cannot score, cleanly: `vidtune serve FOLDER` (run as a
user pastes it, in a shell whose PATH lacks the venv) starts a real `mlflow models serve` on
127.0.0.1; a batch of readable videos is scored; a batch with a missing path, a folder, a file
that does not decode, a pipe or an empty path gets HTTP 400 with MLflow's INVALID_PARAMETER_VALUE,
one line per bad path and no stack trace; a mixed batch is refused as a whole, naming only its
bad paths (`trainer.serving.mlflow_model.VideoModel.predict`). Helpers here (`clean_shell`, `served`)
start such servers for tests/test_serve_commands.py too."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import mlflow
import pytest
import torch

from vidtune import servers
from vidtune.trainer.models.registry import build_model, get_spec
from vidtune.trainer.serving import mlflow_model
from vidtune.trainer.training.checkpointing import save_checkpoint
from vidtune.trainer.training.config import TrainConfig

START_S = 180     # a server answers within this, or the test fails
CLEAN_PATH = "/usr/bin:/bin"   # a shell where the venv is not activated


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_shell(line: str, home: Path) -> list[str]:
    """argv that runs `line` in bash with an emptied environment (`env -i`): HOME and a PATH
    without the venv's bin folder, nothing else."""
    assert servers.bin_dir() not in CLEAN_PATH.split(os.pathsep)
    return ["env", "-i", f"HOME={home}", f"PATH={CLEAN_PATH}", "LANG=C.UTF-8", "bash", "-c", line]


@contextlib.contextmanager
def served(line: str, port: int, folder: Path, ready: str = "/ping") -> Iterator[str]:
    """Run `line` (a server's command, verbatim) in `clean_shell`; yield its base URL once GET
    `ready` answers 200; stop its whole process group after (SIGTERM, then SIGKILL)."""
    log_file = folder / f"server-{port}.log"
    with open(log_file, "w") as log:
        server = subprocess.Popen(clean_shell(line, folder), stdout=log, stderr=subprocess.STDOUT,
                                  start_new_session=True, cwd=folder)
        base = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + START_S
            while True:
                assert server.poll() is None, \
                    f"{line}\nended {server.returncode}:\n{log_file.read_text()[-3000:]}"
                assert time.monotonic() < deadline, f"silent {START_S} s: {log_file.read_text()[-3000:]}"
                try:
                    with urllib.request.urlopen(base + ready, timeout=2) as answer:
                        if answer.status == 200:
                            break
                except OSError:
                    time.sleep(0.5)
            yield base
        finally:
            os.killpg(server.pid, signal.SIGTERM)
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait(timeout=30)


def invoke(base: str, paths: list[str], params: dict | None = None) -> tuple[int, dict]:
    """POST {"inputs": paths} to /invocations: (HTTP status, JSON body)."""
    body = {"inputs": paths, **({"params": params} if params else {})}
    request = urllib.request.Request(f"{base}/invocations", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def reported_lines(body: dict) -> list[str]:
    """The per-path lines of a refusal: the lines after the one saying what was refused."""
    return body["message"].split("send the batch again without them:\n", 1)[1].splitlines()


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory, synthetic_root) -> Path:
    """An (untrained) tiny model saved as vidtune's MLflow model, in a folder."""
    folder = tmp_path_factory.mktemp("served")
    torch.manual_seed(0)
    network = build_model("tiny")
    optimizer = torch.optim.AdamW(network.parameters())
    save_checkpoint(folder / "ckpt", model=network, optimizer=optimizer,
                    scaler=torch.amp.GradScaler("cpu", enabled=False),
                    scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0), epoch=1,
                    config=TrainConfig().to_dict(), spec=get_spec("tiny"),
                    class_names={1: "Fight", 0: "NonFight"})
    video = next((synthetic_root / "val").rglob("*.mp4"))
    mlflow_model.save_model(str(folder / "model"), checkpoint=folder / "ckpt", example_video=video)
    return folder / "model"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_server_scores_good_batches_and_refuses_bad_ones_path_by_path(saved_model, synthetic_root,
                                                                          tmp_path):
    good = [str(v) for v in sorted((synthetic_root / "val").rglob("*.mp4"))[:2]]
    text = tmp_path / "notes.mp4"
    text.write_text("not a video")
    pipe = tmp_path / "pipe.mp4"
    os.mkfifo(pipe)
    bad = {str(tmp_path / "gone.mp4"): "no such file", str(tmp_path): "a folder, not a video file",
           str(text): "does not decode as a video", str(pipe): "not a regular file",
           "": "an empty path"}
    expected = mlflow.pyfunc.load_model(str(saved_model)).predict(good)
    port = free_port()
    line = f"{servers.vidtune_command()} serve {saved_model} --port {port}"   # as docs/mlflow.md shows
    with served(line, port, tmp_path) as base:
        status, body = invoke(base, good)
        assert status == 200 and body["predictions"] == pytest.approx(expected, abs=1e-6)
        status, body = invoke(base, good, {"aggregation": "max"})
        assert status == 200 and len(body["predictions"]) == 2

        status, body = invoke(base, list(bad))
        assert status == 400, body
        assert body["error_code"] == "INVALID_PARAMETER_VALUE" and "stack_trace" not in body
        assert f"{len(bad)} of {len(bad)} video path(s) cannot be scored" in body["message"]
        lines = reported_lines(body)
        assert len(lines) == len(bad), lines
        for (path, why), said in zip(bad.items(), lines, strict=True):
            assert said.startswith(repr(path) if not path else f"{path}: ") and why in said, said
        assert "Traceback" not in body["message"] and "File \"" not in body["message"]

        # mixed: the whole batch refused, naming its bad paths only
        missing = str(tmp_path / "gone.mp4")
        status, body = invoke(base, [good[0], missing, good[1]])
        assert status == 400 and "stack_trace" not in body
        assert "1 of 3 video path(s)" in body["message"]
        assert reported_lines(body) == [f"{missing}: no such file"]

        status, body = invoke(base, good, {"aggregation": "median"})
        assert status == 400 and "aggregation 'median' is not one of centre, max, mean" in body["message"]
