"""The device lease: at most `capacity` trainings at a time on one device (a GPU, or a node's CPU).

Why: a trial's speed figure (clips/s) means something only when the trial had its device to
itself. Measured on 2 cores: one trial's clips/s went from 26.5 to 39.6 the moment the other
trial ended. And why not simply let Ray's resource accounting keep trials apart: Ray would then
also keep the *next* trial from starting (its driver, Train controller and worker group take
~12 s) until the current one has finished. With the lease, Ray may place the next trial while
the current one trains; the next trial builds its data and model, then waits here for the
device, and that wait is outside its epoch times. The finished trial releases the lease as soon
as its last epoch is scored, so its checkpoint and teardown overlap the next one's training.

One named actor per search (`start_lease`, owned by the search process, so it dies with it).
Trials are the owners; a device is a key `"<node id>/gpu:<physical id>"` or `"<node id>/cpu"`
(the physical id, never a position in `CUDA_VISIBLE_DEVICES`: `device_keys`).
A trial asks for all the keys of its workers in one `acquire` (so two multi-worker trials can
never each hold half of what the other needs), granted first come, first served. The actor keeps
every holding interval, so each epoch can report how many trainings shared its device
(`concurrent_trainings`) from what was granted, not from what was intended.

Free, then hand over: a worker gives its devices back only after it has freed what it held there
(`trainer.cluster.worker`), and says how much device memory it still holds when it asks and when it gives
back (NVML's count for its process: `trainer.training.device_memory.process_device_mb`); each rank
hands back on its own, and the trial's devices go back once every rank has (`hand_back`); a trial
the search ends while it trains (ASHA, an error) keeps its devices until its worker processes
have exited. Each grant, release and end is in `record`, with that memory, in order:
the search writes it to `device_lease.json` beside its log.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

LEASE_CONFIG_KEY = "device_lease"     # key of the lease settings in a worker's train_loop_config
LEAD, FOLLOW = "lead", "follow"       # a trial's GPU role (LeaseBook.take_role)


class LeaseBook:
    """The lease's bookkeeping as a plain asyncio class; `DeviceLease` is it as a Ray actor.
    `capacity`: trainings at once per key; keys ending in `/cpu` use `cpu_capacity` (the CPU of
    a node is one device). `clock`: the time (unix s) of grants and releases, `time.time` unless
    given (tests pass a fake one)."""

    def __init__(self, capacity: int = 1, cpu_capacity: int = 1,
                 clock: Callable[[], float] | None = None, lead_slots: int = 0,
                 exited: Callable[[Any], Awaitable[bool]] | None = None, exit_wait_s: float = 60.0) -> None:
        self.capacity, self.cpu_capacity = int(capacity), int(cpu_capacity)
        self.clock = clock or time.time
        # `exited(worker)`: whether a worker (a Ray actor handle; tests pass their own) is gone.
        self.exited = exited or actor_exited
        self.exit_wait_s = float(exit_wait_s)   # `end` waits at most this long for a trial's workers
        self.workers: dict[str, list[Any]] = {}  # owner -> the workers that asked for its devices
        self.record: list[dict[str, Any]] = []   # every grant, release and end, in order (`_note`)
        self.lead_slots = int(lead_slots)        # GPUs a lead trial can have to itself (see take_role)
        self.leads: set[str] = set()             # owners given the lead role, until their trial ends
        self.holders: dict[str, set[str]] = {}                 # key -> owners holding it now
        self.held: dict[str, tuple[str, ...]] = {}             # owner -> keys it holds
        self.queue: list[tuple[str, tuple[str, ...]]] = []     # waiting (owner, keys), arrival order
        self.cancelled: set[str] = set()                       # released while waiting: never granted
        self.intervals: list[tuple[str, tuple[str, ...], float, float | None]] = []  # owner, keys, start, end
        self.handed: dict[str, dict[int, float | None]] = {}  # owner -> rank -> MiB, ranks handed back so far
        self._changed: asyncio.Condition | None = None

    def _cap(self, key: str) -> int:
        return self.cpu_capacity if key.endswith("/cpu") else self.capacity

    def _grantable(self, owner: str, keys: tuple[str, ...]) -> bool:
        if any(len(self.holders.get(k, ())) >= self._cap(k) for k in keys):
            return False
        for waiting, wkeys in self.queue:       # first come, first served on shared devices
            if waiting == owner:
                return True
            if set(wkeys) & set(keys):
                return False
        return True

    def _note(self, event: str, owner: str, keys: Sequence[str], device_mb: float | None) -> None:
        """One line of `record`: what happened, to whom, on which devices, and the device memory
        (MiB) the owner's worker said it held at that moment (None: not said)."""
        self.record.append({"time": self.clock(), "event": event, "owner": owner, "keys": list(keys),
                            "device_mb": device_mb})

    async def acquire(self, owner: str, keys: Sequence[str], device_mb: float | None = None,
                      worker: Any = None) -> float | None:
        """Wait until every key has room, then hold them all. Returns the grant time (unix s), or
        None when the owner was released while it waited (its trial was stopped).
        `device_mb`: the device memory the asking worker holds (for `record`); `worker`: its
        handle, so that `end` can wait for it to exit.
        An owner that already holds the same keys gets them again at once (its worker group
        restarted on the same devices, after its old workers died); one whose restarted group
        landed on other devices gives the old ones back and queues for the new ones."""
        if self._changed is None:
            self._changed = asyncio.Condition()
        keys = tuple(sorted(set(keys)))
        if worker is not None:
            self.workers.setdefault(owner, []).append(worker)
        if owner in self.held:
            if self.held[owner] == keys:
                self._note("regrant", owner, keys, device_mb)
                return self.clock()
            await self.release(owner, event="moved")
        if any(o == owner for o, _ in self.queue):
            # Another worker of the same trial asked first (every rank asks for all the trial's
            # devices, so no rank has to sit in a collective while the device is busy).
            async with self._changed:
                await self._changed.wait_for(lambda: owner in self.held or
                                             not any(o == owner for o, _ in self.queue))
            return self.clock() if owner in self.held else None
        self.cancelled.discard(owner)
        self.queue.append((owner, keys))
        async with self._changed:
            try:
                await self._changed.wait_for(lambda: owner in self.cancelled or self._grantable(owner, keys))
            finally:
                self.queue = [(o, k) for o, k in self.queue if o != owner]
            if owner in self.cancelled:
                self.cancelled.discard(owner)
                self._changed.notify_all()
                return None
            now = self.clock()
            for k in keys:
                self.holders.setdefault(k, set()).add(owner)
            self.held[owner] = keys
            self.intervals.append((owner, keys, now, None))
            self._note("grant", owner, keys, device_mb)
            self._changed.notify_all()
            return now

    async def release(self, owner: str, device_mb: float | None = None, event: str = "release") -> bool:
        """Give back what `owner` holds (a no-op when it holds nothing). True when it held any.
        `device_mb`: the device memory its workers still hold, once they freed what they could."""
        keys = self.held.pop(owner, None)
        if any(o == owner for o, _ in self.queue):    # a trial stopped while waiting: never grant it
            self.cancelled.add(owner)
            self.queue = [(o, k) for o, k in self.queue if o != owner]
        if keys is None:
            if self._changed is not None:
                async with self._changed:
                    self._changed.notify_all()
            return False
        now = self.clock()
        for k in keys:
            self.holders.get(k, set()).discard(owner)
        self.intervals = [(o, k, s, now if o == owner and e is None else e) for o, k, s, e in self.intervals]
        self._note(event, owner, keys, device_mb)
        if self._changed is not None:
            async with self._changed:
                self._changed.notify_all()
        return True

    async def hand_back(self, owner: str, rank: int, ranks: int, device_mb: float | None = None) -> bool:
        """Rank `rank` of the owner's `ranks` has freed what it could and gives its devices back,
        still holding `device_mb` there. The owner's devices go back (`release`) once every rank
        has: the record's `device_mb` is the most any rank still held, and `ranks_mb` each one's.
        True when this call released them."""
        got = self.handed.setdefault(owner, {})
        got[int(rank)] = device_mb
        if len(got) < ranks:
            return False
        del self.handed[owner]
        said = [mb for mb in got.values() if mb is not None]
        released = await self.release(owner, max(said) if said else None)
        if released:
            self.record[-1]["ranks_mb"] = [got[r] for r in sorted(got)]
        return released

    def take_role(self, owner: str) -> str:
        """`LEAD` while fewer than `lead_slots` trials hold that role, else `FOLLOW` (the same
        answer again to an owner that already leads). See `tune.running.trial.TrialResources`: a lead
        asks Ray for more than half a GPU, so no two leads share one, and as long as a GPU has
        no lead, new trials lead and Ray places them there; only when every GPU has its lead
        does a trial follow, onto the share a lead leaves."""
        if owner in self.leads or len(self.leads) < self.lead_slots:
            self.leads.add(owner)
            return LEAD
        return FOLLOW

    async def end(self, owner: str) -> bool:
        """The owner's trial ended (Tune saw it complete, fail or stop): give back its devices and
        its role. A worker gives back its devices itself after its last epoch (`release`); the
        role stays until here, while the trial's Ray resources are still held. A trial ended while
        it held its devices (stopped, failed, killed) gives them back only once its workers have
        exited (at most `exit_wait_s`): until then their memory is still on the device."""
        self.leads.discard(owner)
        self.handed.pop(owner, None)
        workers = self.workers.pop(owner, [])
        if owner not in self.held:
            return await self.release(owner)
        deadline = time.monotonic() + self.exit_wait_s
        alive = list(workers)
        while alive and time.monotonic() < deadline:
            alive = [w for w in alive if not await self.exited(w)]
            if alive:
                await asyncio.sleep(0.2)
        return await self.release(owner, event="end" if not alive else "end (workers still running)")

    def concurrent(self, owner: str, since: float, until: float) -> int:
        """Most trainings holding any of `owner`'s devices at one moment within [since, until],
        `owner` included (1 = it had its devices to itself; 0 = it held none then)."""
        mine = {k for o, keys, _, _ in self.intervals if o == owner for k in keys}
        events: list[tuple[float, int]] = []
        for _, keys, start, end in self.intervals:
            if not mine & set(keys):
                continue
            lo, hi = max(start, since), min(end if end is not None else until, until)
            if lo < hi:
                events += [(lo, 1), (hi, -1)]
        most = now = 0
        for _, step in sorted(events, key=lambda e: (e[0], e[1])):   # an end before a start at a tie
            now += step
            most = max(most, now)
        return most

    def snapshot(self) -> dict[str, Any]:
        """Who holds what and who waits (for tests and debugging), and the `record`."""
        return {"holders": {k: sorted(v) for k, v in self.holders.items() if v},
                "waiting": [o for o, _ in self.queue], "intervals": list(self.intervals),
                "record": list(self.record)}


