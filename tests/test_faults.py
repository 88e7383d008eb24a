"""Faults injected on purpose into a real search (a subprocess, as a user runs it): Ctrl-C,
SIGTERM, a killed driver, a killed Train worker, a tracking server that dies mid-search, a full
disk. Each says so, loses nothing, and `--resume` leaves MLflow with exactly one point per epoch
trained and the final status of every trial. The Ctrl-C search is resumed by the line it printed,
run as printed (the search's saved options hold).

The searches join the test session's Ray (`--address`, as on a cluster); the killed Train worker
is found among that Ray's actors. Slow and bounded: every wait has a deadline.
"""
from __future__ import annotations

import csv
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from vidtune import servers
from vidtune.trainer.ray_setup.launch import DEFAULT_HEALTH_CHECK_INTERVAL_S, HEALTH_CHECK_ENV
from vidtune.tune.outputs.resume_line import AT_START
from vidtune.tune.running.ray_internals import optuna_study
from vidtune.tune.study.dashboard import NAME_ATTR
from vidtune.tune.study.space import VidtuneOptunaSearch
from vidtune.tune.tracking.schema import INTERRUPTED_REASON, PARENT_TAG, RESUMED_TAG, STOP_TAG, TRIAL_ID_TAG

REPO = Path(__file__).resolve().parents[1]
SEARCH = [sys.executable, str(REPO / "tune" / "search.py")]
VIDTUNE = str(Path(sys.executable).parent / "vidtune")     # what the printed lines start with
# Ctrl-C: 4 epochs, interrupted once a trial's second checkpoint is Ray's, so that the trial is
# still training and its resume can fall back to an older checkpoint than the truncated latest
# one. The others need one epoch before the fault and one after: 2 (--epochs after SMALL wins).
EPOCHS = 4
SHORT = ["--epochs", "2"]
# --no-log-model: the faults are the point; the model's logging has its tests (test_model_registry)
SMALL = ["--num-samples", "2", "--epochs", str(EPOCHS), "--batch-sizes", "4", "--no-early-stop",
         "--loader-workers", "0", "--max-concurrent-trials", "1", "--lr-min", "3e-4", "--lr-max", "3e-3",
         "--no-log-model"]
WAIT_S = 300


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    env[HEALTH_CHECK_ENV] = DEFAULT_HEALTH_CHECK_INTERVAL_S
    return env


def _start(args: list[str], cwd: Path, log: Path, address: str | None = None) -> subprocess.Popen:
    """The search with `args` (joined to the Ray at `address`; None: it starts its own)."""
    joined = ["--address", address] if address else []
    return subprocess.Popen(SEARCH + joined + args, cwd=cwd, env=_env(), stdout=open(log, "w"),
                            stderr=subprocess.STDOUT,
                            start_new_session=True)   # its own process group, as a terminal's job


def _wait_for(condition, proc: subprocess.Popen, what: str, poll_s: float = 0.2):
    """`condition()`'s first true value, while the search at `proc` runs, within WAIT_S."""
    deadline = time.monotonic() + WAIT_S
    while not (value := condition()):
        assert proc.poll() is None, f"the search ended early with {proc.returncode}, before {what}"
        assert time.monotonic() < deadline, f"not in time: {what}"
        time.sleep(poll_s)
    return value


def _wait_for_first_epoch(proc: subprocess.Popen, storage: Path, name: str, epoch: int = 1) -> None:
    """Until some trial has checkpointed `epoch` (its Train run's `epoch_NNNN` folder)."""
    runs = storage / name / "ray" / "train_runs"
    _wait_for(lambda: list(runs.glob(f"*/epoch_{epoch:04d}")), proc, f"a trial checkpointed epoch {epoch}",
              poll_s=0.5)


def _registered_checkpoints(storage: Path, name: str) -> dict[str, list[str]]:
    """Trial name -> its checkpoint folders Ray Train has registered, oldest first. A folder on
    disk is not yet one of them while its report is under way (Ctrl-C can land there), and a
    resume starts from Ray's latest: read from Train's own record of its checkpoints,
    `checkpoint_manager_snapshot.json` (Ray 2.60's format)."""
    out = {}
    for snapshot in (storage / name / "ray" / "train_runs").glob("*/checkpoint_manager_snapshot.json"):
        try:
            results = json.loads(snapshot.read_text())["checkpoint_results"]
        except (ValueError, KeyError):        # being written
            continue
        out[snapshot.parent.name] = [r["checkpoint_dir_name"] for r in results]
    return out


