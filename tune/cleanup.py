"""Release the resources of trials that Tune stops (ASHA, errors, Ctrl-C).

Why this exists (measured on Ray 2.60, Train V2, 2 CPUs): when Tune stops a trial, it ends the
trial's actor; the Train controller and its workers die with it (they are owned by it), but the
workers' placement group is scoped to the *job* (the search process), not to the controller, so
it stays reserved. Ray Train leaves its removal to a detached `PlacementGroupCleaner` actor that
polls the State API; that poll is slow on a loaded machine, and it fails for good when it cannot
reach the dashboard (minimal install) or when two Ray instances run on one machine ("Found
multiple active Ray instances": the cleaner's thread dies on the ConnectionError). Then the next
trial's worker group waits for CPUs that never free up (`WorkerGroupStartupTimeoutError` every
60 s) and the search sits idle.

The fix: each trial's Train run records its placement group in a small registry actor owned by
the search process (`PlacementGroupRecorder`, a Train worker-group callback running in the
controller); when Tune completes, stops or fails a trial, `ReleaseTrialResources` (a Tune
callback in the search process) removes that trial's placement groups at once, which also ends
any worker still running in them. A trial that finished normally has already removed its own
group (Train does that at the end of `fit()`), so this is a no-op there.
"""
from __future__ import annotations

import logging
from typing import Any

import ray
from ray.tune import Callback

# Train V2 has no public callback that sees the worker group: the private one is fenced there.
from tune.ray_internals import WorkerGroupCallback, worker_group_placement_group

log = logging.getLogger(__name__)


@ray.remote(num_cpus=0)
class _PlacementGroupRegistry:
    """trial id -> hex ids of the placement groups its Train runs created."""

    def __init__(self) -> None:
        self._groups: dict[str, list[str]] = {}

    def add(self, trial_id: str, pg_hex: str) -> None:
        self._groups.setdefault(trial_id, []).append(pg_hex)

    def pop(self, trial_id: str) -> list[str]:
        return self._groups.pop(trial_id, [])

    def pop_all(self) -> dict[str, list[str]]:
        groups, self._groups = self._groups, {}
        return groups


def start_registry(name: str):
    """Create the registry actor (owned by the calling process, so it dies with the search)."""
    return _PlacementGroupRegistry.options(name=name, get_if_exists=True).remote()


class PlacementGroupRecorder(WorkerGroupCallback):
    """Runs inside the Train controller: tells the registry which placement group the trial's
    worker group got. Passed in `RunConfig.callbacks` (Train appends non-user callbacks to the
    controller's own, as its PlacementGroupCleaner does)."""

    def __init__(self, registry_name: str, trial_id: str):
        self.registry_name = registry_name
        self.trial_id = trial_id

    def after_worker_group_start(self, worker_group: Any) -> None:
        try:
            pg = worker_group_placement_group(worker_group)
            registry = ray.get_actor(self.registry_name)
            ray.get(registry.add.remote(self.trial_id, pg.id.hex()), timeout=30)
        except Exception as e:  # never fail a training run over bookkeeping
            log.warning("vidtune: could not record the placement group of trial %s: %s", self.trial_id, e)


def remove_placement_groups(pg_hexes: list[str]) -> int:
    """Remove those of the given placement groups that still exist; returns how many."""
    from ray.util.placement_group import PlacementGroup, placement_group_table, remove_placement_group

    removed = 0
    table = placement_group_table()
    for pg_hex in pg_hexes:
        state = table.get(pg_hex, {}).get("state")
        if state in (None, "REMOVED"):
            continue
        try:
            remove_placement_group(PlacementGroup(ray.PlacementGroupID(bytes.fromhex(pg_hex))))
            removed += 1
        except Exception as e:
            log.warning("vidtune: could not remove placement group %s: %s", pg_hex, e)
    return removed


class ReleaseTrialResources(Callback):
    """Tune callback (search process): when a trial ends for any reason, remove the placement
    groups its Train run left behind and give back its device lease (`trainer.lease`; a worker
    killed while training never releases it itself), so the next trial can start at once."""

    def __init__(self, registry_name: str, lease_name: str | None = None):
        self.registry_name = registry_name
        self.lease_name = lease_name
        self.removed = 0

    def _release(self, trial_id: str) -> None:
        if self.lease_name:
            try:
                ray.get(ray.get_actor(self.lease_name).release.remote(trial_id), timeout=30)
            except Exception as e:
                log.warning("vidtune: could not release the device lease of trial %s: %s", trial_id, e)
        try:
            registry = ray.get_actor(self.registry_name)
            self.removed += remove_placement_groups(ray.get(registry.pop.remote(trial_id), timeout=30))
        except Exception as e:
            log.warning("vidtune: could not release the resources of trial %s: %s", trial_id, e)

    def on_trial_complete(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        self._release(trial.trial_id)

    def on_trial_error(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        self._release(trial.trial_id)

    def on_experiment_end(self, trials: list, **info: Any) -> None:
        try:
            registry = ray.get_actor(self.registry_name)
            leftovers = ray.get(registry.pop_all.remote(), timeout=30)
            self.removed += remove_placement_groups([h for hs in leftovers.values() for h in hs])
        except Exception as e:
            log.warning("vidtune: could not release leftover placement groups: %s", e)


def live_placement_groups() -> list[str]:
    """Hex ids of placement groups that still hold (or wait for) resources."""
    from ray.util.placement_group import placement_group_table

    return [pg for pg, info in placement_group_table().items() if info.get("state") in ("CREATED", "PENDING", "RESCHEDULING")]
