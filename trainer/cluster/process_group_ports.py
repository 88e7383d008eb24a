"""Where a training run's workers listen for each other: torch.distributed's store (rank 0) and
gloo (every rank), on the node's own address instead of every interface.

Ray Train 2.60 (`ray.train.torch.config._TorchBackend.on_start`) picks a free port on rank 0's
node and lets `torch.distributed.init_process_group("env://")` make the rest; with torch 2.14:
- rank 0's TCPStore server listens on every interface (`*`), whatever MASTER_ADDR says: torch
  binds its own server socket to `::` / 0.0.0.0. torch lets a caller hand it a socket instead
  (`TCPStore(master_listen_fd=...)`), so rank 0 binds one to its node's address here.
- every rank's gloo listens on the address the machine's hostname resolves to: on many machines
  127.0.0.1 (/etc/hosts), which a worker on another node cannot reach, elsewhere whatever the
  name gives. torch's GLOO_SOCKET_IFNAME names the interface instead: here the one that holds the
  node's address (one the user set is kept).
The node's address is Ray's (`ray.util.get_node_ip_address`, as Ray's MASTER_ADDR); one that is
on no interface of the node (an address behind NAT) leaves both where torch puts them. NCCL (GPU
runs) opens sockets of its own, on the interface it picks or NCCL_SOCKET_IFNAME names; untouched.

Ray's backend is replaced whole (`NodeBoundTorchBackend.on_start`) because it offers no step
between choosing the port and creating the process group; the two Ray helpers it reuses are
private names of `ray.train.torch.config`, imported from `trainer.cluster.torch_trainer` (the trainer
layer's one home for Ray internals, behind its version check).
"""
from __future__ import annotations

import errno
import ipaddress
import logging
import os
import socket
from datetime import timedelta

import psutil
import ray
import torch.distributed as dist

from vidtune.trainer.cluster.torch_trainer import _set_torch_distributed_env_vars, _TorchBackend

log = logging.getLogger(__name__)

GLOO_INTERFACE_ENV = "GLOO_SOCKET_IFNAME"
# What Ray's own setup sets for NCCL (ray.train.torch.config._setup_torch_process_group): a
# timed-out NCCL collective ends its process instead of hanging
NCCL_ASYNC_ERRORS_ENV = ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_BLOCKING_WAIT")

# rank 0's, bound by `bind_store_socket`, until its store takes it
_store_socket: socket.socket | None = None


def interface_of(address: str) -> str | None:
    """The name of this machine's network interface that holds `address` ('eth0'), None if none does."""
    wanted = ipaddress.ip_address(address)
    for name, addresses in psutil.net_if_addrs().items():
        for a in addresses:
            try:
                if ipaddress.ip_address(a.address.split("%", 1)[0]) == wanted:
                    return name
            except ValueError:     # a MAC address (AF_PACKET)
                continue
    return None


def bind_store_socket() -> tuple[str, int]:
    """On rank 0: a listening socket on this node's address and a port the kernel picks, kept for
    `join_process_group`'s TCPStore. Returns (address, port), the run's MASTER_ADDR and MASTER_PORT."""
    global _store_socket
    address = ray.util.get_node_ip_address()
    family = socket.AF_INET6 if ipaddress.ip_address(address).version == 6 else socket.AF_INET
    if _store_socket is not None:
        _store_socket.close()
    _store_socket = socket.socket(family, socket.SOCK_STREAM)
    try:
        _store_socket.bind((address, 0))
    except OSError as e:     # an address on no interface here (behind NAT): every one, as torch would
        if e.errno != errno.EADDRNOTAVAIL:
            raise
        log.warning("the process group's store listens on every interface: %s is on none here", address)
        _store_socket.bind(("", 0))
    _store_socket.listen(128)
    return address, int(_store_socket.getsockname()[1])


def join_process_group(backend: str, world_rank: int, world_size: int, address: str, port: int,
                       timeout_s: int) -> None:
    """On every worker: the run's torch.distributed process group, its store served by rank 0 on
    `bind_store_socket`'s socket and gloo on the interface of this node's address."""
    global _store_socket
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = address, str(port)
    if not os.environ.get(GLOO_INTERFACE_ENV):
        interface = interface_of(ray.util.get_node_ip_address())
        if interface is not None:      # else gloo keeps torch's default, the hostname's address
            os.environ[GLOO_INTERFACE_ENV] = interface
    if "nccl" in backend and not any(name in os.environ for name in NCCL_ASYNC_ERRORS_ENV):
        os.environ[NCCL_ASYNC_ERRORS_ENV[0]] = "1"
    timeout = timedelta(seconds=timeout_s)
    if world_rank == 0:
        if _store_socket is None:
            raise RuntimeError("rank 0 joined its process group before binding the store's socket")
        store = dist.TCPStore(address, port, world_size, is_master=True, timeout=timeout,
                              master_listen_fd=_store_socket.fileno())
        _store_socket.detach()     # the store's now: it closes it
        _store_socket = None
    else:
        store = dist.TCPStore(address, port, world_size, is_master=False, timeout=timeout)
    dist.init_process_group(backend=backend, store=store, rank=world_rank, world_size=world_size,
                            timeout=timeout)


class NodeBoundTorchBackend(_TorchBackend):
    """Ray Train's torch backend, with the process group's listening sockets on the node's address."""

    def on_start(self, worker_group, backend_config) -> None:
        backend = backend_config.backend
        if backend is None:     # Ray's choice, less TPUs (vidtune trains on CPUs and CUDA GPUs)
            backend = "nccl" if worker_group.get_resources_per_worker().get("GPU", 0) > 0 else "gloo"
        address, port = worker_group.execute_single(0, bind_store_socket)
        worker_group.execute(_set_torch_distributed_env_vars)    # RANK, LOCAL_RANK, WORLD_SIZE, ...
        world_size = len(worker_group)
        ray.get([worker_group.execute_single_async(
            rank, join_process_group, backend=backend, world_rank=rank, world_size=world_size,
            address=address, port=port, timeout_s=backend_config.timeout_s) for rank in range(world_size)])
