"""The Ray minor version vidtune's uses of Ray internals are tested on, and the check of it.

Two modules touch Ray's private APIs (`tests/test_ray_internals.py` keeps it so): the search's
`vidtune.tune.running.ray_internals` and the trainer's `vidtune.trainer.cluster.torch_trainer`. Both call
`check_ray_version()` on import. It lives on the floor because the trainer layer cannot import
from the search layer above it; only those two import it (the floor's other modules stay Ray-free).
"""
from __future__ import annotations

import logging
import os
import re

import ray

log = logging.getLogger(__name__)

SUPPORTED_RAY = (2, 60)
"""The Ray minor version (major, minor) the private uses are written and tested against."""

ALLOW_UNTESTED_ENV = "VIDTUNE_ALLOW_UNTESTED_RAY"
"""Set to 1 to run on another Ray minor anyway (a warning instead of the error), e.g. to try an upgrade."""

INSTALL_HINT = "pip install -c constraints.txt -e ."


class UnsupportedRayError(RuntimeError):
    """The installed Ray is not the minor version vidtune's uses of Ray internals are tested on,
    or one of those internals is not where vidtune expects it."""


def supported() -> str:
    """`SUPPORTED_RAY` as text, e.g. "2.60"."""
    return f"{SUPPORTED_RAY[0]}.{SUPPORTED_RAY[1]}"


def moved_internal(what: str, e: Exception) -> UnsupportedRayError:
    """The error for a Ray internal (`what`: its name) that is not where vidtune expects it, `e`
    being what Python raised looking for it (only reachable on another Ray minor, with
    VIDTUNE_ALLOW_UNTESTED_RAY=1)."""
    return UnsupportedRayError(f"Ray {ray.__version__}: {what} is not where vidtune expects it ({e!r}); "
                               f"vidtune is tested with Ray {supported()}.x: `{INSTALL_HINT}`")


def check_ray_version(version: str | None = None) -> str:
    """Raise `UnsupportedRayError` unless `version` (default: the installed `ray.__version__`)
    is of the supported minor, `SUPPORTED_RAY`; returns the version checked. With
    VIDTUNE_ALLOW_UNTESTED_RAY=1 a mismatch only logs a warning."""
    version = ray.__version__ if version is None else version
    match = re.match(r"(\d+)\.(\d+)", version)
    if match and (int(match.group(1)), int(match.group(2))) == SUPPORTED_RAY:
        return version
    message = (f"vidtune is tested with Ray {supported()}.x, but Ray {version} is installed; it relies on "
               f"Ray internals that change between minor versions (see tune/running/ray_internals.py and "
               f"trainer/cluster/torch_trainer.py). Install the tested version with `{INSTALL_HINT}` "
               f"(from the "
               f"repository root), or set {ALLOW_UNTESTED_ENV}=1 to try this one anyway.")
    if os.environ.get(ALLOW_UNTESTED_ENV, "").strip().lower() in ("1", "true", "yes"):
        log.warning("%s (going on: %s is set)", message, ALLOW_UNTESTED_ENV)
        return version
    raise UnsupportedRayError(message)