async def actor_exited(worker: Any) -> bool:
    """Whether the Ray actor `worker` is dead (its process exited): its built-in `__ray_ready__`
    call fails then. One that does not answer within 2 s (busy) counts as alive."""
    try:
        await asyncio.wait_for(worker.__ray_ready__.remote(), timeout=2)
    except TimeoutError:
        return False
    except ray.exceptions.RayError:
        return True
    return False


# The lease actor: one per search (`start_lease`); methods as LeaseBook's, called with `.remote`.
DeviceLease = ray.remote(num_cpus=0, max_concurrency=1000)(LeaseBook)


def on_this_node() -> NodeAffinitySchedulingStrategy:
    """Where a search's own actors (the lease, tune.running.cleanup's registry) go: the search process's
    node. A zero-CPU actor may otherwise land on any node, and a reclaimed spot node would take
    the whole search's bookkeeping with it."""
    return NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)


def start_lease(name: str, *, capacity: int = 1, cpu_capacity: int = 1, lead_slots: int = 0):
    """Create the search's lease actor (owned by the caller: it ends with the search process).
    `lead_slots`: GPUs the search may use at once, one lead trial each (0: no roles, CPU)."""
    return DeviceLease.options(name=name, get_if_exists=True, scheduling_strategy=on_this_node()).remote(
        capacity, cpu_capacity, lead_slots=lead_slots)


