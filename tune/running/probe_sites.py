"""Where `--probe-batch-size` measures: one GPU of each kind the search's trials may train on.

A trial asks Ray for GPUs, not for a GPU model, so on a cluster with two kinds of GPU node (an
A10G node beside an A100 node) it may land on either. A cap measured on whichever node Ray
picked for the probe would let trials on a smaller GPU run out of memory. So the probe runs
once on a node of each GPU kind alive, pinned to that node, and the search keeps the smallest
cap: every trial then fits wherever Ray puts it (on the larger GPUs at the smaller's batch
sizes, the price of that). The kind is Ray's name for the node's GPUs (its
`accelerator_type:<kind>` resource, set from the GPU model when the node starts; "" where Ray
names none, and such nodes count as one kind). With no GPU node alive yet (the autoscaler has
yet to start one) the probe runs on the first that joins. Each probe's line names the node,
Ray's kind and the GPU model torch saw (`BatchProbe.gpu`). Not covered: a kind of GPU node that
only the autoscaler may start later, once GPU nodes of another kind are alive.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from vidtune.trainer.cluster.devices import train_device
from vidtune.trainer.training.batch_probe import BatchProbe, probe_batch_size

KIND_PREFIX = "accelerator_type:"   # Ray's resource naming a node's GPU model (ray._common.utils)


@dataclass(frozen=True)
class ProbeSite:
    """A GPU node the probe runs on, for one kind of GPU."""

    kind: str        # Ray's name of the GPU model ("A100", "H100"); "" when Ray names none
    node_id: str     # the node the probe is pinned to (the first alive of that kind, by id)
    node_ip: str
    gpus: float      # GPUs of this kind alive in the cluster

    def describe(self) -> str:
        """E.g. `on node 10.0.0.3 (A100, one of 8 such GPUs)`."""
        kind = self.kind or "GPU of a kind Ray does not name"
        count = "the only such GPU" if self.gpus <= 1 else f"one of {self.gpus:g} such GPUs"
        return f"on node {self.node_ip} ({kind}, {count})"


def probe_sites(nodes: Iterable[dict[str, Any]]) -> list[ProbeSite]:
    """One alive node with a GPU per GPU kind among `nodes` (`ray.nodes()`), the most common kind
    first; [] when none is alive."""
    by_kind: dict[str, list[dict[str, Any]]] = {}
    for node in nodes:
        resources = node.get("Resources") or {}
        if not node.get("Alive") or float(resources.get("GPU", 0.0)) < 1:
            continue
        kinds = [k[len(KIND_PREFIX):] for k in resources if k.startswith(KIND_PREFIX)]
        by_kind.setdefault(kinds[0] if len(kinds) == 1 else "", []).append(node)
    sites = []
    for kind, members in by_kind.items():
        first = min(members, key=lambda n: n["NodeID"])
        sites.append(ProbeSite(kind=kind, node_id=first["NodeID"],
                               node_ip=first.get("NodeManagerAddress", ""),
                               gpus=sum(float(n["Resources"]["GPU"]) for n in members)))
    return sorted(sites, key=lambda s: (-s.gpus, s.kind))


@ray.remote(num_gpus=1)
def _probe(model: str, kwargs: dict[str, Any]) -> BatchProbe:
    return probe_batch_size(model, device=train_device(), **kwargs)


def probe_each_kind(sites: list[ProbeSite], model: str,
                    **kwargs: Any) -> list[tuple[ProbeSite | None, BatchProbe]]:
    """`probe_batch_size(model, **kwargs)` on one GPU of each site (all at once, each pinned to its
    node); with no site, on the first GPU Ray can give (a node still to join: `None` as its site)."""
    if not sites:
        return [(None, ray.get(_probe.remote(model, kwargs)))]
    pending = [_probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(s.node_id, soft=False))
               .remote(model, kwargs) for s in sites]
    return list(zip(sites, ray.get(pending), strict=True))
