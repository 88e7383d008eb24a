"""deploy/slurm/vidtune.sbatch on a real SLURM: Debian's slurmctld, slurmd and munge, started here
as one node on 127.0.0.1 with a generated configuration (ports chosen free now, state, spool,
logs and munge's key and socket in a temporary folder), the script submitted with `sbatch` as a
user would, its state read with squeue/scontrol (accounting is off: no sacct), the daemons
stopped after. Needs root and the packages (`.ci/run` installs them as root); skips saying which
is missing otherwise.

The node declares one GPU whose device file is /dev/null (`gres.conf`), so the script's
`--gres=gpu:1` line is scheduled as written (SLURM sets CUDA_VISIBLE_DEVICES=0, and Ray counts a
GPU); the search is told --gpus-per-worker 0, there being no CUDA device here.
"""
from __future__ import annotations

import contextlib
import os
import re
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

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "deploy" / "slurm" / "vidtune.sbatch"
DAEMONS = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "scancel")
PARENT_TAG = "mlflow.parentRunId"
# This machine's share for the job, given on sbatch's command line as a user overrides #SBATCH lines
JOB_OPTIONS = ["--cpus-per-task=2", "--mem=0", "--time=00:15:00"]
SEARCH = ["--smoke-test", "--gpus-per-worker", "0", "--no-log-model", "--no-cache"]


def _missing() -> str | None:
    if os.geteuid() != 0:
        return "SLURM's daemons run as root here (slurmd starts jobs as their user): not root"
    absent = [d for d in DAEMONS if shutil.which(d) is None and not Path("/usr/sbin", d).exists()]
    if absent:
        return (f"{', '.join(absent)} not installed (apt-get install --no-install-recommends slurmctld "
                "slurmd slurm-client munge; .ci/run does it as root)")
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _exe(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


CONFIG = """\
ClusterName=vidtune-test
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge.socket
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
GresTypes=gpu
MpiDefault=none
ReturnToService=2
KillWait=30
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory=4000 Gres=gpu:1 State=UNKNOWN
PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP
"""


@contextlib.contextmanager
def local_slurm(root: Path):
    """munged, slurmctld and slurmd for one node (this machine), configured under `root`;
    yields the environment the clients (sbatch, squeue) need. Each daemon runs in the foreground
    (-D) as a child of this process and is ended by it, with its process group."""
    host = socket.gethostname()
    for sub in ("state", "spool"):
        (root / sub).mkdir(parents=True)
    conf = root / "slurm.conf"
    conf.write_text(CONFIG.format(host=host, root=root, ctld_port=_free_port(), slurmd_port=_free_port(),
                                  cpus=os.cpu_count()))
    (root / "gres.conf").write_text(f"AutoDetect=off\nNodeName={host} Name=gpu File=/dev/null\n")
    env = {**os.environ, "SLURM_CONF": str(conf)}
    subprocess.run([_exe("mungekey"), "--create", "--keyfile", str(root / "munge.key"), "--force"],
                   check=True, capture_output=True)
    os.chmod(root / "munge.key", 0o400)
    daemons: list[subprocess.Popen] = []

    def start(argv: list[str], log: str) -> None:
        with open(root / log, "ab") as out:
            daemons.append(subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT,
                                            start_new_session=True))

    try:
        start([_exe("munged"), "--foreground", "--force", f"--key-file={root}/munge.key",
               f"--socket={root}/munge.socket", f"--pid-file={root}/munged.pid",
               f"--log-file={root}/munged.log", f"--seed-file={root}/munged.seed"], "munged.out")
        time.sleep(1)
        start([_exe("slurmctld"), "-D", "-i", "-f", str(conf)], "slurmctld.out")
        start([_exe("slurmd"), "-D", "-f", str(conf)], "slurmd.out")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            state = subprocess.run(["sinfo", "--noheader", "-o", "%t"], env=env, capture_output=True,
                                   text=True)
            if state.stdout.strip() == "idle":
                break
            time.sleep(1)
        else:
            logs = "\n".join(p.read_text()[-1500:] for p in sorted(root.glob("*.log")) if p.is_file())
            pytest.fail(f"the local SLURM did not come up (sinfo: {state.stdout.strip()!r} "
                        f"{state.stderr.strip()!r}):\n{logs}")
        yield env
    finally:
        for daemon in reversed(daemons):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(daemon.pid, signal.SIGTERM)
        for daemon in reversed(daemons):
            try:
                daemon.wait(timeout=30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(daemon.pid, signal.SIGKILL)
                daemon.wait(timeout=30)


def job_state(env: dict, job: str) -> str:
    out = subprocess.run(["scontrol", "show", "job", job], env=env, capture_output=True, text=True)
    found = re.search(r"JobState=(\S+)", out.stdout)
    return found.group(1) if found else "UNKNOWN"


def wait_for(env: dict, job: str, states: set[str], wait_s: float) -> str:
    deadline = time.monotonic() + wait_s
    while (state := job_state(env, job)) not in states and time.monotonic() < deadline:
        time.sleep(2)
    return state


def ray_processes(marker: str) -> list[str]:
    out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if marker in line and "ps -eo" not in line]


