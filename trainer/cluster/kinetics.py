"""`--weights kinetics` on a cluster: torchvision's Kinetics-400 file, fetched once on the driver
(`trainer.models.registry.fetch_kinetics`, before Ray starts), copied into the torch hub cache of every
node that lacks it, so that no trial's worker downloads it (every worker of every trial did, each
into its own node's cache, failing twice on an offline node).

The copy goes through Ray's object store: one `ray.put` of the file's bytes, one small task
pinned to each node that writes them to a temporary file and renames it into place. A node the
autoscaler starts later gets its copy from its first trial's workers, before they build the model
(`trainer.cluster.node_setup`).
"""
from __future__ import annotations

import os
from pathlib import Path

import ray
import torch.hub
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from vidtune.flags import ConfigError
from vidtune.trainer.models.registry import kinetics_file


def hub_file(name: str) -> str:
    """Where file `name` goes in this node's torch hub cache (`$TORCH_HOME/hub/checkpoints`)."""
    return str(Path(torch.hub.get_dir()) / "checkpoints" / name)


def has_hub_file(name: str) -> bool:
    return Path(hub_file(name)).is_file()


def write_hub_file(name: str, data: bytes) -> str:
    """Write `data` as file `name` of this node's hub cache, whole or not at all; its path."""
    path = Path(hub_file(name))
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    partial.write_bytes(data)
    os.replace(partial, path)
    return str(path)


def copy_to_every_node(path: Path) -> list[str]:
    """Copy the driver's weights file `path` into the hub cache of every alive node without it;
    the addresses of the nodes it was copied to ([] on one machine, or when all have it).
    Raises ConfigError naming --weights, the node and the file to put there when a copy fails."""
    alive = [n for n in ray.nodes() if n.get("Alive")]
    if len(alive) < 2:
        return []
    here = ray.get_runtime_context().get_node_id()

    def on(node: dict):
        return NodeAffinitySchedulingStrategy(node["NodeID"], soft=False)

    check = ray.remote(num_cpus=0, max_retries=0)(has_hub_file)
    others = [n for n in alive if n["NodeID"] != here]
    present = ray.get([check.options(scheduling_strategy=on(n)).remote(path.name) for n in others],
                      timeout=300)
    missing = [n for n, has in zip(others, present, strict=True) if not has]
    if not missing:
        return []
    data = ray.put(path.read_bytes())   # once: each node's task reads it from the object store
    write = ray.remote(num_cpus=0, max_retries=1)(write_hub_file)
    copied = []
    for node in missing:
        address = node.get("NodeManagerAddress", node["NodeID"])
        try:
            ray.get(write.options(scheduling_strategy=on(node)).remote(path.name, data), timeout=600)
        except ray.exceptions.RayError as e:
            reason = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
            raise ConfigError("--weights", f"could not copy the Kinetics-400 weights {path.name} to node "
                              f"{address} ({reason[:300]}); copy {path} into that node's torch hub cache "
                              "($TORCH_HOME/hub/checkpoints, ~/.cache/torch/hub/checkpoints by default) "
                              "or pass --weights with a path every node sees") from None
        copied.append(str(address))
    return copied


def share_kinetics(model: str) -> None:
    """Before the first trial of a search with `--weights kinetics`: model `model`'s file
    (fetched on the driver by the config checks) on every node, with a line saying where it went."""
    path = kinetics_file(model)
    copied = copy_to_every_node(path)
    if copied:
        print(f"Kinetics-400 weights of {model}: copied {path.name} to {len(copied)} node(s) "
              f"({', '.join(copied)}) from this one", flush=True)