def physical_gpu_ids() -> list[str]:
    """The physical ids (on this worker's node) of the GPUs Ray gave this worker; [] for none.
    Here rather than in `trainer.cluster.devices`, which imports torch: the lease actor needs none."""
    ids = ray.get_runtime_context().get_accelerator_ids().get("GPU") or []
    return [str(i) for i in ids]


def device_keys(device: Any) -> list[str]:
    """This worker's devices as lease keys: `<node>/gpu:<physical id>` for each GPU Ray gave it
    (`physical_gpu_ids`: two trials sharing a GPU see the same id, and a trial's
    ranks their own ones; simulated GPUs too), else `<node>/cpu`. `device`: the torch device it
    trains on (only its type is read, for the CPU case)."""
    node = ray.get_runtime_context().get_node_id()
    gpu_ids = physical_gpu_ids()
    if gpu_ids:
        return [f"{node}/gpu:{gpu}" for gpu in gpu_ids]
    return [f"{node}/{getattr(device, 'type', str(device))}"]


@dataclass
class LeaseSettings:
    """What a trial's workers need to find the lease: the actor's name and the owner (trial id)."""

    name: str
    owner: str

    def to_dict(self) -> dict[str, str]:
        return {"name": self.name, "owner": self.owner}

    @classmethod
    def from_dict(cls, d: dict[str, str] | None) -> LeaseSettings | None:
        return cls(**d) if d else None


