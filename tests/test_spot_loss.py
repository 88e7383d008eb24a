"""A spot node taken back mid-trial: the node that hosts a trial's driver and Train controller
goes away, and the search runs the trial again on another node from its last checkpoint instead
of ending it in ERROR (Tune's FailureConfig, --max-failures).

Ray's fake cluster (`ray.cluster_utils.Cluster`) runs in a subprocess that adds and removes
nodes on command. Its head has no CPUs, as a cluster.yaml head running only the search: the
trial can only go to a worker node, and the search's own actors (lease, registry) stay on the
head. Its GCS declares a node dead after 3 missed health checks 1 s apart (Ray's defaults: 5,
3 s apart), so the lost trial waits ~3 s rather than ~15 s for its node to be written off; and
it has no dashboard, which nothing here reads. Slow, and bounded: every wait has a deadline.
"""
from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from tests.fake_cluster import PRELUDE
from vidtune.tune.tracking.schema import PARENT_TAG

REPO = Path(__file__).resolve().parents[1]
EPOCHS = 4
WAIT_S = 300

# Commands on stdin, one per line: "add" (a worker node with 2 CPUs; prints its id),
# "remove <node id>" (kills that node's processes at once, as a reclaimed instance), "quit".
CLUSTER_PROCESS = PRELUDE + r"""
cluster = start_head(num_cpus=0, include_dashboard=False,
                     _system_config={"health_check_period_ms": 1000, "health_check_failure_threshold": 3})
nodes = {}
try:
    print(json.dumps({"address": cluster.address}), flush=True)
    for line in sys.stdin:
        command, _, arg = line.strip().partition(" ")
        if command == "add":
            node = cluster.add_node(num_cpus=2)
            cluster.wait_for_nodes()
            nodes[node.node_id] = node
            print(json.dumps({"node_id": node.node_id}), flush=True)
        elif command == "remove":
            cluster.remove_node(nodes.pop(arg), allow_graceful=False)
            print(json.dumps({"removed": arg}), flush=True)
        else:
            break
finally:
    cluster.shutdown()
"""


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)      # the search joins the cluster given by --address
    env.pop("PYTHONPATH", None)       # as on a real cluster, workers get the code from the runtime_env
    return env


class FakeCluster:
    def __init__(self, log: Path):
        self._log = open(log, "w")
        self.proc = subprocess.Popen([sys.executable, "-c", CLUSTER_PROCESS], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._log, text=True, env=_env())
        self.address = self._answer()["address"]

    def _answer(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            pytest.fail("the fake cluster stopped; see its log")
        return json.loads(line)

    def command(self, line: str) -> dict:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self._answer()

    def close(self) -> None:
        try:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.close()
            self.proc.wait(timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait(timeout=15)
        self._log.close()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_trial_whose_node_is_reclaimed_finishes_on_another_node(synthetic_root, tmp_path):
    cluster = FakeCluster(tmp_path / "cluster.log")
    proc = None
    try:
        first = cluster.command("add")["node_id"]
        uri = f"sqlite:///{tmp_path / 'mlruns.db'}"
        storage = tmp_path / "results"
        log = tmp_path / "search.log"
        proc = subprocess.Popen(
            [sys.executable, str(REPO / "tune" / "search.py"), "--address", cluster.address,
             "--data", str(synthetic_root), "--num-samples", "1", "--epochs", str(EPOCHS),
             "--batch-sizes", "4", "--no-early-stop", "--loader-workers", "0", "--no-log-model",
             "--storage", str(storage), "--mlflow-uri", uri, "--name", "spot"],
            cwd=tmp_path, env=_env(), stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)
        # An epoch checkpointed (a folder is Train's once the next one appears), then the trial's
        # node goes and a replacement joins, as an autoscaler replaces a reclaimed spot node. The
        # node goes at once (2 epochs left to train meanwhile); the trial waits for the new one.
        runs = storage / "spot" / "ray" / "train_runs"
        deadline = time.monotonic() + WAIT_S
        while not list(runs.glob("*/epoch_0002")):
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "no epoch was trained in time"
            time.sleep(0.5)
        assert not list(runs.glob(f"*/epoch_{EPOCHS:04d}")), "the trial ended before the node went"
        cluster.command(f"remove {first}")
        second = cluster.command("add")["node_id"]
        try:
            proc.wait(timeout=WAIT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail(f"the search did not end:\n{log.read_text()[-3000:]}")
        out = log.read_text(errors="replace")
        assert proc.returncode == 0, out[-3000:]
        assert "started again from its last checkpoint (its last try ended: " in out, out[-3000:]
        # No trial can train on the CPU-less head, so the driver fills no clip cache of its own,
        # only the worker node's (printed as "clip cache on node ADDRESS: Clip cache ..."; the
        # driver's own fill prints its "Clip cache ..." lines bare).
        assert not [line for line in out.splitlines() if line.startswith("Clip cache ")], out[-3000:]
        assert "filling it on 1 other node(s)" in out, out[-3000:]

        client = MlflowClient(uri)
        runs_ = client.search_runs([client.get_experiment_by_name("vidtune").experiment_id])
        (child,) = [r for r in runs_ if PARENT_TAG in r.data.tags]
        assert child.info.status == "FINISHED", (child.data.tags, out[-3000:])
        steps = sorted({m.step for m in client.get_metric_history(child.info.run_id, "val_acc")})
        assert steps == list(range(1, EPOCHS + 1)), steps
        # It went on from a checkpoint, on the node that replaced the lost one.
        assert child.data.tags.get("vidtune.node_id") == second, child.data.tags
        assert "restarted from its epoch-" in child.data.tags.get("vidtune.resumed", ""), child.data.tags
        (row,) = csv.DictReader((storage / "spot" / "trials.csv").open())
        assert row["status"] == "DONE", (row, out[-3000:])
    finally:
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        cluster.close()