def _finish(proc: subprocess.Popen, log: Path) -> str:
    try:
        proc.wait(timeout=WAIT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"the search did not end in {WAIT_S} s:\n{log.read_text()[-3000:]}")
    return log.read_text(errors="replace")


def _run_line(command: list[str], cwd: Path, log: Path) -> tuple[int, str]:
    """`command` run to its end (as _start runs a search): its exit status and its console."""
    proc = subprocess.Popen(command, cwd=cwd, env=_env(), stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    out = _finish(proc, log)
    return proc.returncode, out


def _result_files(folder: Path) -> tuple[list[dict], dict]:
    rows = sorted(csv.DictReader((folder / "trials.csv").open()), key=lambda r: r["name"])
    best = json.loads((folder / "best_config.json").read_text())
    return rows, best


def _runs(uri: str):
    c = MlflowClient(uri)
    exp = c.get_experiment_by_name("vidtune")
    runs = c.search_runs([exp.experiment_id])
    parents = [r for r in runs if PARENT_TAG not in r.data.tags]
    assert len(parents) == 1, [r.info.run_name for r in parents]
    return c, parents[0], [r for r in runs if PARENT_TAG in r.data.tags]


def _assert_complete(uri: str, retrained: str | None = None, epochs: int = EPOCHS, trials: int = 2) -> None:
    """After a search that ran to its end: one point per epoch, final statuses, no stale tags.
    `retrained`: a trial resumed from an older checkpoint than its last logged epoch, whose
    epochs after that checkpoint were trained and logged again (every epoch still there)."""
    c, parent, children = _runs(uri)
    assert parent.info.status == "FINISHED"
    assert len(children) == trials
    for run in children:
        steps = [m.step for m in c.get_metric_history(run.info.run_id, "val_acc")]
        if run.info.run_name == retrained:
            steps = sorted(set(steps))
        assert sorted(steps) == list(range(1, epochs + 1)), (run.info.run_name, steps)
        assert run.info.status == "FINISHED", run.info.run_name
        assert STOP_TAG not in run.data.tags, run.data.tags[STOP_TAG]


@pytest.mark.slow
def test_ctrl_c_says_interrupted_then_its_printed_line_resumes_and_backfills_every_epoch(
        shared_ray, synthetic_root, tmp_path, own_key):
    """Ctrl-C once a trial has checkpointed 2 epochs: the search says so (exit 130, MLflow's runs
    KILLED with the interrupted tag) and prints how to continue it: the installed vidtune's absolute
    path, no --data, no --epochs. That line plus another --epochs or --data is refused naming both
    values; run as printed (from the user's folder) it finishes the search with its own data, epochs
    and trial count, from an older checkpoint where the latest was cut short, keeping every epoch
    in MLflow, trials.csv and Optuna. Run again on the finished search it changes nothing (it used
    to rerun it on the demo's data: DONE trials became STOPPED, best_config.json named the demo's
    folder), and --no-log-model holds on every resume. own_key: the state is signed with a key of
    this test's own, which the resume line checks."""
    uri = f"sqlite:///{tmp_path / 'mlruns.db'}"
    storage = tmp_path / "results"
    args = ["--data", str(synthetic_root), *SMALL, "--storage", str(storage), "--mlflow-uri", uri,
            "--name", "s"]
    log = tmp_path / "first.log"
    proc = _start(args, tmp_path, log, shared_ray)
    deadline = time.monotonic() + WAIT_S
    while not any(len(folders) >= 2 for folders in _registered_checkpoints(storage, "s").values()):
        assert proc.poll() is None, f"the search ended early with {proc.returncode}"
        assert time.monotonic() < deadline, "no trial checkpointed 2 epochs in time"
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGINT)                 # Ctrl-C in a terminal: the whole process group
    out = _finish(proc, log)
    assert proc.returncode == 130, out[-3000:]
    assert "SIGINT received" in out and "UNFINISHED" in out
    assert f"continue it with:\n  {servers.vidtune_command()} search --resume --name s" in out
    _, parent, children = _runs(uri)
    assert parent.info.status == "KILLED"
    assert children and all(r.info.status != "RUNNING" for r in children)
    interrupted = [r for r in children if r.data.tags.get(STOP_TAG) == INTERRUPTED_REASON]
    assert interrupted and all(r.info.status == "KILLED" for r in interrupted)
    assert not any("ASHA" in r.data.tags.get(STOP_TAG, "") for r in children)
    line = out.split("continue it with:\n  ", 1)[1].splitlines()[0]
    # by the installed command's absolute path, so it runs without an activated venv
    assert "--data" not in line and "--epochs" not in line and line.startswith(f"{VIDTUNE} search "), line
    command = shlex.split(line)                         # as printed

    # The interrupted trial's latest checkpoint (the one Ray hands back) is cut short (a full
    # disk, a killed copy): the resume goes on from an older one and must keep every epoch trained.
    table = storage / "s" / "trials.csv"
    unfinished = [r for r in csv.DictReader(table.open()) if r["status"] == "UNFINISHED"]
    registered_by_trial = _registered_checkpoints(storage, "s")
    with_two = [r["name"] for r in unfinished if len(registered_by_trial.get(r["name"], [])) >= 2]
    assert with_two, (unfinished, registered_by_trial)   # unfinished, with an older one to fall back to
    name = with_two[0]
    registered = registered_by_trial[name]
    checkpoint = storage / "s" / "ray" / "train_runs" / name / registered[-1] / "checkpoint.pt"
    checkpoint.write_bytes(checkpoint.read_bytes()[: checkpoint.stat().st_size // 2])

    # a line that asks for other epochs or other data is refused, naming both values (in seconds)
    other = f"--data: {tmp_path} on this line, {synthetic_root} when"
    for extra, says in ((["--epochs", "6"], f"--epochs: 6 on this line, {EPOCHS} when the search at"),
                        (["--data", str(tmp_path)], other)):
        refused = subprocess.run([*command, *extra], cwd=tmp_path, env=_env(), capture_output=True,
                                 text=True, timeout=120)
        assert refused.returncode == 2 and says in refused.stderr, refused.stderr[-2000:]

    returncode, out = _run_line(command, tmp_path, tmp_path / "resume.log")
    assert returncode == 0, out[-3000:]
    assert "demo:" not in out, out[-3000:]
    _assert_complete(uri, retrained=name)
    # Every epoch counts, those before the interruption too: each trial's table row is the best
    # of its whole MLflow history (the later point of a step retrained after the resume)
    c, _, children = _runs(uri)
    rows = {r["name"]: r for r in csv.DictReader((storage / "s" / "trials.csv").open())}
    assert [r["status"] for r in rows.values()] == ["DONE", "DONE"], rows
    for run in children:
        final: dict[int, float] = {}
        points = c.get_metric_history(run.info.run_id, "val_acc")
        for m in sorted(points, key=lambda m: (m.step, m.timestamp)):
            final[m.step] = m.value
        best = max(final.values())
        row = rows[run.info.run_name]
        assert (float(row["best_val_acc"]), int(row["epochs"])) == (round(best, 4), EPOCHS), (row, final)
    resumed = next(r for r in children if r.info.run_name == name)
    assert "restarted from" in resumed.data.tags.get(RESUMED_TAG, ""), resumed.data.tags
    assert "damaged" in resumed.data.tags[RESUMED_TAG]
    # ... and Optuna was told the same best of every epoch (the searcher's state as the search saved it)
    searcher = VidtuneOptunaSearch()
    searcher.restore_from_dir(str(storage / "s" / "ray"))    # Tune's state: the search's ray/
    told = sorted(round(t.value, 4) for t in optuna_study(searcher).trials)
    assert told == sorted(float(r["best_val_acc"]) for r in rows.values()), (told, rows)
    # ... with the search's own data and epochs (the line gave neither)
    results = _result_files(storage / "s")
    best_config = results[1]["train_config"]
    assert best_config["data"]["root"] == str(synthetic_root) and best_config["epochs"] == EPOCHS

    returncode, again = _run_line(command, tmp_path, tmp_path / "again.log")   # on the finished search
    assert returncode == 0, again[-3000:]
    assert "demo:" not in again and "lost the others" not in again, again[-3000:]
    assert _result_files(storage / "s") == results
    _assert_complete(uri, retrained=name)
    assert not MlflowClient(uri).search_registered_models()      # --no-log-model holds on every resume


def _train_worker_pids(address: str) -> list[int]:
    """PIDs of the Ray Train workers alive on the Ray at `address`: the session's, where this
    test's search is the only one running (each test waits for it to be idle: conftest)."""
    from ray.util.state import list_actors

    actors = list_actors(address=address, limit=1000,
                         filters=[("class_name", "=", "RayTrainWorker"), ("state", "=", "ALIVE")])
    return [a.pid for a in actors if a.pid]


@pytest.mark.slow
def test_a_killed_worker_restarts_then_a_killed_and_a_sigtermed_driver_resume_one_run_per_trial(
        shared_ray, synthetic_root, tmp_path):
    """One search of 2 trials (4 epochs, one at a time), three faults in turn, each what its own
    search showed before:
    1. SIGKILL trial 1's Train worker once its epoch-1 checkpoint is Train's: Ray Train restarts
       the worker group from it (--max-failures, default 1), the trial finishes every epoch, and
       MLflow shows the restart.
    2. SIGKILL the driver after trial 1 finished (Ray ends its job's actors): MLflow keeps the
       one finished run, and the console and the search's log keep the --resume line the search
       printed when it started (a killed driver prints nothing at its end).
    3. that line as printed, then SIGTERM once trial 2 has a checkpoint (a job scheduler's stop,
       the driver only): an interruption too (exit 130, how to continue, the runs KILLED, none RUNNING).
    A last --resume runs the rest: MLflow ends with one parent and one child run per trial, the
    finished trial kept (not re-run as a new run), every epoch there and every run FINISHED."""
    uri = f"sqlite:///{tmp_path / 'mlruns.db'}"
    storage = tmp_path / "results"
    runs = storage / "k" / "ray" / "train_runs"
    args = ["--data", str(synthetic_root), *SMALL, "--storage", str(storage), "--mlflow-uri", uri,
            "--name", "k"]
    log = tmp_path / "first.log"
    proc = _start(args, tmp_path, log, shared_ray)
    try:
        # 1. the worker: found while its first epoch trains, killed once that epoch's checkpoint
        # is registered with Train's checkpoint manager (a restart resumes from Train's latest)
        _wait_for_first_epoch(proc, storage, "k")
        workers = _wait_for(lambda: _train_worker_pids(shared_ray), proc, "a RayTrainWorker")
        (name,) = _wait_for(lambda: [t for t, kept in _registered_checkpoints(storage, "k").items() if kept],
                            proc, "trial 1's epoch-1 checkpoint registered")
        assert not (runs / name / f"epoch_{EPOCHS:04d}").exists(), "the trial ended before the kill"
        for pid in workers:
            os.kill(pid, signal.SIGKILL)
        # 2. the driver, a few seconds after trial 1 is done (trial 2 needs ~10 s to train its epoch)
        _wait_for(lambda: re.search(rf"^{re.escape(name)} done: ", log.read_text(errors="replace"), re.M),
                  proc, f"{name} done", poll_s=1)
        time.sleep(3)                               # let the driver write the child run's end
        assert proc.poll() is None, f"the search ended before it could be killed:\n{log.read_text()[-3000:]}"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    c, _, before = _runs(uri)
    (done,) = [r for r in before if r.info.status == "FINISHED"]
    steps = [m.step for m in c.get_metric_history(done.info.run_id, "val_acc")]
    assert done.info.run_name == name and sorted(steps) == list(range(1, EPOCHS + 1)), (done.info.run_name,
                                                                                         steps)
    assert "restarted from its epoch-" in done.data.tags.get(RESUMED_TAG, ""), done.data.tags

    # the line printed at the start, once, before the first trial's; in the search's log too
    console = log.read_text(errors="replace").splitlines()
    starts = [i for i, ln in enumerate(console) if ln.startswith(AT_START)]
    first_trial_line = min(i for i, ln in enumerate(console) if ln.startswith(name))
    assert len(starts) == 1 and starts[0] < first_trial_line, console
    line = console[starts[0]].removeprefix(AT_START)
    assert shlex.split(line) == [VIDTUNE, "search", "--resume", "--name", "k", "--storage", str(storage),
                                 "--mlflow-uri", uri], line
    assert console[starts[0]] in (storage / "k" / "search.log").read_text(errors="replace").splitlines()

    # 3. that line, as printed (joined to the tests' Ray); SIGTERM once trial 2 has a checkpoint
    log = tmp_path / "resume.log"
    proc = subprocess.Popen([*shlex.split(line), "--address", shared_ray], cwd=tmp_path, env=_env(),
                            stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)
    _wait_for(lambda: sum(bool(kept) for kept in _registered_checkpoints(storage, "k").values()) == 2, proc,
              "trial 2's first checkpoint")
    proc.send_signal(signal.SIGTERM)
    out = _finish(proc, log)
    assert proc.returncode == 130, out[-3000:]
    assert "SIGTERM received" in out and "--resume --name k" in out
    _, parent, children = _runs(uri)
    assert parent.info.status == "KILLED" and all(r.info.status != "RUNNING" for r in children)

    returncode, out = _run_line([*SEARCH, "--address", shared_ray, *args, "--resume"], tmp_path,
                                tmp_path / "last.log")
    assert returncode == 0, out[-3000:]
    _, parent, children = _runs(uri)                     # one parent (asserted there)
    assert parent.info.status == "FINISHED" and {r.info.status for r in children} == {"FINISHED"}
    trial_ids = [r.data.tags[TRIAL_ID_TAG] for r in children]
    assert len(trial_ids) == 2 and len(set(trial_ids)) == 2          # no duplicate child runs
    assert done.info.run_id in {r.info.run_id for r in children}     # kept, not re-run as a new run
    # (not asserted: every epoch of trial 2. An epoch whose report is under way at SIGTERM can be
    # Train's latest checkpoint yet never reach Tune, so the resume continues after it and MLflow
    # never gets its point: seen once, [1, 3, 4]. The Ctrl-C test lands between reports.)


@pytest.mark.slow
def test_tracking_server_dies_mid_search_nothing_is_lost(shared_ray, synthetic_root, tmp_path):
    from test_mlflow_server import MlflowServer

    root = tmp_path / "server"
    root.mkdir()
    server = MlflowServer(root)
    storage = tmp_path / "results"
    try:
        url = server.wait_healthy()
        # one trial: its second epoch is trained while the server is down
        args = ["--data", str(synthetic_root), *SMALL, *SHORT, "--num-samples", "1",
                "--storage", str(storage), "--name", "o"]
        log = tmp_path / "search.log"
        proc = _start([*args, "--mlflow-uri", url], tmp_path, log, shared_ray)
        _wait_for_first_epoch(proc, storage, "o")
        server.stop()                                  # the tracking server goes away mid-search
        out = _finish(proc, log)
        # The search is not held up nor killed by it: it trains every trial and says what is pending.
        assert proc.returncode == 0, out[-3000:]
        assert f"MLflow: cannot write to {url}" in out and "MLflow is not up to date" in out
        assert "Traceback" not in out.split("trials:")[-1]
        assert "--resume --name o" in out.split("MLflow is not up to date")[-1]
    finally:
        server.stop()
    server = MlflowServer(root)                        # back, on the same store (another port)
    try:
        url = server.wait_healthy()
        log2 = tmp_path / "flush.log"
        proc = _start([*args, "--resume", "--mlflow-uri", url], tmp_path, log2, shared_ray)
        out = _finish(proc, log2)
        assert proc.returncode == 0, out[-3000:]
        assert "MLflow is not up to date" not in out
        _assert_complete(url, epochs=2, trials=1)
    finally:
        server.stop()


def _study(tmp_path: Path, name: str) -> list[tuple[int, str, str, float | None]]:
    """The search's Optuna study (beside the MLflow store): (number, trial name, state, value)."""
    import optuna

    study = optuna.load_study(study_name=name, storage=f"sqlite:///{tmp_path / 'optuna.db'}")
    return [(t.number, t.user_attrs.get(NAME_ATTR, ""), t.state.name, t.value) for t in study.trials]


@pytest.mark.slow
def test_disk_full_under_storage_stops_at_once_and_the_printed_resume_finishes_it(shared_ray, synthetic_root,
                                                                                 tmp_path):
    """--storage on a 4.5 MB tmpfs, 3 trials of 2 epochs: t01's two checkpoints (1.7 MB each)
    fit, t02's first does not. The search stops there (t02 not retried, t03 never started) with
    one line naming the path, the space to free and the resume command (exit 1), counts the 2
    trials that ran, leaves no zero-byte file, and tells Optuna t02 did not fail. After space is
    freed, the printed line finishes the search: Optuna's 3 trials COMPLETE with trials.csv's
    values under their first numbers, one FINISHED MLflow run per trial (the same runs)."""
    full = tmp_path / "full"
    full.mkdir()
    mounted = os.geteuid() == 0 and subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4608k", "tmpfs",
                                                    str(full)], capture_output=True).returncode == 0
    if not mounted:
        pytest.skip("needs root to mount a 4.5 MB tmpfs as the full disk")
    try:
        uri = f"sqlite:///{tmp_path / 'mlruns.db'}"
        args = ["--data", str(synthetic_root), *SMALL, *SHORT, "--num-samples", "3",
                "--storage", str(full), "--mlflow-uri", uri, "--name", "f"]
        log = tmp_path / "full.log"
        proc = _start(args, tmp_path, log, shared_ray)
        out = _finish(proc, log)
        last = out.strip().splitlines()[-1]
        assert proc.returncode == 1, out[-3000:]
        assert last.startswith(f"vidtune search: error: disk full at {full}"), out[-3000:]
        assert "free at least " in last and "t01-" in last, last          # the space to free, what is kept
        # at once: no retry of t02, no t03; one message, not two, and no traceback
        assert not re.search(r"Traceback|FAILED|started again|t03-|search interrupted", out), out[-3000:]
        assert re.search(r"^2 trials in \S+: 1 done, 1 interrupted$", out, re.M), out[-3000:]
        c, parent, children = _runs(uri)
        assert parent.info.status == "KILLED" and all(r.info.status != "RUNNING" for r in children)
        ran = {r.info.run_name: r.info.run_id for r in children}
        before = _study(tmp_path, "f")
        assert [(n, state) for n, _, state, _ in before] == [(0, "COMPLETE"), (1, "RUNNING")], before
        assert before[0][1].startswith("t01-") and before[0][3] is not None   # t02: stopped, not failed
        # Every file is whole or absent, and no temporary file is left. Empty by design: Ray's
        # storage markers, and the result logs of t02, which reported no epoch.
        files = [p for p in (full / "f").rglob("*") if p.is_file()]
        logs = re.compile(r"result\.json|progress\.csv|events\.out\.tfevents\..*")
        assert not [p for p in files if p.stat().st_size == 0 and p.name != ".validate_storage_marker"
                    and not (p.parent.name.startswith("t02-") and logs.fullmatch(p.name))], files
        assert not [p for p in files if p.name.endswith(".tmp")], files

        subprocess.run(["mount", "-o", "remount,size=200m", str(full)], check=True)
        code, out = _run_line(shlex.split(last.rsplit("with: ", 1)[1]), tmp_path, tmp_path / "resume.log")
        assert code == 0, out[-3000:]
        rows = {r["name"]: r for r in csv.DictReader((full / "f" / "trials.csv").open())}
        assert len(rows) == 3 and {r["status"] for r in rows.values()} == {"DONE"}, rows
        after = _study(tmp_path, "f")          # t01 and t02 under their first numbers, no other trial
        assert [n for n, *_ in after] == [0, 1, 2] and after[0][:2] == before[0][:2], after
        assert sorted(name for _, name, *_ in after) == sorted(rows), after
        for _, name, state, value in after:
            assert state == "COMPLETE" and value == pytest.approx(float(rows[name]["best_val_acc"]), abs=1e-4)
        c, parent, children = _runs(uri)
        assert parent.info.status == "FINISHED" and all(r.info.status == "FINISHED" for r in children)
        assert sorted(r.info.run_name for r in children) == sorted(rows)   # one run per trial
        assert {n: i for n, i in ((r.info.run_name, r.info.run_id) for r in children) if n in ran} == ran
    finally:
        subprocess.run(["umount", "-l", str(full)], capture_output=True)


