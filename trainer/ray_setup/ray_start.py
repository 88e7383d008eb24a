"""Starting a local Ray on a machine that may be short of memory: a bounded wait, one line.

Ray sizes its shared object store from the machine's memory (30% of it), and every Ray worker
maps that store into its own address space beside Python and torch. Under an address-space
limit (`ulimit -v`, a batch system's memory cap) the workers cannot map it: the raylet dies and
`ray.init` waits forever, and Ray's agents outlive the killed driver by minutes. So a Ray that
vidtune starts gets an object store sized to the memory this process may use
(`--object-store-gb` overrides it), a limit too small for a Ray process that trains is refused
before Ray starts (`check_address_space`), and a start that fails or takes longer than
`--ray-start-timeout-s` ends the command with one line naming the cause and the flags (exit 1),
after killing every Ray process it had started.
"""
from __future__ import annotations

import contextlib
import math
import os
import resource
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil

from vidtune.errors import VidtuneError
from vidtune.flags import option
from vidtune.trainer.ray_setup.ray_reaper import kill_all, ray_processes_under, start_reaper

GB = 1e9
# Ray's smallest object store (ray_constants.OBJECT_STORE_MINIMUM_MEMORY_BYTES: 75 MiB)
MIN_OBJECT_STORE_BYTES = 75 * 1024 * 1024
STORE_SHARE = 0.3          # Ray's own default share of the memory
# Under an address-space limit each worker process maps the store beside its interpreter, torch
# and Ray: the store gets a quarter of the limit, and STORE_SHARE of that.
ADDRESS_SPACE_SHARE = 0.25
# Every Ray process that trains maps the training libraries (torch 2.14's CUDA build, torchvision,
# Ray: ~5.2 GB of address space, reserved rather than used), the object store, and its threads'
# stacks and malloc arenas (Ray and gRPC start dozens of threads). Measured under prlimit --as on
# a 2-core machine: at 7 GB a Train worker aborts when it cannot start a thread; at 8 GB it trains.
THREADS_HEADROOM_BYTES = int(2 * GB)


@dataclass(frozen=True)
class RayStart:
    """How a command starts Ray on this machine; not used when it joins a cluster (--address)."""

    object_store_gb: float | None = option(
        None, flag="--object-store-gb", metavar="GB", gt=0,
        help="memory for the Ray object store of a Ray started here (default: Ray's own, 30%% of the "
        "memory, or less when this process runs under an address-space limit such as ulimit -v)")
    start_timeout_s: float = option(
        120.0, flag="--ray-start-timeout-s", metavar="S", gt=0,
        help="give up on starting Ray here after this many seconds (a machine short of memory), "
        "ending with one line and leaving no Ray process behind")


class RayStartError(VidtuneError, RuntimeError):
    """Ray could not start here; the message names the cause and the flags to change."""


def address_space_limit() -> int | None:
    """This process's address-space limit in bytes (`ulimit -v`), None when unlimited."""
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    return None if soft in (resource.RLIM_INFINITY, -1) else int(soft)


def object_store_bytes(requested_gb: float | None) -> int | None:
    """The object store to ask Ray for: `requested_gb`; else, under an address-space limit, a
    share of what the limit leaves each worker; else None (Ray's own default)."""
    if requested_gb is not None:
        return max(MIN_OBJECT_STORE_BYTES, int(requested_gb * GB))
    limit = address_space_limit()
    if limit is None:
        return None
    usable = min(psutil.virtual_memory().available, int(limit * ADDRESS_SPACE_SHARE))
    return max(MIN_OBJECT_STORE_BYTES, int(usable * STORE_SHARE))


def memory_facts(store: int | None = None, *, with_store: bool = True) -> str:
    """'12.3 GB available, address space limited to 8.0 GB, object store 0.6 GB': for the message
    (`with_store`: the object store part too, `store` bytes or Ray's default)."""
    facts = [f"{psutil.virtual_memory().available / GB:.1f} GB of memory available"]
    limit = address_space_limit()
    if limit is not None:
        facts.append(f"address space limited to {limit / GB:.1f} GB (ulimit -v)")
    if with_store:
        facts.append(f"object store {store / GB:.2f} GB" if store else "object store: Ray's default")
    return ", ".join(facts)


def training_footprint_bytes() -> int:
    """The address space a process holds once the training libraries are loaded (bytes): this
    process's, after loading here what every Train worker loads: torch, torchvision and decord,
    through the Ray-free run (not the worker module itself, in a room above this one; Ray's core
    is loaded already by `trainer.ray_setup.launch.init_ray`, and Ray Train's own modules add
    little). An ImportError here is the limit already biting (`import_failure_message`)."""
    from vidtune.trainer.training import run  # noqa: F401  (heavy: torch, torchvision, decord)

    return int(psutil.Process().memory_info().vms)


def check_address_space(store: int | None) -> None:
    """Under an address-space limit (`ulimit -v`), refuse before Ray starts when a Ray process that
    trains would not fit in it: the libraries, the object store (`store` bytes) and the threads'
    headroom. Past that point Ray fails in ways no message can follow (a C++ abort of the driver, a
    worker that dies starting a thread, a raylet that never answers)."""
    limit = address_space_limit()
    if limit is None:
        return
    libraries = training_footprint_bytes()
    store = store or 0
    needed = libraries + store + THREADS_HEADROOM_BYTES
    if needed <= limit:
        return
    raise RayStartError(
        f"Ray could not start on this machine: the address space is limited to {limit / GB:.1f} GB "
        f"(ulimit -v), and each Ray process that trains here needs about {needed / GB:.1f} GB "
        f"({libraries / GB:.1f} GB of libraries, a {store / GB:.2f} GB object store, "
        f"{THREADS_HEADROOM_BYTES / GB:.0f} GB for its threads): raise the limit to at least "
        f"{math.ceil(needed / GB)} GB (ulimit -v {math.ceil(needed / GB) * int(GB) // 1024}), or lower "
        f"--object-store-gb")


