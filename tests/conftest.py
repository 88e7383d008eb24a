"""Shared fixtures: one generated dataset and one Ray for the whole test run."""
from __future__ import annotations

import gc
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

# A HOME of the test run's own, set before anything reads it: what the code under test keeps in a
# user's home stays out of the real one. Ray writes ~/.ray/auth_token on a local ray.init, and a
# later `ray start --head` on the machine then turns token authentication on; searches fill the
# clip cache (~/.cache/vidtune/clips) and sign their state with ~/.config/vidtune/state.key.
# Every Ray, search and CLI the tests start inherits it; it is removed when the run ends.
TEST_HOME = Path(tempfile.mkdtemp(prefix="vidtune-tests-home-"))
os.environ["HOME"] = str(TEST_HOME)
os.environ["XDG_CACHE_HOME"] = str(TEST_HOME / ".cache")
os.environ["XDG_CONFIG_HOME"] = str(TEST_HOME / ".config")

from vidtune.trainer.ray_setup.launch import DEFAULT_HEALTH_CHECK_INTERVAL_S, HEALTH_CHECK_ENV  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]   # first on sys.path: pyproject's pytest `pythonpath`

# Train's poll of its workers as vidtune sets it (trainer.ray_setup.launch), for the Rays the tests start
os.environ.setdefault(HEALTH_CHECK_ENV, DEFAULT_HEALTH_CHECK_INTERVAL_S)
# torch's OpenMP threads (GNU libgomp) spin ~300,000 times before they sleep; with more runnable
# threads than cores (two trainings at once, a trial starting beside one, anything else on a CI
# machine) the spinning crowds out the work. 15 steps of `tiny` on 2 threads beside one busy
# process: 5.9-7.0 s by default, 2.8 s spinning 1,000 times (libgomp's own count when it sees
# more threads than cores); alone, 1.4-1.7 s either way (OMP_WAIT_POLICY=PASSIVE: 1.9 s, and the
# suite 24 min instead of 21). Every test process, and every Ray and search they start, inherits it.
os.environ.setdefault("GOMP_SPINCOUNT", "1000")


@pytest.fixture(scope="session")
def synthetic_root(tmp_path_factory) -> Path:
    """A small learnable RWF-2000-layout dataset of real encoded videos, made once per session."""
    from vidtune.datasets.synthetic import generate

    out = tmp_path_factory.mktemp("synthetic") / "rwf"
    return generate(out, videos=48, seed=0)


# The test session's Ray, made and shut down in a helper process (which owns it: closing its stdin
# ends it), as tests/test_multinode.py makes its cluster: one head node with the CPUs of this
# machine. Ray's own helpers inside it (Train's placement-group cleaner) find their cluster by
# RAY_ADDRESS or the machine's "latest cluster" record; with other Rays on this machine (tests
# that start their own) only RAY_ADDRESS is unambiguous, so every Ray process inherits it; the
# dashboard gets a free port too. Prints "address: ..." once the node is up, then answers each
# line on its stdin (seconds to wait) with "settled: ...": `settle` below, after each test. Its
# stdout also carries what Ray prints to every driver, so both ends read past other lines.
SHARED_RAY = """
import os, socket, sys, time
import ray
from ray._common.utils import reset_ray_address
from ray.cluster_utils import Cluster
from ray.util import get_node_ip_address
from ray.util.placement_group import placement_group_table, remove_placement_group, PlacementGroup
from ray.util.state import list_actors
from vidtune.trainer.ray_setup.launch import PREEMPTION_WATCHER_ENV

def free_port():
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]

def all_free():
    total, free = ray.cluster_resources(), ray.available_resources()
    return all(free.get(k, 0) >= v for k, v in total.items() if k in ("CPU", "GPU"))

def settle(wait_s):
    # Wait for every CPU to be free again (a finished search's actors exit asynchronously);
    # past wait_s, name what still holds them, remove its placement groups and wait as long again.
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if all_free():
            return "clean"
        time.sleep(0.5)
    alive = [f"{a.class_name}(job {a.job_id}, pid {a.pid})"
             for a in list_actors(filters=[("state", "=", "ALIVE")], limit=1000)]
    pgs = [pg for pg, info in placement_group_table().items() if info["state"] != "REMOVED"]
    for pg in pgs:
        remove_placement_group(PlacementGroup(ray.PlacementGroupID.from_hex(pg)))
    deadline = time.monotonic() + wait_s
    while not all_free() and time.monotonic() < deadline:
        time.sleep(0.5)
    return (f"left over after {wait_s:.0f} s: {len(pgs)} placement group(s) removed, "
            f"actors alive: {', '.join(alive) or 'none'}; now {'clean' if all_free() else 'still held'}")

port = free_port()
os.environ["RAY_ADDRESS"] = f"{get_node_ip_address()}:{port}"
os.environ.setdefault(PREEMPTION_WATCHER_ENV, "0")     # as vidtune's own local Ray (trainer.ray_setup.launch)
cluster = Cluster(initialize_head=True, head_node_args={
    "num_cpus": 2, "gcs_server_port": port, "dashboard_port": free_port()})
reset_ray_address()
try:
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, logging_level="ERROR", log_to_driver=False)
    print(f"address: {cluster.address}", flush=True)
    for line in sys.stdin:                  # one request per test that used this Ray
        print(f"settled: {settle(float(line))}", flush=True)
finally:
    ray.shutdown()
    cluster.shutdown()
"""


