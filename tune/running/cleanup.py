"""Release the resources of trials that Tune stops (ASHA, errors, Ctrl-C) or runs again.

Why this exists (measured on Ray 2.60, Train V2, 2 CPUs): when Tune stops a trial, it ends the
trial's actor; the Train controller and its workers die with it (they are owned by it), but the
workers' placement group is scoped to the *job* (the search process), not to the controller, so
it stays reserved. Ray Train leaves its removal to a detached `PlacementGroupCleaner` actor that
polls the State API; that poll is slow on a loaded machine, and it fails for good when it cannot
reach the dashboard (minimal install) or when two Ray instances run on one machine ("Found
multiple active Ray instances": the cleaner's thread dies on the ConnectionError). Then the next
trial's worker group waits for CPUs that never free up (`WorkerGroupStartupTimeoutError` every
60 s) and the search sits idle.

The fix: each trial's Train run records its placement group and its controller actor in a small
registry actor owned by the search process (`PlacementGroupRecorder`, a Train worker-group
callback running in the controller); when Tune completes, stops, fails or retries a trial,
`ReleaseTrialResources` (a Tune callback in the search process) ends that trial's controller
(its workers die with it) and removes its placement groups at once. A trial that finished
normally has already ended both (Train does that at the end of `fit()`), so this is a no-op there.
This being the whole cleanup, vidtune's trainer starts no `PlacementGroupCleaner`
(`trainer.cluster.torch_trainer`).

Ending the controller is what lets Tune reuse a trial driver's process for the next trial
(`reuse_actors`, which saves the ~3 s start of a Python process with Ray, Tune and torch per
trial): Tune hands a stopped trial's process on only once the trial's function has returned, and
an ASHA-stopped trial's function is still inside `TorchTrainer.fit()`, which would run its
remaining epochs (or, with its placement group removed, restart its worker group). With the
controller gone, `fit()` raises at once; the trial driver asks `was_released` and returns quietly.
"""
from __future__ import annotations

import logging
from typing import Any

import ray
from ray.actor import ActorHandle
from ray.tune import Callback
from ray.tune.experiment import Trial
from ray.util.placement_group import PlacementGroup, placement_group_table, remove_placement_group

# Train V2 has no public callback that sees the worker group: the private one is fenced there.
from vidtune.trainer.cluster.lease import on_this_node
from vidtune.tune.running.ray_internals import WorkerGroupCallback, worker_group_placement_group

log = logging.getLogger(__name__)


@ray.remote(num_cpus=0)
class _PlacementGroupRegistry:
    """trial id -> the placement groups (hex ids) and Train controller actors of its Train runs,
    the trials whose resources were released (they were stopped, failed or finished), and the
    errors trials raised by themselves (`tune.running.trial_retry`)."""

    def __init__(self) -> None:
        self._groups: dict[str, list[str]] = {}
        self._controllers: dict[str, list[ActorHandle]] = {}
        self._released: set[str] = set()
        self._own_errors: dict[str, str] = {}

    def note_own_error(self, trial_id: str, text: str) -> None:
        self._own_errors.setdefault(trial_id, text)

    def own_error(self, trial_id: str) -> str | None:
        return self._own_errors.get(trial_id)

    def add(self, trial_id: str, pg_hex: str, controller: ActorHandle | None = None) -> None:
        self._groups.setdefault(trial_id, []).append(pg_hex)
        if controller is not None:
            self._controllers.setdefault(trial_id, []).append(controller)

    def pop(self, trial_id: str, released: bool = True) -> tuple[list[str], list[ActorHandle]]:
        """(placement groups, controllers) of the trial, forgotten here; the trial counts as
        released unless `released` is False (its failed try's, before Tune runs it again)."""
        if released:
            self._released.add(trial_id)
        return self._groups.pop(trial_id, []), self._controllers.pop(trial_id, [])

    def pop_all(self) -> tuple[list[str], list[ActorHandle]]:
        groups = [pg for pgs in self._groups.values() for pg in pgs]
        controllers = [c for cs in self._controllers.values() for c in cs]
        self._released.update(self._groups, self._controllers)
        self._groups, self._controllers = {}, {}
        return groups, controllers

    def was_released(self, trial_id: str) -> bool:
        return trial_id in self._released


def start_registry(name: str):
    """Create the registry actor (owned by the calling process, so it dies with the search)."""
    return _PlacementGroupRegistry.options(name=name, get_if_exists=True,
                                           scheduling_strategy=on_this_node()).remote()


