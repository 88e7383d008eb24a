"""The pieces behind what a search listens on (tests/test_exposed_ports.py runs them on a real Ray):
the fixed ports another process holds (trainer.ray_setup.fixed_ports) and the interface of the node's address
that gloo is given (trainer.cluster.process_group_ports)."""
from __future__ import annotations

import os
import socket

import psutil

from vidtune.trainer.ray_setup.fixed_ports import (
    AGENT_HTTP_PORT,
    FixedPort,
    fixed_ports,
    is_held,
    taken_fixed_ports,
    taken_line,
)


def _listening() -> socket.socket:
    s = socket.socket()
    s.bind(("", 0))
    s.listen()
    return s


def test_a_held_metrics_port_is_found_and_named_with_its_holder_and_the_setting_that_moves_it(monkeypatch):
    with _listening() as held:
        port = held.getsockname()[1]
        monkeypatch.setenv("DASHBOARD_METRIC_PORT", str(port))
        taken = taken_fixed_ports()
        assert FixedPort(port, "the dashboard's metrics", "DASHBOARD_METRIC_PORT") in taken
        line = taken_line([p for p in taken if p.port == port])
    assert line is not None and "\n" not in line
    assert line.startswith(f"note: port {port} (the dashboard's metrics; ")
    assert f"held by pid {os.getpid()}, {psutil.Process().name()})" in line
    assert "runs without it, training is not affected" in line
    assert "DASHBOARD_METRIC_PORT=<free port>" in line and "--dashboard-agent-listen-port" not in line


def test_the_agents_port_moves_only_on_a_ray_of_ones_own_and_several_ports_make_one_line():
    line = taken_line([FixedPort(AGENT_HTTP_PORT, "the dashboard agent's HTTP API: job submission", None),
                       FixedPort(44217, "the autoscaler's metrics", "AUTOSCALER_METRIC_PORT")])
    assert line is not None and "\n" not in line and line.startswith("note: ports 52365 (")
    assert "ray start --head --dashboard-agent-listen-port <free port>" in line and "--address" in line
    assert "AUTOSCALER_METRIC_PORT=<free port>" in line and "runs without them" in line
    assert taken_line([]) is None


def test_a_free_port_is_not_held_and_a_setting_that_is_no_port_is_left_to_ray(monkeypatch):
    with socket.socket() as s:
        s.bind(("", 0))
        free = s.getsockname()[1]      # bound, not listening: not held, and free once closed
    assert not is_held(free)
    monkeypatch.setenv("AUTOSCALER_METRIC_PORT", "not-a-port")
    monkeypatch.setenv("DASHBOARD_METRIC_PORT", "70000")
    assert [p.port for p in fixed_ports()] == [AGENT_HTTP_PORT]
    monkeypatch.setenv("DASHBOARD_METRIC_PORT", "44227")
    assert [p.port for p in fixed_ports(dashboard=False)] == [AGENT_HTTP_PORT]     # no dashboard, no metrics


def test_gloo_gets_the_interface_that_holds_the_nodes_address():
    from vidtune.trainer.cluster.process_group_ports import interface_of

    loopback = interface_of("127.0.0.1")
    assert loopback is not None and any(a.address == "127.0.0.1" for a in psutil.net_if_addrs()[loopback])
    assert interface_of("198.51.100.7") is None          # TEST-NET-2: on no interface here


def _listening_on(port: int) -> list[str]:
    return [c.laddr.ip for c in psutil.Process().net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port]


def test_a_one_rank_group_serves_its_store_on_the_nodes_address_and_gloo_is_given_its_interface(monkeypatch):
    import ray.util
    import torch
    import torch.distributed as dist

    from vidtune.trainer.cluster import process_group_ports as pg

    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "127.0.0.1")
    for name in ("MASTER_ADDR", "MASTER_PORT", pg.GLOO_INTERFACE_ENV):
        monkeypatch.setenv(name, "")          # restored after the test, whatever join_process_group sets
    address, port = pg.bind_store_socket()
    assert address == "127.0.0.1" and _listening_on(port) == ["127.0.0.1"]
    pg.join_process_group("gloo", world_rank=0, world_size=1, address=address, port=port, timeout_s=60)
    try:
        assert os.environ[pg.GLOO_INTERFACE_ENV] == pg.interface_of("127.0.0.1")
        assert (os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]) == (address, str(port))
        assert _listening_on(port) == ["127.0.0.1"]           # the store, on that socket, not `*`
        total = torch.ones(1)
        dist.all_reduce(total)
        assert total.item() == 1.0
    finally:
        dist.destroy_process_group()


def test_a_node_address_on_no_interface_here_leaves_the_store_on_every_interface(monkeypatch):
    import ray.util

    from vidtune.trainer.cluster import process_group_ports as pg

    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "198.51.100.7")
    address, port = pg.bind_store_socket()
    try:
        assert address == "198.51.100.7" and _listening_on(port) == ["0.0.0.0"]
    finally:
        if pg._store_socket is not None:
            pg._store_socket.close()
        pg._store_socket = None