@pytest.fixture(scope="session")
def shared_ray() -> str:
    """The address of one local Ray for the whole test run (2 CPUs), for the searches and
    trainings the tests run, in this process (`ray_session`) or as subprocesses given
    `--address` (as a search joins a cluster): each would otherwise start and stop a Ray of its
    own (~15 s a search here). Tests of Ray's own start and stop, of simulated GPUs, of a fake
    multi-node cluster and of an installed wheel start their own."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    holder = subprocess.Popen([sys.executable, "-c", SHARED_RAY], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env=env)
    address = next((line.removeprefix("address: ").strip() for line in holder.stdout
                    if line.startswith("address: ")), "")
    if not address:
        holder.kill()
        pytest.fail(f"the test session's Ray did not start (exit {holder.wait(timeout=30)})")
    global _SHARED_RAY_HOLDER
    _SHARED_RAY_HOLDER = holder
    yield address
    _SHARED_RAY_HOLDER = None
    holder.stdin.close()
    try:
        holder.wait(timeout=60)
    except subprocess.TimeoutExpired:
        holder.kill()


SHOW_DURATION_S = 20     # a test phase that takes longer has its seconds printed after its dot
_CONFIG = None
_NOTES: list[str] = []     # lines for the terminal from fixtures, whose output is captured


def pytest_configure(config):
    global _CONFIG, _CPU_AT_START
    _CONFIG = config
    _CPU_AT_START = machine_cpu_seconds()


_CPU_AT_START: tuple[float, float] | None = None


def machine_cpu_seconds() -> tuple[float, float] | None:
    """(busy, total) CPU seconds of the whole machine since boot, summed over its cores, from
    Linux's /proc/stat (None elsewhere). Busy is everything but idle and iowait: this process,
    its Rays, searches and helpers, and whatever else runs beside them."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()
    except (OSError, IndexError):
        return None
    if not fields or fields[0] != "cpu":
        return None
    ticks = [int(x) for x in fields[1:9]]     # user nice system idle iowait irq softirq steal
    hz = os.sysconf("SC_CLK_TCK")
    return (sum(ticks) - ticks[3] - ticks[4]) / hz, sum(ticks) / hz


