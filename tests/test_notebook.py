"""vidtune in a Jupyter kernel (issue 55): nbclient runs examples/quickstart.ipynb end to end on the
CPU and the test reads the outputs it left; a kernel interrupt during a search ends the cell with
SearchInterrupted, `resume=True` in the same kernel finishes the search, and no process the
kernel started (Ray's gcs_server and raylet among them) outlives the kernel.

Each search here starts its own local Ray (as in a user's notebook), 2 trials x 1 epoch of `tiny`
on 24 small generated videos.
"""
from __future__ import annotations

import json
import queue
import re
import socket
import time
from pathlib import Path

import psutil
import pytest

from vidtune.trainer.ray_setup.ray_reaper import ray_processes_under

nbformat = pytest.importorskip("nbformat")

REPO_ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = REPO_ROOT / "examples" / "quickstart.ipynb"
CELL_TIMEOUT_S = 300       # the search's cell: ~1.5 min alone on 2 cores, bounded for a loaded machine
KERNEL_START_S = 60
RAY_NAMES = ("gcs_server", "raylet")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _code_cells(nb) -> list:
    return [c for c in nb.cells if c.cell_type == "code"]


# -- the notebook as committed ------------------------------------------------------------------

def test_the_notebook_is_committed_without_outputs_and_with_one_parameters_cell():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    dirty = [c.source.splitlines()[0] for c in _code_cells(nb) if c.outputs or c.execution_count is not None]
    assert not dirty, f"commit {NOTEBOOK.name} without outputs (cells: {dirty})"
    params = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    assert len(params) == 1 and "WORKDIR" in params[0].source
    assert nb.metadata["kernelspec"]["name"] == "python3"


# -- the notebook, run ----------------------------------------------------------------------------

def _result_of(nb, source: str) -> dict:
    """The data of the execute_result of the code cell whose source is `source`."""
    cell = next(c for c in _code_cells(nb) if c.source.strip() == source)
    results = [o for o in cell.outputs if o.output_type == "execute_result"]
    assert results, f"cell {source!r} shows nothing: {cell.outputs}"
    return results[0].data


