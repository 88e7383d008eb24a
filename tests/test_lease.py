"""The device lease (trainer.lease): one training at a time per device, first come first served,
all of a trial's devices at once, and an honest count of trainings that shared a device."""
from __future__ import annotations

import time

import pytest

pytestmark = pytest.mark.slow   # needs the shared Ray session


@pytest.fixture
def lease(ray_session, request):
    from trainer.lease import start_lease

    handle = start_lease(f"test-lease-{request.node.name}", capacity=1)
    yield handle
    ray_session.kill(handle)


def _granted(ref, timeout: float = 0.5) -> bool:
    import ray

    ready, _ = ray.wait([ref], timeout=timeout)
    return bool(ready)


def test_second_training_waits_until_the_first_releases(lease):
    import ray

    t0 = ray.get(lease.acquire.remote("a", ["n1/cpu"]))
    second = lease.acquire.remote("b", ["n1/cpu"])
    assert not _granted(second)                          # the device is busy
    assert ray.get(lease.snapshot.remote())["waiting"] == ["b"]
    time.sleep(0.2)
    assert ray.get(lease.release.remote("a")) is True
    t1 = ray.get(second, timeout=10)
    assert t1 > t0
    # each had the device to itself: never two trainings at once
    assert ray.get(lease.concurrent.remote("a", t0 - 1, time.time())) == 1
    assert ray.get(lease.concurrent.remote("b", t0 - 1, time.time())) == 1
    ray.get(lease.release.remote("b"))


def test_other_devices_do_not_wait_and_a_trial_takes_all_its_devices_at_once(lease):
    import ray

    ray.get(lease.acquire.remote("a", ["n1/gpu:0"]))
    assert _granted(lease.acquire.remote("b", ["n1/gpu:1"]))          # another GPU: at once
    both = lease.acquire.remote("c", ["n1/gpu:0", "n1/gpu:1"])       # needs both: waits for a and b
    ray.get(lease.release.remote("a"))
    assert not _granted(both)                                        # holds neither while waiting
    assert "n1/gpu:0" not in ray.get(lease.snapshot.remote())["holders"]
    ray.get(lease.release.remote("b"))
    ray.get(both, timeout=10)
    assert ray.get(lease.snapshot.remote())["holders"] == {"n1/gpu:0": ["c"], "n1/gpu:1": ["c"]}


def test_first_come_first_served(lease):
    import ray

    ray.get(lease.acquire.remote("a", ["n1/cpu"]))
    b = lease.acquire.remote("b", ["n1/cpu"])
    time.sleep(0.3)
    c = lease.acquire.remote("c", ["n1/cpu"])
    time.sleep(0.3)
    ray.get(lease.release.remote("a"))
    ray.get(b, timeout=10)
    assert not _granted(c)
    ray.get(lease.release.remote("b"))
    ray.get(c, timeout=10)


def test_every_worker_of_a_trial_gets_the_grant_of_its_first_request(lease):
    import ray

    ray.get(lease.acquire.remote("a", ["n1/gpu:0"]))
    rank0 = lease.acquire.remote("t", ["n1/gpu:0", "n1/gpu:1"])
    rank1 = lease.acquire.remote("t", ["n1/gpu:0", "n1/gpu:1"])
    assert not _granted(rank1)
    ray.get(lease.release.remote("a"))
    ray.get([rank0, rank1], timeout=10)
    assert ray.get(lease.snapshot.remote())["holders"]["n1/gpu:1"] == ["t"]


def test_packed_trials_are_counted_as_sharing(ray_session):
    import ray

    from trainer.lease import start_lease

    packed = start_lease("test-lease-packed", capacity=2)
    try:
        t0 = ray.get(packed.acquire.remote("a", ["n1/gpu:0"]))
        ray.get(packed.acquire.remote("b", ["n1/gpu:0"]), timeout=10)   # capacity 2: no wait
        time.sleep(0.1)
        assert ray.get(packed.concurrent.remote("a", t0, time.time())) == 2
        ray.get(packed.release.remote("b"))
        mid = time.time()
        time.sleep(0.1)
        assert ray.get(packed.concurrent.remote("a", mid, time.time())) == 1   # alone again
    finally:
        ray.kill(packed)


def test_a_trial_stopped_while_waiting_leaves_the_queue(lease):
    import ray

    ray.get(lease.acquire.remote("a", ["n1/cpu"]))
    stopped = lease.acquire.remote("stopped", ["n1/cpu"])
    waiting = lease.acquire.remote("next", ["n1/cpu"])
    time.sleep(0.3)
    assert ray.get(lease.release.remote("stopped")) is False       # held nothing, but leaves the queue
    assert ray.get(stopped, timeout=10) is None                     # and is never granted
    ray.get(lease.release.remote("a"))
    ray.get(waiting, timeout=10)
    assert ray.get(lease.snapshot.remote())["holders"] == {"n1/cpu": ["next"]}