_CPU_BY_TEST: dict[str, float] = {}     # machine core-seconds busy while each test ran (setup to teardown)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Counts the machine's busy core-seconds while each test runs, for the summary's list of the
    tests that cost the most CPU: wall time (`--durations`) does not say whether a test is slow
    for its work (only sharing or doing less helps) or for its waits (running beside another helps)."""
    before = machine_cpu_seconds()
    try:
        return (yield)
    finally:
        after = machine_cpu_seconds()
        if before and after:
            _CPU_BY_TEST[item.nodeid] = after[0] - before[0]


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter):
    """One line on how busy the machine's cores were during the run. A suite whose cores were
    mostly busy is shortened only by doing less work (fewer searches, processes, imports); one
    whose cores idled has time in waits, which running tests side by side could fill."""
    now = machine_cpu_seconds()
    if _CPU_AT_START is None or now is None:
        return
    busy, total = now[0] - _CPU_AT_START[0], now[1] - _CPU_AT_START[1]
    if total <= 0:
        return
    cores = os.cpu_count() or 1
    share = 100 * busy / total
    shown = terminalreporter.config.getoption("durations", None)    # as many as --durations (0: all)
    if _CPU_BY_TEST and shown is not None:
        ranked = sorted(_CPU_BY_TEST.items(), key=lambda kv: -kv[1])[:shown or None]
        terminalreporter.write_sep("=", f"{len(ranked)} tests that kept the cores busiest (core-seconds)")
        for nodeid, seconds in ranked:
            terminalreporter.write_line(f"{seconds:8.1f}  {nodeid}")
    terminalreporter.write_line(f"CPU: {busy:.0f} of {total:.0f} core-seconds busy ({share:.0f}%) on {cores} "
                                f"core(s): this much work takes at least {busy / cores / 60:.1f} min here, "
                                "however the tests are arranged")


def pytest_collection_finish(session):
    """Moves what exists once every test module is imported (torch, Ray, MLflow, ...: ~600,000
    objects) out of the garbage collector's reach. Each full collection otherwise walks them all:
    0.2-0.5 s here, paid by every `gc.collect()` the code under test calls (the batch-size probe,
    one per size it tries) and by the collector's own full passes. Objects the tests make later
    are collected as before."""
    gc.freeze()


_EXIT_STATUS: int | None = None


def pytest_sessionfinish(session, exitstatus):
    global _EXIT_STATUS
    _EXIT_STATUS = int(exitstatus)
    shutil.rmtree(TEST_HOME, ignore_errors=True)     # every fixture, Ray included, has ended by now


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """Ends the test process once pytest has reported, with pytest's exit status, skipping the
    interpreter's teardown. This process has joined, left and rejoined Rays (`ray_session`, a
    failed test's renewed connection, modules' own Rays) and run torch, decord and MLflow threads;
    tearing all that down has crashed it after its results were in (CI of 14a08cc: "882 passed",
    then make's "Segmentation fault"; Ray's issue #31145 is one such crash). The results are
    printed by then and every Ray it used is shut down (`ray_session`, `shared_ray`); a crash
    during the tests still shows, with a traceback (the Makefile sets PYTHONFAULTHANDLER)."""
    if _EXIT_STATUS in (None, pytest.ExitCode.USAGE_ERROR):   # nothing ran; pytest prints why after this
        return
    if hasattr(config, "workerinput"):   # a pytest-xdist worker ends as xdist expects: its channel to
        return                           # the controller closes first (not env: a test's pytest inherits it)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_EXIT_STATUS)


@pytest.hookimpl(trylast=True)
def pytest_runtest_logreport(report):
    """Prints a slow test's seconds inline (`..[63s].`, `[setup 49s]`), so a run cut short by
    CI's time limit still shows where its time went; `--durations` prints only at the end."""
    terminal = _CONFIG and _CONFIG.pluginmanager.get_plugin("terminalreporter")
    if not terminal:
        return
    while _NOTES:
        terminal.write_line("")
        terminal.write_line(_NOTES.pop(0), yellow=True)
    if report.duration < SHOW_DURATION_S or terminal.verbosity > 0:
        return
    phase = "" if report.when == "call" else f"{report.when} "
    terminal.write(f"[{phase}{report.duration:.0f}s]")


_SHARED_RAY_HOLDER: subprocess.Popen | None = None
SETTLE_S = 60      # how long a test's leftovers on the shared Ray may take to exit on their own


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """Keeps each phase's report on the test item, for `shared_ray_settles`."""
    report = yield
    setattr(item, f"report_{report.when}", report)
    return report


@pytest.fixture(autouse=True)
def interruption_state_is_per_test():
    """A search's interruption state (`tune.running.faults.STATE`: interrupted, the unfinished
    trials, a full disk) is the process's: a test that ran a search in this process, or stopped
    one, leaves it set, and a later test's trials would read as UNFINISHED. Reset after each test
    that could have set it (the module loaded), as `tune.runner.execute` does for each search."""
    yield
    faults = sys.modules.get("vidtune.tune.running.faults")
    if faults is not None:
        faults.reset()


@pytest.fixture(autouse=True)
def shared_ray_settles(request):
    """After each test that used the session's Ray, the next one finds every CPU free: a test
    that failed in this process (`ray_session`) has its connection renewed, which ends the actors
    it left (a search interrupted by a timeout keeps training otherwise, slowing every later
    test); then the holder waits until the Ray is idle, and names and clears what is not. Before a
    test that uses this process's connection (`ray_session`), a connection an earlier test of this
    process closed is opened again, and that is said (with the test before it) at the end of the run."""
    if "ray_session" in request.fixturenames:
        import ray

        from vidtune.trainer.ray_setup.launch import init_ray

        if not ray.is_initialized():
            _NOTES.append(f"the session's Ray connection was closed before {request.node.nodeid}; reopened")
            init_ray(address=request.getfixturevalue("shared_ray"))
    yield
    if _SHARED_RAY_HOLDER is None or "shared_ray" not in request.fixturenames:
        return
    report = getattr(request.node, "report_call", None)
    if "ray_session" in request.fixturenames and (report is None or report.failed):
        import ray

        from vidtune.trainer.ray_setup.launch import init_ray

        ray.shutdown()
        init_ray(address=request.getfixturevalue("shared_ray"))
    _SHARED_RAY_HOLDER.stdin.write(f"{SETTLE_S}\n")
    _SHARED_RAY_HOLDER.stdin.flush()
    answer = ""
    for line in _SHARED_RAY_HOLDER.stdout:      # past what Ray prints to its drivers (raylet warnings)
        if line.startswith("settled: "):
            answer = line.removeprefix("settled: ").strip()
            break
    if answer != "clean":       # printed by pytest_runtest_logreport (output here is captured)
        _NOTES.append(f"shared Ray after {request.node.nodeid}: {answer or 'its holder is gone'}")


@pytest.fixture(scope="session")
def ray_session(shared_ray):
    """This process joined to the session's Ray (`shared_ray`; a process can join only one)."""
    import ray

    from vidtune.trainer.ray_setup.launch import init_ray

    init_ray(address=shared_ray)
    yield ray
    ray.shutdown()


SMOKE_MODEL = "rwf-tiny"     # the name `smoke_search` registers its best model under


@pytest.fixture(scope="session")
def smoke_search(shared_ray, synthetic_root, tmp_path_factory):
    """`vidtune search --smoke-test` (2 trials, 1 epoch) run once for the session as a user runs
    it, by path from a fresh folder, joined to `shared_ray`, registering its best model under
    SMOKE_MODEL: for the tests that read what a finished search printed and wrote (its console,
    its folder, its MLflow store and registered model) rather than each running one (~1 min)."""
    import json
    from types import SimpleNamespace

    folder = tmp_path_factory.mktemp("smoke-search")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}   # it joins --address
    out = subprocess.run([sys.executable, str(REPO_ROOT / "tune" / "search.py"), "--smoke-test",
                          "--data", str(synthetic_root), "--address", shared_ray,
                          "--register-model", SMOKE_MODEL],
                         cwd=folder, env=env, capture_output=True, text=True, timeout=600)
    best_config = next((folder / "vidtune-results").glob("*/best_config.json"), None)
    best = json.loads(best_config.read_text()) if best_config else {}
    return SimpleNamespace(folder=folder, returncode=out.returncode, stdout=out.stdout, stderr=out.stderr,
                           uri=f"sqlite:///{folder / 'mlruns.db'}", results=best_config.parent if best_config
                           else None, checkpoint=best.get("checkpoint"), trial=best.get("checkpoint_trial"))


