"""The device lease (trainer.cluster.lease): one training at a time per device, first come first served,
all of a trial's devices at once, and an honest count of trainings that shared a device.

The bookkeeping (`LeaseBook`) is tested in-process on a fake clock: every grant and release
time is chosen by the test, and "still waiting" is checked after the event loop has run every
task as far as it can (no sleeps, no wall-clock time). Two slow tests drive the real Ray actor.
"""
from __future__ import annotations

import asyncio
import json
import math
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import ray

from vidtune.trainer.cluster.lease import LeaseBook, start_lease

REPO_ROOT = Path(__file__).resolve().parents[1]


class FakeClock:
    def __init__(self, now: float = 0.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


async def _settle() -> None:
    """Let every task run until it blocks on the lease (event-loop turns, not time)."""
    for _ in range(50):
        await asyncio.sleep(0)


def _book(capacity: int = 1, now: float = 10.0) -> tuple[LeaseBook, FakeClock]:
    clock = FakeClock(now)
    return LeaseBook(capacity=capacity, clock=clock), clock


def test_second_training_waits_until_the_first_releases():
    async def scenario():
        book, clock = _book()
        assert await book.acquire("a", ["n1/cpu"]) == 10.0
        clock.now = 12.0
        second = asyncio.create_task(book.acquire("b", ["n1/cpu"]))
        await _settle()
        assert not second.done()                                   # the device is busy
        assert book.snapshot()["waiting"] == ["b"] and book.snapshot()["holders"] == {"n1/cpu": ["a"]}
        clock.now = 20.0
        assert await book.release("a") is True
        await _settle()
        assert second.done() and second.result() == 20.0           # granted when a released, not when asked
        clock.now = 30.0
        assert await book.release("b") is True
        assert await book.release("b") is False                    # holds nothing any more
        assert book.snapshot()["intervals"] == [("a", ("n1/cpu",), 10.0, 20.0),
                                                ("b", ("n1/cpu",), 20.0, 30.0)]
        # each had the device to itself: never two trainings at once
        assert book.concurrent("a", 0.0, 100.0) == 1 and book.concurrent("b", 0.0, 100.0) == 1
        assert book.concurrent("a", 30.0, 40.0) == 0               # nobody held the device then
        assert book.concurrent("a", 19.0, 21.0) == 1               # a's end and b's start do not overlap

    asyncio.run(scenario())


def test_other_devices_do_not_wait_and_a_trial_takes_all_its_devices_at_once():
    async def scenario():
        book, clock = _book()
        await book.acquire("a", ["n1/gpu:0"])
        other = asyncio.create_task(book.acquire("b", ["n1/gpu:1"]))    # another GPU: at once
        both = asyncio.create_task(book.acquire("c", ["n1/gpu:0", "n1/gpu:1"]))   # waits for a and b
        await _settle()
        assert other.done() and not both.done()
        await book.release("a")
        await _settle()
        assert not both.done()                                        # holds neither while waiting
        assert book.snapshot()["holders"] == {"n1/gpu:1": ["b"]}
        clock.now = 15.0
        await book.release("b")
        await _settle()
        assert both.result() == 15.0
        assert book.snapshot()["holders"] == {"n1/gpu:0": ["c"], "n1/gpu:1": ["c"]}

    asyncio.run(scenario())


def test_first_come_first_served():
    async def scenario():
        book, _ = _book()
        await book.acquire("a", ["n1/cpu"])
        b = asyncio.create_task(book.acquire("b", ["n1/cpu"]))
        await _settle()
        c = asyncio.create_task(book.acquire("c", ["n1/cpu"]))
        elsewhere = asyncio.create_task(book.acquire("d", ["n2/cpu"]))   # another node: not behind b and c
        await _settle()
        assert book.snapshot()["waiting"] == ["b", "c"] and elsewhere.done()
        await book.release("a")
        await _settle()
        assert b.done() and not c.done()
        await book.release("b")
        await _settle()
        assert c.done()

    asyncio.run(scenario())


def test_the_record_has_every_grant_and_release_with_the_memory_each_worker_reported():
    async def scenario():
        book, clock = _book()
        await book.acquire("lead", ["n1/gpu:0"], device_mb=0.0)
        follower = asyncio.create_task(book.acquire("follow", ["n1/gpu:0"], device_mb=0.0))
        await _settle()
        clock.now = 20.0
        await book.release("lead", device_mb=2.0)                  # what the lead still held, freed first
        await _settle()
        assert follower.result() == 20.0
        assert [(r["time"], r["event"], r["owner"], r["keys"], r["device_mb"]) for r in book.record] == [
            (10.0, "grant", "lead", ["n1/gpu:0"], 0.0),
            (20.0, "release", "lead", ["n1/gpu:0"], 2.0),
            (20.0, "grant", "follow", ["n1/gpu:0"], 0.0)]
        assert book.snapshot()["record"] == book.record

    asyncio.run(scenario())


def test_a_restarted_trial_on_other_devices_queues_for_them_and_gives_the_old_ones_back():
    """Train restarts a trial's worker group after a failure (a spot node lost): on the same
    devices it has them again at once; on others it must wait for them like anyone else."""
    async def scenario():
        book, clock = _book()
        await book.acquire("t", ["n1/gpu:0"])
        await book.acquire("busy", ["n2/gpu:0"])
        clock.now = 11.0
        assert await book.acquire("t", ["n1/gpu:0"]) == 11.0         # same device: at once
        moved = asyncio.create_task(book.acquire("t", ["n2/gpu:0"]))  # landed on busy's GPU
        await _settle()
        assert not moved.done()                                      # not granted past busy's lease
        assert book.snapshot()["holders"] == {"n2/gpu:0": ["busy"]}  # n1/gpu:0 given back
        clock.now = 15.0
        await book.release("busy")
        await _settle()
        assert moved.result() == 15.0 and book.snapshot()["holders"] == {"n2/gpu:0": ["t"]}
        events = [r["event"] for r in book.record if r["owner"] == "t"]
        assert events == ["grant", "regrant", "moved", "grant"]

    asyncio.run(scenario())


def test_a_trial_ended_while_training_keeps_its_devices_until_its_workers_exited():
    """The search ends a stopped trial's controller; its workers die after it, asynchronously.
    Until they have exited their memory is still on the device, so the lease waits for them."""
    alive = {"w0": True}

    async def exited(worker):
        return not alive[worker]

    async def scenario():
        clock = FakeClock(10.0)
        book = LeaseBook(clock=clock, exited=exited, exit_wait_s=30)
        await book.acquire("stopped", ["n1/gpu:0"], worker="w0")
        waiting = asyncio.create_task(book.acquire("next", ["n1/gpu:0"]))
        ending = asyncio.create_task(book.end("stopped"))
        await asyncio.sleep(0.5)
        assert not ending.done() and not waiting.done()              # the worker still runs
        alive["w0"] = False
        clock.now = 12.0
        assert await ending is True
        await _settle()
        assert waiting.result() == 12.0
        assert [r["event"] for r in book.record] == ["grant", "end", "grant"]

    asyncio.run(scenario())


def test_a_trial_whose_workers_do_not_exit_gives_its_devices_back_after_the_wait():
    async def never(worker):
        return False

    async def scenario():
        book = LeaseBook(clock=FakeClock(10.0), exited=never, exit_wait_s=0.3)
        await book.acquire("stuck", ["n1/gpu:0"], worker="w0")
        assert await book.end("stuck") is True
        assert book.record[-1]["event"] == "end (workers still running)"
        assert await book.acquire("next", ["n1/gpu:0"]) == 10.0

    asyncio.run(scenario())


def test_every_worker_of_a_trial_gets_the_grant_of_its_first_request():
    async def scenario():
        book, clock = _book()
        await book.acquire("a", ["n1/gpu:0"])
        rank0 = asyncio.create_task(book.acquire("t", ["n1/gpu:0", "n1/gpu:1"]))
        rank1 = asyncio.create_task(book.acquire("t", ["n1/gpu:0", "n1/gpu:1"]))
        await _settle()
        assert not rank0.done() and not rank1.done() and book.snapshot()["waiting"] == ["t"]
        clock.now = 25.0
        await book.release("a")
        await _settle()
        assert rank0.result() == rank1.result() == 25.0
        assert book.snapshot()["holders"] == {"n1/gpu:0": ["t"], "n1/gpu:1": ["t"]}
        # one holding for the trial, not per rank
        assert len(book.snapshot()["intervals"]) == 2
        clock.now = 26.0
        assert await book.acquire("t", ["n1/gpu:0"]) == 26.0          # a restarted worker group: at once

    asyncio.run(scenario())


def test_packed_trials_are_counted_as_sharing():
    async def scenario():
        book, clock = _book(capacity=2)
        assert await book.acquire("a", ["n1/gpu:0"]) == 10.0
        clock.now = 12.0
        assert await book.acquire("b", ["n1/gpu:0"]) == 12.0            # capacity 2: no wait
        await book.acquire("other", ["n1/gpu:1"])                       # another device: not sharing
        clock.now = 15.0
        await book.release("b")
        assert book.concurrent("a", 10.0, 14.0) == 2
        assert book.concurrent("a", 10.0, 11.0) == 1                    # before b came
        assert book.concurrent("a", 15.0, 30.0) == 1                    # alone again (b ended at 15)
        assert book.concurrent("b", 0.0, 30.0) == 2

    asyncio.run(scenario())


def test_a_trial_stopped_while_waiting_leaves_the_queue():
    async def scenario():
        book, _ = _book()
        await book.acquire("a", ["n1/cpu"])
        stopped = asyncio.create_task(book.acquire("stopped", ["n1/cpu"]))
        waiting = asyncio.create_task(book.acquire("next", ["n1/cpu"]))
        await _settle()
        assert await book.release("stopped") is False        # held nothing, but leaves the queue
        await _settle()
        assert stopped.done() and stopped.result() is None    # and is never granted
        assert book.snapshot()["waiting"] == ["next"]
        await book.release("a")
        await _settle()
        assert waiting.done() and book.snapshot()["holders"] == {"n1/cpu": ["next"]}

    asyncio.run(scenario())


# --- the Ray actor --------------------------------------------------------------------------


@pytest.fixture
def lease(ray_session, request):
    handle = start_lease(f"test-lease-{request.node.name}", capacity=1)
    yield handle
    ray_session.kill(handle)


def _wait_until_waiting(lease, owners: list[str], timeout_s: float = 30.0) -> None:
    """Until the actor's queue is `owners` (calls to an async actor may start out of order)."""
    deadline = time.monotonic() + timeout_s
    while (waiting := ray.get(lease.snapshot.remote())["waiting"]) != owners:
        assert time.monotonic() < deadline, f"queue is {waiting}, expected {owners}"


@pytest.mark.slow
def test_the_actor_queues_grants_and_counts(lease):
    t0 = ray.get(lease.acquire.remote("a", ["n1/cpu"]))
    second = lease.acquire.remote("b", ["n1/cpu"])
    _wait_until_waiting(lease, ["b"])
    assert ray.get(lease.snapshot.remote())["holders"] == {"n1/cpu": ["a"]}    # b waits, holds nothing
    assert ray.get(lease.release.remote("a")) is True
    t1 = ray.get(second, timeout=30)
    assert t1 >= t0
    assert ray.get(lease.snapshot.remote())["holders"] == {"n1/cpu": ["b"]}
    ray.get(lease.release.remote("b"))
    assert ray.get(lease.concurrent.remote("a", 0.0, math.inf)) == 1
    assert ray.get(lease.concurrent.remote("b", 0.0, math.inf)) == 1


@pytest.mark.slow
def test_the_actor_cancels_a_stopped_waiter(lease):
    ray.get(lease.acquire.remote("a", ["n1/cpu"]))
    stopped = lease.acquire.remote("stopped", ["n1/cpu"])
    _wait_until_waiting(lease, ["stopped"])
    assert ray.get(lease.release.remote("stopped")) is False
    assert ray.get(stopped, timeout=30) is None
    assert ray.get(lease.snapshot.remote())["waiting"] == []


# Real 2-worker Train runs of the `tiny` model on 2 simulated GPUs under a search's lease: first
# one that trains its epoch and hands over (each rank destroys its process group and hands back on
# its own); then one in which rank 1 fails at its first epoch while rank 0 waits for it in the
# epoch's collective (until --collective-timeout-min). Prints the lease's record of the trials
# once the search's side ends the second.
RANK_FAILS_SCRIPT = textwrap.dedent("""
    import json, sys
    import ray
    from vidtune.datasets.config import DataConfig
    from vidtune.datasets.synthetic import generate
    from vidtune.trainer.cluster import worker
    from vidtune.trainer.training.config import TrainConfig
    from vidtune.trainer.cluster.build_trainer import build_torch_trainer
    from vidtune.trainer.ray_setup.launch import init_ray
    from vidtune.trainer.cluster.lease import LeaseSettings, start_lease

    def loop(config):
        real = worker.run_epoch

        def rank_1_fails(run, epoch):
            if run.rank == 1:
                raise RuntimeError("injected: rank 1 fails")
            return real(run, epoch)

        worker.run_epoch = rank_1_fails
        worker.train_loop_per_worker(config)

    if __name__ == "__main__":
        root = generate(sys.argv[1] + "/videos", videos=16, seed=0)
        init_ray(num_cpus=4, include_dashboard=False)
        lease = start_lease("lease-rank-fails")
        cfg = TrainConfig(data=DataConfig(root=str(root), loader_workers=0), model="tiny", precision="fp32",
                          epochs=1, batch_size=2, max_failures=0, collective_timeout_min=0.1)
        build_torch_trainer(cfg, num_workers=2, use_gpu=True, resources_per_worker={"CPU": 1, "GPU": 1},
                            name="hands-over", storage_path=sys.argv[1],
                            device_lease=LeaseSettings("lease-rank-fails", "t0")).fit()
        trainer = build_torch_trainer(cfg, num_workers=2, use_gpu=True, train_loop=loop,
                                      resources_per_worker={"CPU": 1, "GPU": 1}, name="rank-fails",
                                      storage_path=sys.argv[1],
                                      device_lease=LeaseSettings("lease-rank-fails", "t1"))
        try:
            trainer.fit()
        except Exception as e:
            print("fit failed:", type(e).__name__)
        ray.get(lease.end.remote("t1"))     # the search's side: Tune saw the trial end
        print("RECORD " + json.dumps(ray.get(lease.snapshot.remote())["record"]))
""")


@pytest.mark.slow
@pytest.mark.timeout(330)   # two Train runs
def test_one_ranks_error_leaves_the_devices_to_the_trials_end(tmp_path):
    """The other rank still holds its memory while it waits in a collective for the failed one:
    the failed rank frees what it can but gives back nothing; the trial's devices are given back
    when the search ends the trial (`end`, once every worker exited), never by a worker's error."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "VIDTUNE_SIMULATE_GPUS": "2"}
    env.pop("RAY_ADDRESS", None)
    script = tmp_path / "rank_fails.py"
    script.write_text(RANK_FAILS_SCRIPT)
    out = subprocess.run([sys.executable, str(script), str(tmp_path)], cwd=REPO_ROOT, env=env,
                         capture_output=True, text=True, timeout=320)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "fit failed" in out.stdout, out.stdout[-2000:]
    record = json.loads(out.stdout.split("RECORD ", 1)[1].splitlines()[0])
    # The run that trained: both ranks handed back (on simulated GPUs, 0 MB each), then the lease let go.
    assert [(e["device_mb"], e["ranks_mb"]) for e in record
            if e["owner"] == "t0" and e["event"] == "release"] == [(0.0, [0.0, 0.0])], record
    events = [e["event"] for e in record if e["owner"] == "t1"]   # the second rank's ask: a regrant
    assert events[0] == "grant" and events[-1] == "end" and "release" not in events, record
