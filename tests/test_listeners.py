"""The pieces behind what a search listens on (tests/test_exposed_ports.py runs them on a real Ray):
the fixed ports another process holds (trainer.fixed_ports) and the interface of the node's address
that gloo is given (trainer.process_group_ports)."""
from __future__ import annotations

import os
import socket

import psutil

from vidtune.trainer.fixed_ports import (
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


def test_gloo_gets_the_interface_that_holds_the_nodes_address():
    from vidtune.trainer.process_group_ports import interface_of

    loopback = interface_of("127.0.0.1")
    assert loopback is not None and any(a.address == "127.0.0.1" for a in psutil.net_if_addrs()[loopback])
    assert interface_of("198.51.100.7") is None          # TEST-NET-2: on no interface here