@pytest.fixture
def slurm():
    why = _missing()
    if why:
        pytest.skip(why)
    root = Path(tempfile.mkdtemp(prefix="vt-slurm-", dir="/tmp"))
    try:
        with local_slurm(root) as env:
            yield env, root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _submit(env: dict, tmp_path: Path, *search: str) -> str:
    job_env = {k: v for k, v in env.items()
               if k not in ("RAY_ADDRESS", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")}
    job_env.update(HOME=str(tmp_path / "home"), VIDTUNE_VENV=str(Path(sys.executable).parent.parent),
                   VIDTUNE_STORAGE=str(tmp_path / "results"))
    (tmp_path / "home").mkdir(exist_ok=True)
    out = subprocess.run(["sbatch", "--parsable", *JOB_OPTIONS, f"--output={tmp_path}/job-%j.out",
                          str(SCRIPT), *search], env=job_env, cwd=tmp_path, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().split(";")[0]


def _runs(uri: str) -> list:
    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("vidtune")
    return client.search_runs([experiment.experiment_id]) if experiment else []


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_sbatch_script_runs_a_search_to_completed(slurm, synthetic_root, tmp_path):
    env, _ = slurm
    started = time.monotonic()
    job = _submit(env, tmp_path, "--data", str(synthetic_root), *SEARCH, "--name", "slurm")
    state = wait_for(env, job, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"},
                     480)
    took = time.monotonic() - started
    output = (tmp_path / f"job-{job}.out").read_text()
    assert state == "COMPLETED", output[-5000:]
    runs = _runs(f"sqlite:///{tmp_path / 'results' / 'mlflow.db'}")
    assert sorted(r.info.status for r in runs) == ["FINISHED"] * 3, output[-3000:]
    assert len([r for r in runs if PARENT_TAG in r.data.tags]) == 2
    assert "vidtune.sbatch: Ray stopped" in output
    assert not ray_processes(f"/tmp/ray-{job}"), "Ray outlived the job"
    print(f"sbatch to COMPLETED in {took:.0f} s")


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("scancel", [["--batch", "--signal=USR1"], []], ids=["clean-stop", "plain-scancel"])
def test_scancel_mid_search_leaves_a_resumable_folder_and_no_ray(slurm, synthetic_root, tmp_path, scancel):
    """The clean stop (`scancel --batch --signal=USR1`: the script tells the search to stop while Ray
    still runs, then stops Ray) leaves no MLflow run RUNNING. A plain `scancel` signals every process
    of the job at once, Ray's included, and SIGKILLs them KillWait (30 s) later: the search cannot
    close its runs (seen here: parent and trial left RUNNING), but no Ray process outlives the job
    and --resume finishes the search in the same runs."""
    env, _ = slurm
    search = ["--data", str(synthetic_root), *SEARCH, "--epochs", "3", "--name", "cancelled"]
    job = _submit(env, tmp_path, *search)
    out_file = tmp_path / f"job-{job}.out"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and "epoch 1/3" not in (out_file.read_text() if out_file.exists()
                                                              else ""):
        assert job_state(env, job) in ("PENDING", "RUNNING", "CONFIGURING"), out_file.read_text()[-3000:]
        time.sleep(2)
    assert "epoch 1/3" in out_file.read_text(), out_file.read_text()[-3000:]
    subprocess.run(["scancel", *scancel, job], env=env, check=True, timeout=30)
    state = wait_for(env, job, {"CANCELLED", "COMPLETED", "FAILED"}, 180)
    output = out_file.read_text()
    assert state in ({"CANCELLED"} if not scancel else {"COMPLETED", "FAILED"}), (state, output[-3000:])
    deadline = time.monotonic() + 60
    while ray_processes(f"/tmp/ray-{job}") and time.monotonic() < deadline:
        time.sleep(2)
    assert not ray_processes(f"/tmp/ray-{job}"), "Ray outlived the stopped job"
    statuses = sorted(r.info.status for r in _runs(f"sqlite:///{tmp_path / 'results' / 'mlflow.db'}"))
    print(f"scancel {' '.join(scancel)}: job {state}, runs {statuses}")
    if scancel:
        assert statuses and "RUNNING" not in statuses, (statuses, output[-3000:])
        assert "vidtune.sbatch: Ray stopped" in output
    resumed = _submit(env, tmp_path, *search, "--resume")
    state = wait_for(env, resumed, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"}, 420)
    resumed_output = (tmp_path / f"job-{resumed}.out").read_text()
    assert state == "COMPLETED", resumed_output[-5000:]
    runs = _runs(f"sqlite:///{tmp_path / 'results' / 'mlflow.db'}")
    print(f"after --resume: runs {sorted(r.info.status for r in runs)}")
    assert "RUNNING" not in {r.info.status for r in runs}, resumed_output[-3000:]
    assert len([r for r in runs if PARENT_TAG in r.data.tags and r.info.status == "FINISHED"]) == 2