def test_a_full_disk_says_which_whole_checkpoints_each_trial_kept(tmp_path):
    """The disk-full error's count: whole checkpoints only (a folder cut short by the full disk
    fails its checksums), per trial, as ranges where they run on."""
    from vidtune.trainer.training.checkpointing import write_checksums
    from vidtune.tune.running.faults import kept_checkpoints

    runs = tmp_path / "ray" / "train_runs"
    for trial, epochs in (("t01", (1, 2, 3)), ("t02", (1, 3)), ("t03", ())):
        (runs / trial).mkdir(parents=True)
        for epoch in epochs:
            folder = runs / trial / f"epoch_{epoch:04d}"
            folder.mkdir()
            (folder / "checkpoint.pt").write_bytes(b"x" * 100)
            write_checksums(folder)
    cut = runs / "t03" / "epoch_0001"
    cut.mkdir()
    (cut / "checkpoint.pt").write_bytes(b"x" * 100)
    write_checksums(cut)
    (cut / "checkpoint.pt").write_bytes(b"x" * 10)                   # cut short after its checksums
    assert kept_checkpoints(str(tmp_path / "ray")) == (
        "3 trials ran; checkpoints kept: t01 epochs 1-3, t02 epochs 1, 3, t03 none")
    assert kept_checkpoints(str(tmp_path / "elsewhere")) == ""
    assert kept_checkpoints("s3://bucket/search/ray") == ""