class TrainingSlot:
    """A worker's side of the lease. Every rank of a trial asks for the devices of all its ranks
    (the caller gathers them first); the first request queues, the others wait for its grant.
    Without settings (a standalone training run) it holds nothing and knows
    nothing about other processes: `concurrent` is then NaN, not a guess."""

    def __init__(self, settings: LeaseSettings | None):
        self.settings = settings
        self._actor = ray.get_actor(settings.name) if settings else None
        self.held = False
        self.wait_s = 0.0           # time spent waiting for the devices

    def acquire(self, keys: Sequence[str], device_mb: float | None = None) -> None:
        """Wait for the devices `keys`; `device_mb`: the device memory this worker holds now
        (for the lease's record: a worker that waits holds none there)."""
        if self._actor is None or self.held:
            return
        asked = time.time()
        granted = ray.get(self._actor.acquire.remote(self.settings.owner, list(keys), device_mb,
                                                     _this_actor()))
        if granted is None:
            raise RuntimeError(f"trial {self.settings.owner} was ended by the search while it waited for "
                               "its device")
        self.wait_s, self.held = max(0.0, granted - asked), True

    def release(self, device_mb: float | None = None) -> None:
        """Give the devices back; `device_mb`: the device memory the trial's workers still hold,
        measured after they freed what they could (the caller frees first)."""
        if self._actor is not None and self.held:
            self.held = False
            try:
                ray.get(self._actor.release.remote(self.settings.owner, device_mb), timeout=30)
            except Exception:   # the search ends the lease for this trial too (tune.running.cleanup)
                pass

    def hand_back(self, rank: int, ranks: int, device_mb: float | None = None) -> None:
        """This rank (of `ranks`) gives the devices back, still holding `device_mb` there, measured
        after it freed what it could: the lease lets them go once every rank has (`LeaseBook.hand_back`),
        so no rank needs a collective for it (the process group may be gone by then)."""
        if self._actor is not None and self.held:
            self.held = False
            try:
                ray.get(self._actor.hand_back.remote(self.settings.owner, rank, ranks, device_mb), timeout=30)
            except Exception:   # the search ends the lease for this trial too (tune.running.cleanup)
                pass

    def concurrent(self, since: float, until: float) -> float:
        if self._actor is None:
            return float("nan")
        return float(ray.get(self._actor.concurrent.remote(self.settings.owner, since, until), timeout=30))


def _this_actor() -> Any:
    """This worker's actor handle (a Ray Train worker is an actor), or None outside an actor."""
    try:
        return ray.get_runtime_context().current_actor
    except RuntimeError:
        return None
