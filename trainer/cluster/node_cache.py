"""The clip cache filled on every node that trains, before the first trial.

The driver fills its own node's cache (`tune.runner.fill_clip_cache`). On a cluster, each other
node's trials read that node's cache, which its first trial would fill during its first epoch:
that epoch is then bound by decoding (and with several trials or DDP ranks on one node, each
decodes the same videos). Here a task pinned to each such node decodes every video there at
once, all nodes side by side, with a line per node as it finishes. A node the autoscaler starts
later is filled by its first trial's workers before they train (`trainer.cluster.node_setup`).
"""
from __future__ import annotations

import hashlib
import sys

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from vidtune.datasets.cache import FrameCache
from vidtune.datasets.cache_fill import fill_cache
from vidtune.datasets.config import DataConfig
from vidtune.datasets.records import VideoInfo

if sys.platform != "win32":   # POSIX file locks; on Windows two fills of a node may overlap (time only)
    import fcntl

FILLS_FOLDER = ".node-fills"   # in the cache root: the fill's lock file and its markers
WAIT_S = 3600.0   # a large dataset on a slow disk; a node that takes longer is left to its first trial


def fill_this_node(data: DataConfig, videos: list[VideoInfo], height: int, width: int, on_gpu: bool,
                   *, once: bool = False) -> str:
    """Run on a node: decode `videos` into this node's clip cache (its path as `data` resolves it
    there); the fill's summary. One process of a node fills at a time (a lock file in the cache),
    and a fill leaves a marker of its videos, size and format there: with `once`, a marker
    found means the fill is done ("" returned, nothing read), as when a worker checks its node
    (`trainer.cluster.node_setup`)."""
    cache = FrameCache.from_config(data, on_gpu=on_gpu)
    if cache is None:
        return "no clip cache"
    folder = cache.root / FILLS_FOLDER
    try:
        folder.mkdir(parents=True, exist_ok=True)
        lock = open(folder / "lock", "a")   # noqa: SIM115 (held across the fill, closed below)
    except OSError:   # an unwritable cache: the fill says so in its summary
        return fill_cache(videos, height=height, width=width, cache=cache).summary(cache)
    marker = folder / fill_key(videos, height, width, cache.format)
    try:
        if sys.platform != "win32":
            fcntl.flock(lock, fcntl.LOCK_EX)
        if once and marker.exists():
            return ""
        summary = fill_cache(videos, height=height, width=width, cache=cache).summary(cache)
        marker.touch()
        return summary
    finally:
        lock.close()   # releases the lock


def fill_key(videos: list[VideoInfo], height: int, width: int, fmt: str) -> str:
    """The name of a fill's marker: a digest of its videos' paths, the size and the format."""
    digest = hashlib.sha256("\n".join(sorted(str(v.path) for v in videos)).encode())
    digest.update(f"{height}x{width}:{fmt}".encode())
    return f"filled-{digest.hexdigest()[:20]}"


def training_nodes(on_gpu: bool, skip: str | None) -> list[dict]:
    """The alive nodes trials can train on (with GPUs when `on_gpu`, else with CPUs), but `skip`."""
    kind = "GPU" if on_gpu else "CPU"
    return [n for n in ray.nodes() if n.get("Alive") and n["NodeID"] != skip
            and float((n.get("Resources") or {}).get(kind, 0.0)) > 0]


def this_node_trains(on_gpu: bool) -> bool:
    """Whether this process's node is one of `training_nodes` (False on a head started without
    the GPUs, or the CPUs, trials train on: `ray start --head --num-cpus 0`)."""
    me = ray.get_runtime_context().get_node_id()
    return any(n["NodeID"] == me for n in training_nodes(on_gpu, skip=None))


def fill_every_node(data: DataConfig, videos: list[VideoInfo], *, height: int, width: int, on_gpu: bool,
                    skip: str | None) -> dict[str, str]:
    """Fill the clip cache of every training node but `skip` (the driver's, filled already), all
    at once; node address -> its fill's summary, or why it was not filled. Never raises: a node
    whose fill fails is filled by its first trial's workers before they train
    (`trainer.cluster.node_setup`), or during their first epoch if that fails too."""
    nodes = training_nodes(on_gpu, skip)
    if not nodes or not videos:
        return {}
    print(f"clip cache: filling it on {len(nodes)} other node(s) before the first trial "
          f"({len(videos)} videos each)", flush=True)
    task = ray.remote(num_cpus=0, max_retries=0)(fill_this_node)
    pending = {task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False))
               .remote(data, videos, height, width, on_gpu): n.get("NodeManagerAddress", n["NodeID"])
               for n in nodes}
    done: dict[str, str] = {}
    while pending:
        ready, _ = ray.wait(list(pending), num_returns=1, timeout=WAIT_S)
        if not ready:   # the rest fill on first read
            for ref, address in pending.items():
                ray.cancel(ref, force=True)
                done[address] = f"not filled within {WAIT_S:.0f} s; its first trial fills it"
                print(f"clip cache on node {address}: {done[address]}", flush=True)
            break
        address = pending.pop(ready[0])
        try:
            done[address] = ray.get(ready[0])
        except ray.exceptions.RayError as e:
            reason = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
            done[address] = f"not filled ({reason[:200]}); its first trial fills it"
        print(f"clip cache on node {address}: {done[address]}", flush=True)
    return done