RAY_FIXTURES = {"shared_ray", "ray_session", "smoke_search"}   # each starts Ray or a search: slow
# Under pytest-xdist (`make test`), the tests that use the session's Ray or search all run in one
# process, one after another (`--dist loadgroup`): one Ray and one smoke search for them all, as
# when the suite runs in one process. The other process takes the rest: unit tests, and the tests
# that start Rays, clusters, SLURM jobs or benchmarks of their own.
SHARED_RAY_GROUP = "shared-ray"


def pytest_collection_modifyitems(config, items):
    """A test that uses the session's Ray or search must be marked `slow` (else `make test-fast`
    starts Ray: a mark once landed on a helper function above its test instead). Tests marked `gpu`
    run where torch sees a CUDA device (`pytest -m gpu` on a GPU machine) and are skipped, saying
    why, everywhere else."""
    unmarked = [item.nodeid for item in items if RAY_FIXTURES & set(getattr(item, "fixturenames", ()))
                and not item.get_closest_marker("slow")]
    if unmarked:
        raise pytest.UsageError(f"these tests use {sorted(RAY_FIXTURES)} but are not marked "
                                f"@pytest.mark.slow: {', '.join(unmarked)}")
    if config.getoption("dist", "no") != "no":      # side by side in pytest-xdist's processes
        for item in items:
            if RAY_FIXTURES & set(getattr(item, "fixturenames", ())):
                item.add_marker(pytest.mark.xdist_group(SHARED_RAY_GROUP))
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="gpu: needs a CUDA device; torch.cuda.is_available() is False here")
    for item in gpu_items:
        item.add_marker(skip)


@pytest.fixture
def own_key(tmp_path, monkeypatch):
    """A state key of this test's own (never the user's ~/.config/vidtune/state.key)."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))


@pytest.fixture
def no_ray(monkeypatch):
    """Fail the test if the search gets as far as starting Ray."""
    from vidtune.tune import runner  # heavy (Ray): only for the tests that ask for it

    def refuse(*a, **kw):
        raise AssertionError("Ray was started")

    monkeypatch.setattr(runner, "init_ray", refuse)
