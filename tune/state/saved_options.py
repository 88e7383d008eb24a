"""A search's settings are its own: saved once, as data, when it starts, and read back by `--resume`.

Tune saves its own state (the trials, the searcher) but not vidtune's options: a resume that parsed
its command line again filled every option not given from the defaults (the demo's data, 6
epochs) and so rewrote a finished search's results with another dataset. So a new search writes
`OPTIONS_FILE` beside Tune's state (`tune.config.layout.state_path`), through a temporary file in the
same folder, flushed and fsync'ed, then renamed: a full disk or a kill leaves no half file. A
resume starts from those options; an option given on the resume line (a flag, or a key of its
`--config` file) must equal the saved one, except `CHANGEABLE` ones (where the search runs and
where it is recorded) and the run switches (`RUN_ONLY`, never saved). A differing one is
refused (ConfigError, exit 2) in one line naming the flag and both values.

A search started by a vidtune older than this file has none: its resume takes the options given,
as before, and says so.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow.fs

from vidtune.atomic import write_atomically
from vidtune.flags import ConfigError, FlagSpec, build, get_path
from vidtune.tune.config import layout
from vidtune.tune.config.options import SPECS, SearchOptions

OPTIONS_FILE = "vidtune_options.json"
FORMAT = 1
# Switches of this run only, never saved: how to run, which search, where its folder is.
RUN_ONLY = frozenset({"resume", "trust_state", "config", "dry_run", "verbose", "quiet", "name", "storage",
                      "smoke_test"})
# May differ on the resume line (the given value wins; not given, the saved one holds): where the
# search runs, what starts Ray there, and where it is recorded. docs/troubleshooting.md lists them.
CHANGEABLE = frozenset({"tracking.mlflow_uri", "resources.address", "resources.cluster_config",
                        "resources.ray_start.object_store_gb", "resources.ray_start.start_timeout_s",
                        "train.weights_cache"})   # the same weights, mounted elsewhere on another cluster
DATA_ROOT = "train.data.root"


def saved_values(opts: SearchOptions) -> dict[str, Any]:
    """{dotted path: value} of every saved option of `opts` (a plan's: the dataset's path
    resolved; None for the demo's, which a resume finds or makes again)."""
    values = {s.path: get_path(opts, s.path) for s in SPECS if s.path not in RUN_ONLY}
    return {k: list(v) if isinstance(v, tuple) else v for k, v in values.items()}


def options_path(search_path: str) -> str:
    return f"{layout.state_path(search_path).rstrip('/')}/{OPTIONS_FILE}"


def save(opts: SearchOptions, search_path: str, *, demo: bool) -> str:
    """Write the search's options (`saved_values`) once, atomically; returns the file's path."""
    values = saved_values(opts)
    if demo:
        values[DATA_ROOT] = None
    data = json.dumps({"format": FORMAT, "options": values}, indent=1, sort_keys=True).encode()
    path = options_path(search_path)
    if "://" in path:      # object storage: an object appears whole or not at all
        fs, where = pyarrow.fs.FileSystem.from_uri(path)
        fs.create_dir(where.rsplit("/", 1)[0], recursive=True)
        with fs.open_output_stream(where) as f:
            f.write(data)
        return path
    write_atomically(Path(path), data)
    return path


def load(search_path: str) -> dict[str, Any] | None:
    """The saved {dotted path: value}, in the fields' types; None when the search has no file (a
    vidtune older than it). ConfigError (--resume) naming the file when it cannot be read."""
    path = options_path(search_path)
    try:
        if "://" in path:
            fs, where = pyarrow.fs.FileSystem.from_uri(path)
            if fs.get_file_info(where).type == pyarrow.fs.FileType.NotFound:
                return None
            with fs.open_input_stream(where) as f:
                doc = json.loads(f.readall())
        else:
            if not Path(path).exists():
                return None
            doc = json.loads(Path(path).read_text(encoding="utf-8"))
        values = doc["options"]
        specs = {s.path: s for s in SPECS if s.path not in RUN_ONLY}
        unknown = set(values) - set(specs)
        if doc.get("format") != FORMAT or not isinstance(values, dict) or unknown:
            raise ValueError(f"not a format-{FORMAT} options file" +
                             (f" (unknown options {sorted(unknown)})" if unknown else ""))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError("--resume", f"{path}, the options the search was started with, cannot be read "
                          f"({type(e).__name__}: {e}); nothing was resumed. Start a new search under another "
                          "--name") from None
    return {k: tuple(v) if specs[k].kind == "int_list" and v is not None else v for k, v in values.items()}


def resumed_options(opts: SearchOptions, given: dict[str, Any], search_path: str) -> SearchOptions:
    """The options a resume of the search at `search_path` runs with: the saved ones, the
    CHANGEABLE ones given on the resume line, and this run's switches (RUN_ONLY) from `opts`.
    `given`: {dotted path: value} set on the command line or by its --config file. ConfigError
    naming the flag and both values when a given option differs from the saved one."""
    saved = load(search_path)
    if saved is None:
        print(f"resume: {search_path} was started by an older vidtune, which did not save its options; "
              "this resume runs with the options given on its command line")
        return opts
    by_path = {s.path: s for s in SPECS}
    for path, value in given.items():
        if path in RUN_ONLY or path in CHANGEABLE or path not in saved:
            continue
        if path == DATA_ROOT and value is not None:
            value = str(Path(value).expanduser().resolve())
        if not _same(value, saved[path]):
            spec = by_path[path]
            here, then = _show(spec, value), _show(spec, saved[path])
            raise ConfigError(spec.flag, f"{here} on this line, {then} when the search at {search_path} was "
                              "started: a resume continues with the search's own settings; leave "
                              f"{spec.flag} out (or start a new search under another --name)")
    values = dict(saved)
    values.update({p: get_path(opts, p) for p in RUN_ONLY})
    values.update({p: v for p, v in given.items() if p in CHANGEABLE})
    return build(SearchOptions, values)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return float(a) == float(b)
    return (tuple(a) if isinstance(a, list) else a) == (tuple(b) if isinstance(b, list) else b)


def _show(spec: FlagSpec, value: Any) -> str:
    if spec.kind == "bool":
        on = value is False if spec.negated else value is True
        return "given" if on else "not given"
    if value is None:
        return "not set" + (" (the demo's dataset)" if spec.path == DATA_ROOT else "")
    return ",".join(map(str, value)) if isinstance(value, (tuple, list)) else str(value)
