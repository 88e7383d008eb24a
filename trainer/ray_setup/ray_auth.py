"""Joining a Ray cluster that uses token authentication (Ray 2.60's default): one line, not a
traceback, when the cluster refuses this process for want of its token.

Ray reads the token from RAY_AUTH_TOKEN, else the file RAY_AUTH_TOKEN_PATH names, else
~/.ray/auth_token (what `ray get-auth-token --generate` writes and `ray start` reads; a local
`ray.init`, as a search on one machine makes, writes one there too). With RAY_AUTH_MODE=token and
no token, `ray.init` raises AuthenticationError before it connects. Without RAY_AUTH_MODE it
turns token authentication on only for address "auto" and only when it finds a token: to an
address given explicitly it sends none, even one it found (so a local token is never sent to a
cluster named by hand). A cluster that wants a token then refuses this process: ray.init retries
for ~20 s, then raises ConnectionError. Each refusal becomes ConfigError naming what to set; a
join with no token anywhere gets a note before it waits.
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
# In the text of ray.init's ConnectionError (its cause's) when the cluster's GCS refused this
# process's token, or its lack of one: the gRPC status Ray 2.60 reports for it.
REFUSED_STATUS = "InvalidAuthToken"


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
    """The one line for a cluster that refused this process: what is missing, what to set. Read
    after the refusal: ray.init sets RAY_AUTH_MODE=token itself when it used a token it found."""
    where = f"the Ray cluster at {address}" if address else "the Ray cluster"
    set_token = (f"set {TOKEN_ENV} to the cluster's token (`ray get-auth-token` on its head prints it) or "
                 f"{TOKEN_PATH_ENV} to a file holding it ({DOCS})")
    if not token_found():
        return (f"{where} uses token authentication ({AUTH_MODE_ENV}=token) and no token was found here: "
                f"{set_token}")
    if os.environ.get(AUTH_MODE_ENV, "").strip().lower() != "token":
        return (f"{where} uses token authentication and Ray sent it no token: Ray sends the token found "
                f"here to an address given explicitly only when {AUTH_MODE_ENV}=token; set it (and "
                f"{TOKEN_ENV} to the cluster's token, if that is not the one here) ({DOCS})")
    return f"{where} refused the token found here: {set_token}"


def refused_for_token(error: BaseException) -> bool:
    """Whether `error` (ray.init's ConnectionError, after its retries) is the cluster refusing
    this process's token or its lack of one: Ray keeps that reason in the text of its causes."""
    seen: BaseException | None = error
    while seen is not None:
        if REFUSED_STATUS in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


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
    ConfigError("--address", `refusal_message`); so too a ConnectionError that is such a refusal
    (`refused_for_token`). Other errors pass through."""
    note = no_token_note(address)
    if note:
        print(note, flush=True)
    try:
        yield
    except refused:
        raise ConfigError("--address", refusal_message(address)) from None
    except ConnectionError as error:
        if not refused_for_token(error):
            raise
        raise ConfigError("--address", refusal_message(address)) from None
