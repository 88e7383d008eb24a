"""An existing Ray cluster through Ray's Jobs API, as docs/launch.md tells a user to run it on
Ray 2.60, token authentication on: `ray get-auth-token --generate`, then `ray start --head` and
the job's client both with RAY_AUTH_MODE=token; the job is `vidtune search --address auto`,
submitted with Ray's own JobSubmissionClient; its runs are read back from MLflow.

The head runs on 127.0.0.1 with ports chosen free now, a temp dir and a HOME of its own (its
token is that HOME's ~/.ray/auth_token, never the machine user's), in a process group of its
own, and is ended by killing that group: never `ray stop`, which stops every Ray on the machine.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

BIN = Path(sys.executable).parent
PARENT_TAG = "mlflow.parentRunId"

# Ray's own Jobs client, in a process of its own: Ray reads RAY_AUTH_MODE and the token once per
# process, and this test's process may have joined other Rays. argv: dashboard URL, action, args.
CLIENT = r"""
import json, sys, time
from ray.job_submission import JobSubmissionClient
url, action = sys.argv[1], sys.argv[2]
client = JobSubmissionClient(url)
if action == "submit":
    print(client.submit_job(entrypoint=sys.argv[3]), flush=True)
elif action == "wait":           # until the job ends, or until its log shows a line
    job, wait_s, line = sys.argv[3], float(sys.argv[4]), sys.argv[5] if len(sys.argv) > 5 else None
    deadline = time.monotonic() + wait_s
    while True:
        status = str(client.get_job_status(job).value)
        logs = client.get_job_logs(job)
        ended = status in ("SUCCEEDED", "FAILED", "STOPPED")
        if ended or (line and line in logs) or time.monotonic() > deadline:
            break
        time.sleep(2)
    print(json.dumps({"status": status, "logs": logs[-6000:]}), flush=True)
elif action == "list":           # answers once the dashboard does, and accepts this client's token
    print(len(client.list_jobs()), flush=True)