def kill_started_ray() -> list[int]:
    """Kill (SIGKILL) every Ray process this process started, children of children included:
    the GCS, the raylet, the dashboard and its agents, the workers. Returns their pids. Best
    effort: on a machine out of memory even listing them can fail, and the error it is called
    for matters more than this one."""
    try:
        return kill_all(ray_processes_under(psutil.Process()))
    except (psutil.Error, OSError, MemoryError):
        return []


def import_failure_message(e: ImportError) -> str:
    """One line for a library (torch, Ray) that failed to load: under an address-space limit that
    is most often the limit (its shared objects cannot be mapped), so the memory seen is said."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()] or [type(e).__name__]
    limited = address_space_limit() is not None
    hint = ("give the command more memory (raise ulimit -v)" if limited
            else "reinstall vidtune's dependencies (pip install -c constraints.txt .)")
    return (f"could not load {_library_name(e)} ({type(e).__name__}: {lines[-1][:200]}; "
            f"{memory_facts(with_store=False)}): {hint}")


def _library_name(e: ImportError) -> str:
    """The installed package that failed to load: 'torch' for torch/_C.cpython-311-....so (whose
    `e.name` is only '_C'), else the module's name."""
    parts = Path(e.path).parts if e.path else ()
    if "site-packages" in parts and parts.index("site-packages") + 1 < len(parts):
        return parts[parts.index("site-packages") + 1]
    return e.name or "a library"


def failure_message(cause: str, options: RayStart, store: int | None) -> str:
    return (f"Ray could not start on this machine ({cause}; {memory_facts(store)}): give the command more "
            f"memory, or a smaller object store with --object-store-gb, or more time with "
            f"--ray-start-timeout-s (now {options.start_timeout_s:g} s)")


GCS_PORT_ENV = "RAY_GCS_SERVER_PORT"     # the port a head started by ray.init gives its GCS
ADDRESS_ENV = "RAY_ADDRESS"              # the Ray a Ray process (or a driver) looks up first


def free_port() -> int:
    """A TCP port free now (the kernel's choice); another process may take it before Ray binds it."""
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def own_cluster_env() -> Iterator[str]:
    """While Ray starts here: its GCS on a port chosen now, and RAY_ADDRESS naming it, so that
    every process ray.init spawns (GCS, raylet, dashboard; the raylet's workers inherit its
    environment) finds this Ray, not the machine's last `ray start`. ray.init(address="local")
    itself does not read RAY_ADDRESS. The driver's environment is restored afterwards (a later
    init in this process starts or joins as it is told). Yields the address (Ray reads
    127.0.0.1 as this node's own address)."""
    address = f"127.0.0.1:{free_port()}"
    saved = {name: os.environ.get(name) for name in (GCS_PORT_ENV, ADDRESS_ENV)}
    os.environ[GCS_PORT_ENV] = address.rsplit(":", 1)[1]
    os.environ[ADDRESS_ENV] = address
    try:
        yield address
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def start_local_ray(init: Callable[..., object], options: RayStart, **kw) -> None:
    """`init(address="local", **kw)` (ray.init of a Ray of this process's own) with an object
    store sized by `object_store_bytes`, bounded by `options.start_timeout_s`, after
    `check_address_space`. A start that raises becomes a RayStartError; one that hangs past the
    timeout prints the error line and ends the process (exit 1), since a hung ray.init cannot be
    interrupted. Either way the Ray processes it started are killed.

    "local": without it ray.init joins the Ray this machine's last `ray start` recorded
    (/tmp/ray/ray_current_cluster), someone else's or a dead one (then it waits for a GCS that
    never answers). Ray's own processes find their cluster the same way when they look it up
    (Train's placement-group cleaner asks the state API), so they are started with RAY_ADDRESS
    naming this Ray (its GCS on a port chosen here, `own_cluster_env`)."""
    store = object_store_bytes(options.object_store_gb)
    check_address_space(store)
    if store is not None:
        kw.setdefault("object_store_memory", store)
    kw["address"] = "local"
    done = threading.Event()

    def watchdog() -> None:
        if done.wait(options.start_timeout_s):
            return
        kill_started_ray()
        cause = f"not up after {options.start_timeout_s:g} s"
        print(f"vidtune: error: {failure_message(cause, options, store)}", file=sys.stderr, flush=True)
        os._exit(1)

    threading.Thread(target=watchdog, name="vidtune-ray-start-watchdog", daemon=True).start()
    try:
        with own_cluster_env():
            init(**kw)
    except KeyboardInterrupt:   # Ctrl-C while Ray starts: none of its processes stays behind
        kill_started_ray()
        raise
    except Exception as e:    # Ray raises many types here (RuntimeError, ConnectionError, OSError, ...)
        kill_started_ray()
        reason = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        raise RayStartError(failure_message(f"{type(e).__name__}: {reason[:200]}", options, store)) from None
    finally:
        done.set()
    start_reaper()   # its processes end with this one, even when it is killed (trainer.ray_setup.ray_reaper)
