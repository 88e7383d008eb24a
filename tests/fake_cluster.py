"""The start of a script that runs Ray's fake multi-node cluster (`ray.cluster_utils.Cluster`) in
its own process, shared by the tests that need one (multinode, spot loss, Kinetics copies,
per-node clip caches).

Its own process, because making a `Cluster` points the creating process's Ray internals at it
and its shutdown resets them, which would break the session's Ray that pytest may hold. The
prelude defines `start_head(**head_node_args)`: a head on free GCS and dashboard ports (the
defaults may belong to the session's Ray), with RAY_ADDRESS set for every node process it starts,
since with other Rays on this machine the "latest cluster" record is ambiguous. A test's script
is `PRELUDE + body`; the body adds nodes, prints one JSON line and shuts the cluster down.
"""
from __future__ import annotations

PRELUDE = r"""
import json, os, socket, sys
from pathlib import Path
from ray.cluster_utils import Cluster
from ray.util import get_node_ip_address

def free_port():
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]

def start_head(**head_node_args):
    port = free_port()
    os.environ["RAY_ADDRESS"] = f"{get_node_ip_address()}:{port}"
    return Cluster(initialize_head=True, head_node_args={
        "gcs_server_port": port, "dashboard_port": free_port(), **head_node_args})
"""