class PlacementGroupRecorder(WorkerGroupCallback):
    """Runs inside the Train controller: tells the registry which placement group the trial's
    worker group got, and which controller actor it runs in (itself: the handle from Ray's public
    runtime context). Passed in `RunConfig.callbacks` (Train appends non-user callbacks to the
    controller's own, as its PlacementGroupCleaner does)."""

    def __init__(self, registry_name: str, trial_id: str):
        self.registry_name = registry_name
        self.trial_id = trial_id

    def after_worker_group_start(self, worker_group: Any) -> None:
        try:
            pg = worker_group_placement_group(worker_group)
            registry = ray.get_actor(self.registry_name)
            controller = ray.get_runtime_context().current_actor
            ray.get(registry.add.remote(self.trial_id, pg.id.hex(), controller), timeout=30)
        except Exception as e:  # never fail a training run over bookkeeping
            log.warning("vidtune: could not record the placement group of trial %s: %s", self.trial_id, e)


def remove_placement_groups(pg_hexes: list[str]) -> int:
    """Remove those of the given placement groups that still exist; returns how many."""
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


def was_released(registry_name: str, trial_id: str) -> bool:
    """Whether the search already released the trial's resources (it was stopped or ended): asked
    by a trial driver whose `fit()` raised, to tell "my controller was ended because Tune stopped
    me" from a real failure. False when the registry cannot be asked."""
    try:
        return bool(ray.get(ray.get_actor(registry_name).was_released.remote(trial_id), timeout=30))
    except Exception:
        return False


def end_controllers(controllers: list[ActorHandle]) -> None:
    """Kill Train controller actors (their worker actors, which they own, die with them)."""
    for controller in controllers:
        try:
            ray.kill(controller, no_restart=True)
        except Exception as e:      # already gone: nothing to end
            log.debug("vidtune: controller already ended: %s", e)


def end_runs(groups: list[str], controllers: list[ActorHandle]) -> int:
    """End Train runs: their controllers first (so none restarts its worker group when the
    group's placement group goes), then the placement groups left. Returns how many groups
    were removed."""
    end_controllers(controllers)
    return remove_placement_groups(groups)


class ReleaseTrialResources(Callback):
    """Tune callback (search process): when a trial ends for any reason, end its Train run's
    controller, remove the placement groups it left behind and give back its device lease
    (`trainer.cluster.lease`; a worker killed while training never releases it itself; the lease waits
    for the killed workers to exit), so the next trial can start at once, in a fresh process or
    in this trial's (Tune's `reuse_actors`). When Tune runs a failed trial again (its process or
    node was lost), the failed try's controller and placement groups go first: a group whose
    node was lost would otherwise be rescheduled onto the nodes left and hold the resources the
    new try asks for."""

    def __init__(self, registry_name: str, lease_name: str | None = None):
        self.registry_name = registry_name
        self.lease_name = lease_name
        self.removed = 0

    def _end_runs(self, trial_id: str, *, released: bool) -> None:
        try:
            registry = ray.get_actor(self.registry_name)
            self.removed += end_runs(*ray.get(registry.pop.remote(trial_id, released), timeout=30))
        except Exception as e:
            log.warning("vidtune: could not release the resources of trial %s: %s", trial_id, e)

    def _release(self, trial_id: str) -> None:
        self._end_runs(trial_id, released=True)
        if self.lease_name:
            try:
                # Not waited for: the lease gives a trial's devices back once its workers, which
                # ending the controller kills asynchronously, have exited (`LeaseBook.end`).
                ray.get_actor(self.lease_name).end.remote(trial_id)
            except Exception as e:
                log.warning("vidtune: could not release the device lease of trial %s: %s", trial_id, e)

    def on_trial_complete(self, iteration: int, trials: list, trial: Trial, **info: Any) -> None:
        self._release(trial.trial_id)

    def on_trial_error(self, iteration: int, trials: list, trial: Trial, **info: Any) -> None:
        self._release(trial.trial_id)

    def on_trial_recover(self, iteration: int, trials: list, trial: Trial, **info: Any) -> None:
        # Not released: the new try's fit() failing must still count as its own failure
        # (`was_released`), and its device lease is the same trial's.
        self._end_runs(trial.trial_id, released=False)

    def on_experiment_end(self, trials: list, **info: Any) -> None:
        try:
            registry = ray.get_actor(self.registry_name)
            self.removed += end_runs(*ray.get(registry.pop_all.remote(), timeout=30))
        except Exception as e:
            log.warning("vidtune: could not release leftover placement groups: %s", e)


def live_placement_groups() -> list[str]:
    """Hex ids of placement groups that still hold (or wait for) resources."""
    return [pg for pg, info in placement_group_table().items()
            if info.get("state") in ("CREATED", "PENDING", "RESCHEDULING")]
