"""How a training run's workers talk to each other: the torch.distributed backends, and when a
worker's CUDA device becomes current.

Its own small module because Ray Train's controller unpickles the run's `TorchConfig`: importing
this file there costs Ray Train and torch (which the controller has anyway), not the worker's
whole training stack (torchvision, the models, the data pipeline: seconds per trial).
"""
from __future__ import annotations

import contextlib

from ray.train.torch import TorchConfig

from vidtune.trainer.cluster.process_group_ports import NodeBoundTorchBackend

# With GPUs, the process group is gloo for CPU tensors and NCCL for CUDA ones (torch's
# "device:backend" form). The worker's own collectives (agreeing on an outcome, gathering where
# it runs, the metrics) hold a few numbers: they go over gloo, in host memory
# (`trainer.training.precision.collective_device`), so a trial waiting for its lease makes no CUDA
# context nor an NCCL communicator on the GPU another trial is training on. DDP's gradients
# (CUDA tensors) use NCCL.
GPU_BACKEND = "cpu:gloo,cuda:nccl"


class LeasedTorchConfig(TorchConfig):
    """Ray Train's TorchConfig, except that the worker's CUDA device is not made current before
    the training function starts: Ray's own `train_func_context` calls `torch.cuda.set_device`,
    which with CUDA 12 makes the device's context (hundreds of MB) at once. The worker makes it
    current itself once it holds its lease (`trainer.cluster.worker.train_loop_per_worker`). And the
    process group listens on the node's address, not every interface
    (`trainer.cluster.process_group_ports`)."""

    @property
    def backend_cls(self):
        return NodeBoundTorchBackend

    @property
    def train_func_context(self):
        return contextlib.nullcontext
