"""Joining a Ray cluster that uses token authentication (Ray 2.60's default): one line, not a
traceback, when the cluster refuses this process for want of its token.

Ray reads the token from RAY_AUTH_TOKEN, else the file RAY_AUTH_TOKEN_PATH names, else
~/.ray/auth_token (what `ray get-auth-token --generate` writes and `ray start` reads). With
RAY_AUTH_MODE=token and no token, `ray.init` raises AuthenticationError before it connects;
without RAY_AUTH_MODE it only turns token authentication on when it finds a token, and a cluster
that wants one then never answers (ray.init retries "Failed to connect to GCS" for minutes). The
first is turned into ConfigError naming the variables; the second gets a note before it waits.
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from vidtune.flags import ConfigError

AUTH_MODE_ENV = "RAY_AUTH_MODE"
TOKEN_ENV = "RAY_AUTH_TOKEN"
TOKEN_PATH_ENV = "RAY_AUTH_TOKEN_PATH"
DEFAULT_TOKEN_FILE = Path("~/.ray/auth_token")
DOCS = "docs/launch.md, \"Token authentication\""


def token_found() -> bool:
    """Whether Ray would find a token here (the variables, then the default file)."""
    if os.environ.get(TOKEN_ENV, "").strip():
        return True
    path = os.environ.get(TOKEN_PATH_ENV) or str(DEFAULT_TOKEN_FILE)
    try:
        return bool(Path(path).expanduser().read_text().strip())
    except OSError:
        return False


def refusal_message(address: str | None) -> str:
    """The one line for a cluster that refused this process: what is missing, what to set."""
    where = f"the Ray cluster at {address}" if address else "the Ray cluster"
    return (f"{where} uses token authentication ({AUTH_MODE_ENV}=token) and no token was found here: "
            f"set {TOKEN_ENV} to the cluster's token (`ray get-auth-token` on its head prints it) or "
            f"{TOKEN_PATH_ENV} to a file holding it ({DOCS})")


def no_token_note(address: str | None) -> str | None:
    """A line before joining when no token is found and RAY_AUTH_MODE is unset: a cluster that
    wants one would leave ray.init waiting; None when a token is found or the mode is set."""
    if os.environ.get(AUTH_MODE_ENV) is not None or token_found():
        return None
    return (f"note: no Ray token here ({TOKEN_ENV}, {TOKEN_PATH_ENV}, {DEFAULT_TOKEN_FILE}); if the "
            f"cluster at {address or 'RAY_ADDRESS'} uses token authentication it will not answer: set "
            f"{AUTH_MODE_ENV}=token and {TOKEN_ENV} ({DOCS})")


@contextlib.contextmanager
def token_refusal_explained(address: str | None, refused: type[Exception]) -> Iterator[None]:
    """Around `ray.init(address=...)` of a cluster to join: prints `no_token_note` first, and
    turns `refused` (Ray's AuthenticationError, passed by the caller, which has imported Ray:
    this module does not, so that the CLIs' --help stays fast) into
    ConfigError("--address", `refusal_message`)."""
    note = no_token_note(address)
    if note:
        print(note, flush=True)
    try:
        yield
    except refused:
        raise ConfigError("--address", refusal_message(address)) from None
