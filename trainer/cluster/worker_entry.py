"""Ray Train's entry point for vidtune's workers, in a module that imports nothing heavy.

A trainer holds its per-worker function by name (Ray pickles it by reference), and the
processes that build or hold trainers never call it: a search's Tune trial function builds
one per trial. Were the function `trainer.cluster.worker.train_loop_per_worker` itself, each of them
would import the worker's code (torchvision, decord, the data and model code: 0.8 s of CPU
per trial on 2 cores, `python -X importtime`); this one imports it in the worker, on its call.
"""
from __future__ import annotations


def train_loop_per_worker(config: dict) -> None:
    """`trainer.cluster.worker.train_loop_per_worker(config)`, run in a Ray Train worker."""
    from vidtune.trainer.cluster.worker import train_loop_per_worker as train  # the worker's process only

    train(config)