elif action == "stop":
    print(client.stop_job(sys.argv[3]), flush=True)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(home: Path) -> dict[str, str]:
    """What a user's shell has: the venv activated, RAY_AUTH_MODE=token exported, their HOME."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RAY_ADDRESS", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")}
    env.update(HOME=str(home), RAY_AUTH_MODE="token", PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}")
    return env


@contextlib.contextmanager
def ray_head(home: Path, temp_dir: str):
    """`ray start --head` as docs/launch.md writes it, on free 127.0.0.1 ports; yields the
    dashboard's URL (the Jobs API) once it answers, and the GCS address (what `--address` joins).
    RAY_JOB_STOP_WAIT_TIME_S as the docs set it: `ray job stop` gives the search that long to
    close its runs before Ray kills it."""
    dashboard = _free_port()
    env = {**_env(home), "RAY_JOB_STOP_WAIT_TIME_S": "60"}
    subprocess.run([str(BIN / "ray"), "get-auth-token", "--generate"], env=env, check=True,
                   capture_output=True, timeout=60)
    ports = {f"--{name}": str(_free_port()) for name in (
        "port", "node-manager-port", "object-manager-port", "ray-client-server-port",
        "dashboard-agent-listen-port", "dashboard-agent-grpc-port", "runtime-env-agent-port",
        "metrics-export-port")}
    head = subprocess.Popen(
        [str(BIN / "ray"), "start", "--head", "--block", "--node-ip-address=127.0.0.1",
         "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard}", "--num-cpus=2",
         f"--temp-dir={temp_dir}", "--disable-usage-stats", *[f"{k}={v}" for k, v in ports.items()]],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{dashboard}"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and head.poll() is None:
            probe = subprocess.run([sys.executable, "-c", CLIENT, url, "list"], env=_env(home),
                                   capture_output=True, text=True, timeout=60)
            if probe.returncode == 0:
                break
            time.sleep(2)
        assert head.poll() is None and probe.returncode == 0, \
            f"the head did not start (exit {head.poll()}): {probe.stderr[-1500:]}"
        yield url, f"127.0.0.1:{ports['--port']}"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(head.pid, signal.SIGTERM)
        try:   # it did not end in 30 s in any run here: 10 s for a graceful end, then SIGKILL
            head.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        with contextlib.suppress(ProcessLookupError):
            os.killpg(head.pid, signal.SIGKILL)     # whatever of its group outlived its own exit
        head.wait(timeout=30)


def _client(url: str, home: Path, *args: str, timeout: float = 60) -> str:
    out = subprocess.run([sys.executable, "-c", CLIENT, url, *args], env=_env(home), capture_output=True,
                         text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()[-1]


def _runs(uri: str) -> tuple[list, list]:
    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("vidtune")
    runs = client.search_runs([experiment.experiment_id]) if experiment else []
    children = [r for r in runs if PARENT_TAG in r.data.tags]
    return [r for r in runs if r not in children], children


@pytest.fixture(scope="module")
def jobs_head():
    """One token-auth head for this module's tests (a head takes 15-30 s to start here): its HOME
    (holding its token), its dashboard's URL and its GCS address. Its HOME and temp dir are a
    short temp folder (Ray's socket paths must fit 107 bytes)."""
    root = Path(tempfile.mkdtemp(prefix="vt-j-", dir="/tmp"))
    (root / "home").mkdir()
    started = time.monotonic()
    try:
        with ray_head(root / "home", str(root / "t")) as (url, gcs):
            print(f"head up in {time.monotonic() - started:.0f} s")
            yield root / "home", url, gcs
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_token_auth_job_stopped_by_ray_job_stop_closes_its_runs_and_resumes_to_success(
        synthetic_root, tmp_path, jobs_head):
    """One search through the Jobs API with token auth, in three steps:
    1. a client without the token is refused, as the docs say;
    2. `vidtune search --smoke-test ...` submitted with the token, and stopped by `ray job stop`
       (SIGTERM, then SIGKILL after RAY_JOB_STOP_WAIT_TIME_S) once a trial has trained an epoch:
       no MLflow run is left RUNNING (with Ray's default of 3 s the search was killed before it
       closed its parent run, left RUNNING: hence the 60 s the docs set);
    3. the same line submitted again with --resume: the job SUCCEEDS, in the same parent run, with
       both trials' runs FINISHED."""
    home, url, _ = jobs_head
    mlflow_uri = f"sqlite:///{tmp_path / 'mlruns.db'}"
    refused = subprocess.run([sys.executable, "-c", CLIENT, url, "list"], env=_env(tmp_path),
                             capture_output=True, text=True, timeout=60)
    assert refused.returncode != 0 and "token" in refused.stderr.lower(), refused.stderr[-1500:]

    # the smoke preset (2 trials, batch 4, no early stop) with room for the stop: 3 epochs
    search = (f"vidtune search --smoke-test --address auto --data {synthetic_root} --no-log-model "
              f"--epochs 3 --loader-workers 0 "
              f"--storage {tmp_path / 'results'} --name jobs --mlflow-uri {mlflow_uri}")
    job = _client(url, home, "submit", search)
    # stopped once a trial has reported an epoch (its progress line), before the search ends
    seen = json.loads(_client(url, home, "wait", job, "300", "epoch 1/3", timeout=360))
    assert seen["status"] == "RUNNING", seen
    _client(url, home, "stop", job)
    stopped = json.loads(_client(url, home, "wait", job, "120", timeout=180))
    assert stopped["status"] == "STOPPED", stopped
    parents, children = _runs(mlflow_uri)
    statuses = sorted(r.info.status for r in parents + children)
    print(f"after ray job stop: {statuses}")
    assert parents and "RUNNING" not in statuses, (statuses, stopped["logs"])

    resumed = _client(url, home, "submit", search + " --resume")
    result = json.loads(_client(url, home, "wait", resumed, "420", timeout=480))
    assert result["status"] == "SUCCEEDED", result["logs"]
    parents, children = _runs(mlflow_uri)
    # the same parent run, reopened and finished; the interrupted trial's run too (2 trials in all)
    assert [r.info.status for r in parents] == ["FINISHED"], result["logs"]
    assert sorted(r.info.status for r in children) == ["FINISHED", "FINISHED"], result["logs"]
    assert (tmp_path / "results" / "jobs").is_dir()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_search_joining_the_head_by_address_without_the_mode_says_what_to_set(synthetic_root, tmp_path,
                                                                                jobs_head):
    """`vidtune search --address <head>:<port>` from the head's HOME (its token in ~/.ray) with
    RAY_AUTH_MODE unset: Ray sends no token to an address given explicitly, so the head refuses
    it; the search ends with exit 2 and a line that says to set RAY_AUTH_MODE=token (a token that
    is not the head's: tests/test_ray_auth.py). Ray retries the join for ~20 s before giving up;
    RAY_gcs_server_port_wait_time_s (Ray's own setting) makes it 2."""
    home, _, gcs = jobs_head
    argv = [str(BIN / "vidtune"), "search", "--address", gcs, "--data", str(synthetic_root), "--smoke-test",
            "--storage", str(tmp_path / "results"), "--mlflow-uri", f"sqlite:///{tmp_path / 'm.db'}"]
    env = {k: v for k, v in _env(home).items() if k != "RAY_AUTH_MODE"}
    env["RAY_gcs_server_port_wait_time_s"] = "2"
    unset = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert unset.returncode == 2, unset.stdout[-2000:] + unset.stderr[-2000:]
    last = unset.stderr.strip().splitlines()[-1]      # after Ray's own warnings while it retried
    assert last.startswith(f"vidtune search: error: --address: the Ray cluster at {gcs} uses token "
                           "authentication and Ray sent it no token") and "RAY_AUTH_MODE=token" in last, last

