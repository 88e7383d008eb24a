"""tune.running.cleanup: the search's own release of its trials' Train runs (Ray's PlacementGroupCleaner is
not started: trainer.cluster.torch_trainer), on the session's Ray with a real registry, placement group
and actor standing in for a trial's Train controller."""
from __future__ import annotations

import time
from types import SimpleNamespace

import pytest


def _wait_until(check, wait_s: float = 30) -> bool:
    deadline = time.monotonic() + wait_s
    while not check() and time.monotonic() < deadline:
        time.sleep(0.2)
    return check()


@pytest.mark.slow
def test_a_retried_trials_failed_try_is_ended_and_the_trial_is_not_counted_released(ray_session):
    ray = ray_session
    from ray.util.placement_group import placement_group, placement_group_table

    from vidtune.tune.running.cleanup import ReleaseTrialResources, start_registry, was_released

    @ray.remote(num_cpus=0)
    class Controller:
        def ping(self) -> bool:
            return True

    registry = start_registry("vt-cleanup-test")
    release = ReleaseTrialResources("vt-cleanup-test")
    trial = SimpleNamespace(trial_id="t1")

    def try_of_trial() -> tuple[str, object]:
        """A Train run of trial t1 as the PlacementGroupRecorder registers it."""
        pg, controller = placement_group([{"CPU": 0.1}]), Controller.remote()
        assert pg.wait(30) and ray.get(controller.ping.remote(), timeout=30)
        ray.get(registry.add.remote("t1", pg.id.hex(), controller))
        return pg.id.hex(), controller

    def gone(pg_hex: str) -> bool:
        return placement_group_table().get(pg_hex, {}).get("state") == "REMOVED"

    def dead(actor) -> bool:
        try:
            ray.get(actor.ping.remote(), timeout=10)
            return False
        except ray.exceptions.RayActorError:
            return True

    try:
        # Tune runs the trial again (its process or node was lost): the failed try's placement
        # group and controller end, and the trial is still not "released" (its new try's own
        # failure must count).
        first_pg, first_controller = try_of_trial()
        release.on_trial_recover(0, [], trial)
        assert gone(first_pg) and _wait_until(lambda: dead(first_controller))
        assert release.removed == 1
        assert not was_released("vt-cleanup-test", "t1")

        # The new try's run ends with the trial: now it counts as released.
        second_pg, second_controller = try_of_trial()
        release.on_trial_complete(0, [], trial)
        assert gone(second_pg) and _wait_until(lambda: dead(second_controller))
        assert release.removed == 2 and was_released("vt-cleanup-test", "t1")
    finally:
        ray.kill(registry)
