"""What a node needs before it trains, for a node that joined after the search started.

Before the first trial the search copies the Kinetics-400 weights to every node alive
(`trainer.cluster.kinetics`) and fills each one's clip cache (`trainer.cluster.node_cache`). A node
the autoscaler starts later (a KubeRay worker pod, a `cluster.yaml` GPU node) had neither: its
first trial downloaded the weights (failing on an offline node) and decoded every clip inside
its first, timed, epoch. So each training worker, before it builds its run, makes sure its node
has them (`prepare_this_node`), through the same code: the weights file copied from the search
driver's node into this node's torch hub cache (`kinetics.write_hub_file`), the clip cache filled
by `node_cache.fill_this_node`. Once per node: the weights are there or not, and the fill leaves
a marker for its videos and size that the next worker there finds (a lock keeps two workers of
one node from decoding at once; the second waits, then finds the marker). On the nodes the
search prepared at its start this is a file check and a marker check.

It runs before the worker holds its device (`trainer.cluster.lease`), so no GPU waits on it, and
before its first epoch's clock. Limitation: the other ranks of a trial that spans nodes wait for
it in their first collective, within `--collective-timeout-min`.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from vidtune.datasets.config import DataConfig
from vidtune.datasets.index import VideoIndex
from vidtune.datasets.records import VideoInfo
from vidtune.errors import DataError
from vidtune.trainer.cluster.kinetics import has_hub_file, write_hub_file
from vidtune.trainer.cluster.node_cache import fill_this_node
from vidtune.trainer.models.registry import get_spec
from vidtune.trainer.training.config import TrainConfig

NODE_SETUP_CONFIG_KEY = "_vidtune_node_setup"   # in a search's train_loop_config; popped by the worker
READ_WAIT_S = 600.0                              # the weights file from the driver's node (hundreds of MB)


@dataclass(frozen=True)
class NodeSetup:
    """What the search prepared on every node at its start, for a worker to check on its own:
    `source_node`, the search driver's Ray node id; `kinetics_path`, the Kinetics-400 file there
    (`--weights kinetics`; None otherwise); `fill_cache`, whether clip caches were filled."""

    source_node: str
    kinetics_path: str | None = None
    fill_cache: bool = False

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict | None) -> NodeSetup | None:
        return cls(**d) if d else None


def read_file(path: str) -> bytes:
    """Run on the node holding `path`: its bytes."""
    return Path(path).read_bytes()


def copy_weights_here(setup: NodeSetup) -> str | None:
    """Put the driver's Kinetics file into this node's torch hub cache when it is not there yet;
    a line saying so, or None when nothing was needed."""
    if setup.kinetics_path is None:
        return None
    name = Path(setup.kinetics_path).name
    if has_hub_file(name):
        return None
    reader = ray.remote(num_cpus=0, max_retries=1)(read_file).options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(setup.source_node, soft=False))
    try:
        path = write_hub_file(name, ray.get(reader.remote(setup.kinetics_path), timeout=READ_WAIT_S))
    except (ray.exceptions.RayError, OSError) as e:
        reason = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        return (f"Kinetics-400 weights {name}: could not copy them from the search driver's node "
                f"({reason[:200]}); building the model downloads them")
    return f"Kinetics-400 weights {name}: copied to {path} from the search driver's node"


def prepare_this_node(setup: NodeSetup, data: DataConfig, videos: list[VideoInfo], *, height: int,
                      width: int, on_gpu: bool) -> list[str]:
    """Make sure this node has what `setup` says the search prepared at its start: the Kinetics
    weights (`copy_weights_here`) and the clip cache of `videos` at `height` x `width`
    (`node_cache.fill_this_node`, once per node). Lines saying what it did ([] when nothing was
    needed); never raises for a copy or fill that failed: training then does what it did before."""
    lines = [line for line in [copy_weights_here(setup)] if line]
    if setup.fill_cache and videos:
        try:
            summary = fill_this_node(data, videos, height, width, on_gpu, once=True)
        except (OSError, DataError) as e:   # the first epoch decodes on read, as without a fill
            summary = f"not filled ({e})"
        if summary:
            lines.append(f"clip cache: this node joined after the search started; filled before training: "
                         f"{summary}")
    return lines


def prepare_for_run(setup: NodeSetup, cfg: TrainConfig, index: VideoIndex, *, on_gpu: bool) -> list[str]:
    """`prepare_this_node` for a training worker of `cfg` on `index`'s videos (train and val), at
    the clip size the run reads (`cfg.data`'s, else the model's)."""
    spec = get_spec(cfg.model)
    return prepare_this_node(setup, cfg.data, list(index.train) + list(index.val),
                             height=cfg.data.height or spec.height, width=cfg.data.width or spec.width,
                             on_gpu=on_gpu)