@pytest.mark.slow
@pytest.mark.timeout(2 * CELL_TIMEOUT_S)
def test_the_quickstart_notebook_runs_end_to_end(tmp_path):
    from nbclient import NotebookClient

    nb = nbformat.read(NOTEBOOK, as_version=4)
    work, port = tmp_path / "work", _free_port()
    # As papermill does: the given values in a cell right after the one tagged "parameters"
    at = next(i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", []))
    nb.cells.insert(at + 1, nbformat.v4.new_code_cell(
        f"WORKDIR = Path({str(work)!r})\nVIDEOS = 24\nTRIALS = 2\nEPOCHS = 1\nUI_PORT = {port}"))
    NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()

    outputs = [o for c in _code_cells(nb) for o in c.outputs]
    errors = [o for o in outputs if o.output_type == "error"]
    assert not errors, f"error output: {errors[0].ename}: {errors[0].evalue}"
    stderr = "".join(o.text for o in outputs if o.output_type == "stream" and o.name == "stderr")
    assert "Traceback" not in stderr, stderr[-3000:]

    # The search printed its progress and its answer in its cell
    search_cell = next(c for c in _code_cells(nb) if c.source.startswith("result = vidtune.search("))
    printed = "".join(o.get("text", "") for o in search_cell.outputs)
    assert "trial 1/2" in printed and "Best: " in printed, printed[-3000:]
    # nothing but the console's lines: no empty HTML block of Tune's Jupyter reporter above them
    assert [o.output_type for o in search_cell.outputs] == ["stream"] * len(search_cell.outputs)

    # The trials table: the search's trials.csv, both trials
    (folder,) = [p.parent for p in (work / "results").glob("*/trials.csv")]
    names = [line.split(",")[0] for line in (folder / "trials.csv").read_text().splitlines()[1:]]
    table = _result_of(nb, "result.trials")["text/html"]
    rows = re.findall(r"<tr>\s*<th>\d+</th>\s*<td>([^<]+)</td>", table.split("<tbody>")[1])
    assert rows == names and len(names) == 2, (rows, names)
    # the best trial is the console's answer and the table's first row
    assert re.search(rf"^Best: {re.escape(names[0])} \(batch ", printed, flags=re.M), printed[-3000:]
    assert f"name='{names[0]}'" in _result_of(nb, "result.best")["text/plain"]
    assert str(folder) in _result_of(nb, "result")["text/plain"]
    assert "<table" in _result_of(nb, "result")["text/html"]

    # Three videos scored: P(violent) in [0, 1] for each
    series = next(o for c in _code_cells(nb) if "vidtune.predict(" in c.source
                  for o in c.outputs if o.output_type == "execute_result").data["text/plain"]
    lines = series.strip().splitlines()
    assert lines[-1].startswith("Name: P(Fight)"), series
    probabilities = [float(line.split()[-1]) for line in lines[:-1]]
    assert len(probabilities) == 3 and all(0.0 <= p <= 1.0 for p in probabilities), series

    # MLflow's UI was started on the search's store (a link to its runs), then stopped
    link = _result_of(nb, "ui = vidtune.ui(result, port=UI_PORT)\nui")["text/html"]
    assert f'href="http://127.0.0.1:{port}/#/experiments/' in link, link
    with socket.socket() as s, pytest.raises(ConnectionRefusedError):
        s.connect(("127.0.0.1", port))      # nothing listens: ui.stop() ended it


# -- an interrupt in a kernel, then resume ---------------------------------------------------------

def _run(kc, code: str, timeout_s: float, on_text=None) -> tuple[dict, str]:
    """Execute `code` in the kernel: (the execute reply's content, everything it printed).
    `on_text(printed so far)` is called on each new output."""
    msg_id = kc.execute(code)
    printed: list[str] = []
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            msg = kc.get_iopub_msg(timeout=max(0.1, deadline - time.monotonic()))
        except queue.Empty:
            tail = "".join(printed)[-3000:]
            pytest.fail(f"the cell did not finish in {timeout_s:.0f} s; it printed:\n{tail}")
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        kind, content = msg["msg_type"], msg["content"]
        if kind == "stream":
            printed.append(content["text"])
        elif kind == "error":
            printed.append(f"{content['ename']}: {content['evalue']}\n")
        elif kind == "status" and content["execution_state"] == "idle":
            break
        if on_text is not None and kind in ("stream", "error"):
            on_text("".join(printed))
    while True:
        reply = kc.get_shell_msg(timeout=30)
        if reply["parent_header"].get("msg_id") == msg_id:
            return reply["content"], "".join(printed)


def _ray_processes(root) -> dict:
    """{process: its name} of Ray's processes under `root` (GCS, raylet, agents, workers), as
    the search's own reaper finds them (`trainer.ray_setup.ray_reaper`)."""
    found = {}
    for p in ray_processes_under(root):
        try:
            found[p] = p.name()
        except psutil.NoSuchProcess:
            pass
    return found


def _still_running(processes, timeout_s: float = 30) -> list:
    """Those of `processes` still running after up to `timeout_s` (a zombie no parent has reaped
    yet is not running: it holds no memory, port or file)."""
    _, alive = psutil.wait_procs(list(processes), timeout=timeout_s)
    running = []
    for p in alive:
        try:
            if p.status() != psutil.STATUS_ZOMBIE:
                running.append(p)
        except psutil.NoSuchProcess:
            pass
    return running


@pytest.fixture(scope="module")
def small_clips(tmp_path_factory) -> Path:
    from vidtune.datasets.synthetic import generate

    return generate(tmp_path_factory.mktemp("nb-clips") / "rwf", videos=24, seed=0)


@pytest.mark.slow
@pytest.mark.timeout(3 * CELL_TIMEOUT_S)
def test_a_kernel_interrupt_leaves_the_search_resumable_and_no_ray_behind(tmp_path, small_clips):
    from jupyter_client.manager import start_new_kernel

    work = tmp_path / "work"
    work.mkdir()
    call = (f"data={str(small_clips)!r}, model='tiny', num_samples=2, epochs=1, name='nb-interrupt', "
            f"storage={str(work / 'results')!r}, mlflow_uri={'sqlite:///' + str(work / 'mlruns.db')!r}")
    km, kc = start_new_kernel(kernel_name="python3", startup_timeout=KERNEL_START_S, cwd=str(tmp_path))
    kernel = psutil.Process(km.provisioner.process.pid)
    # Every Ray process the kernel started, seen as its descendants while its searches run: other
    # tests (and other Rays on this machine) start and stop theirs meanwhile, so a before/after
    # count of the machine's Ray processes would blame or hide them.
    seen: dict[psutil.Process, str] = {}
    try:
        reply, _ = _run(kc, "import vidtune", KERNEL_START_S)
        assert reply["status"] == "ok", reply

        interrupted_at: list[float] = []

        def interrupt_once_the_second_trial_starts(printed: str) -> None:
            if not interrupted_at and re.search(r"trial 2/2 \S+ started", printed):
                seen.update(_ray_processes(kernel))
                interrupted_at.append(time.monotonic())
                km.interrupt_kernel()      # SIGINT to the kernel, as the notebook's stop button

        code = f"try:\n    vidtune.search({call})\nexcept BaseException as e:\n    stopped = e\n    raise\n"
        reply, printed = _run(kc, code, CELL_TIMEOUT_S, interrupt_once_the_second_trial_starts)
        assert interrupted_at, f"the search ended before its second trial started:\n{printed[-3000:]}"
        assert reply["status"] == "error" and reply["ename"] == "SearchInterrupted", (reply, printed[-3000:])
        assert "resume=True" in reply["evalue"], reply["evalue"]
        assert "UNFINISHED" in printed, f"no summary after the interrupt:\n{printed[-3000:]}"
        assert set(RAY_NAMES) <= set(seen.values()), f"the search's Ray was not seen: {seen}"
        # The interrupted search shut its Ray down: nothing of it waits for the next cell
        alive = _still_running(seen)
        assert not alive, f"still running after the interrupted search: {[(p.pid, seen[p]) for p in alive]}"

        # What the interrupt kept: the first trial's result, and no MLflow run left RUNNING
        check = ("import json, mlflow\n"
                 "client = mlflow.MlflowClient(stopped.result.mlflow_uri)\n"
                 "runs = client.search_runs([e.experiment_id for e in client.search_experiments()])\n"
                 "rows = stopped.result.trials[['name', 'status', 'best_val_acc']].to_dict('records')\n"
                 "statuses = sorted({r.info.status for r in runs})\n"
                 "print('KEPT', json.dumps({'trials': rows, 'runs': statuses}))\n")
        reply, printed = _run(kc, check, 60)
        assert reply["status"] == "ok", (reply, printed)
        kept = json.loads(printed.split("KEPT ", 1)[1])
        assert "RUNNING" not in kept["runs"], kept
        done = [t for t in kept["trials"] if t["status"] == "DONE"]
        assert len(done) == 1 and done[0]["name"].startswith("t01-"), kept

        # The same search, resumed in the same kernel: a second call, which finishes it
        resume = (f"result = vidtune.search({call}, resume=True)\n"
                  "print('RESUMED', json.dumps(result.trials[['name', 'status', 'best_val_acc']]"
                  ".to_dict('records')))\n")
        reply, printed = _run(kc, resume, CELL_TIMEOUT_S,
                              lambda _: seen.update(_ray_processes(kernel)))
        assert reply["status"] == "ok", (reply, printed[-3000:])
        trials = json.loads(printed.split("RESUMED ", 1)[1])
        assert sorted(t["name"][:3] for t in trials) == ["t01", "t02"], trials
        assert {t["status"] for t in trials} == {"DONE"}, trials
        first = next(t for t in trials if t["name"] == done[0]["name"])
        assert first == done[0], "the first trial was trained again"
    finally:
        km.shutdown_kernel(now=False)
        kc.stop_channels()
    # Ray's processes exit with their search or with the kernel; none outlives it
    alive = _still_running(seen)
    assert not alive, f"still running after the kernel shut down: {[(p.pid, seen[p]) for p in alive]}"
    assert not kernel.is_running()
