"""Ray's fixed ports, on a machine where something else (most often another Ray: a second local
search) already holds them: the Ray started here runs without what they serve, and says so.

A Ray that `ray.init` starts (vidtune's local Ray, `trainer.ray_setup.ray_start.start_local_ray`) listens
on three ports that do not move when they are taken (Ray 2.60): the dashboard agent's HTTP API
(52365; Ray's Jobs API reaches a node through it), the dashboard's Prometheus metrics (44227) and
the autoscaler monitor's (44217). When one is held, Ray starts all the same and only its own log
files say that the bind failed. `taken_fixed_ports`, called before Ray starts, finds the ports
held now; `taken_line` is the one line the command prints once Ray is up.
"""
from __future__ import annotations

import errno
import os
import socket
from dataclasses import dataclass

import psutil

AGENT_HTTP_PORT = 52365    # Ray's DEFAULT_DASHBOARD_AGENT_LISTEN_PORT; ray.init has no setting for it


@dataclass(frozen=True)
class FixedPort:
    port: int
    serves: str               # what Ray serves there, which the Ray started here goes without
    setting: str | None       # Ray's environment variable that moves it (read by Ray's processes)


def fixed_ports(*, dashboard: bool = True) -> tuple[FixedPort, ...]:
    """The fixed ports of a Ray started here, as this environment sets them (a value that is not
    a port is left to Ray to refuse); `dashboard`: False for a Ray started without its dashboard
    (`include_dashboard=False`), which has no dashboard metrics to lose."""
    ports = [FixedPort(AGENT_HTTP_PORT, "the dashboard agent's HTTP API: job submission", None)]
    for setting, default, serves in (("DASHBOARD_METRIC_PORT", 44227, "the dashboard's metrics"),
                                     ("AUTOSCALER_METRIC_PORT", 44217, "the autoscaler's metrics")):
        if setting == "DASHBOARD_METRIC_PORT" and not dashboard:
            continue
        value = os.environ.get(setting, str(default)).strip()
        if value.isdigit() and 0 < int(value) < 65536:
            ports.append(FixedPort(int(value), serves, setting))
    return tuple(ports)


def is_held(port: int) -> bool:
    """Whether a socket listens on TCP `port` of any IPv4 address here: binding every address
    fails then, as Ray's own bind of that port will (both reuse an address in TIME_WAIT)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError as e:     # not EACCES: a port below 1024 refused to this user is not held
            return e.errno == errno.EADDRINUSE
    return False


def holder(port: int) -> str | None:
    """'pid 1234, raylet': the process listening on `port`, when this user may see it."""
    try:
        for c in psutil.net_connections(kind="tcp"):
            if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid:
                return f"pid {c.pid}, {psutil.Process(c.pid).name()}"
    except (psutil.Error, OSError):
        pass
    return None


def taken_fixed_ports(*, dashboard: bool = True) -> list[FixedPort]:
    """The fixed ports (`fixed_ports`) that something holds now, before Ray starts here."""
    return [p for p in fixed_ports(dashboard=dashboard) if is_held(p.port)]


def taken_line(taken: list[FixedPort]) -> str | None:
    """One line for the console when `taken` is not empty: which ports, what this Ray runs without,
    who holds them, and how to have them."""
    if not taken:
        return None
    what = ", ".join(f"{p.port} ({p.serves}{'; held by ' + h if (h := holder(p.port)) else ''})"
                     for p in taken)
    moves = [f"{p.setting}=<free port>" for p in taken if p.setting]
    how = ["end the other process"]
    if moves:
        how.append(f"set {' '.join(moves)} for the command (the metrics)")
    if any(p.setting is None for p in taken):
        how.append("start Ray yourself with `ray start --head --dashboard-agent-listen-port <free port>` and "
                   "pass its address with --address (the agent's API)")
    them = "them" if len(taken) > 1 else "it"
    return (f"note: port{'s' if len(taken) > 1 else ''} {what} in use on this machine (another Ray?): "
            f"the Ray started here runs without {them}, training is not affected. To have {them}: "
            f"{', or '.join(how)}")
