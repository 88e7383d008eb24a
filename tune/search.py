"""`vidtune search` (also `python tune/search.py` from a clone): search batch size and learning rate
for fine-tuning a video transformer. Ray Tune + Optuna propose trials, each trial is a Ray Train
run, MLflow records them.

With no arguments it runs the embedded demo (generated data, the `tiny` model, the CPU).
Bad input fails in seconds, before Ray starts, with exit code 2 and a message naming the flag.
`--help` and a bad flag are answered before Ray, torch or MLflow are imported: the search itself
(`vidtune.tune.preflight`, then `vidtune.tune.runner`) is imported once the options are parsed.
"""
from __future__ import annotations

import os
import sys

if __name__ == "__main__" and not __package__:
    # Run by path, `python tune/search.py`: Python put `tune/` first on sys.path, where its
    # modules (options, tables, trial, ...) would shadow installed ones of the same names. Run
    # the installed module instead, in this same process (exec keeps the pid, the terminal and
    # Ctrl-C), as `python -m vidtune.tune.search` would.
    import importlib.util

    if importlib.util.find_spec("vidtune") is None:
        sys.exit("vidtune search: error: the vidtune package is not installed in this Python "
                 f"({sys.executable}); run `make install` (or `pip install -e .`) in the repository first")
    os.execv(sys.executable, [sys.executable, "-m", "vidtune.tune.search", *sys.argv[1:]])

import contextlib
import io
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from vidtune.errors import DataError, SearchInterrupted, VidtuneError
from vidtune.flags import ConfigError
from vidtune.trainer.ray_setup.ray_start import import_failure_message
from vidtune.tune.config.options import SearchOptions, build_parser, given_options, parse_options

if TYPE_CHECKING:
    from vidtune.tune.preflight import Plan

__all__ = ["build_parser", "main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the search; returns the exit code (2 for unusable input, with a one-paragraph message)."""
    try:
        opts = parse_options(argv)
        # a resume runs with the search's saved options; what this line sets is checked against them
        return run_search(opts, given=given_options(argv) if opts.resume else None)[0]
    except (ConfigError, DataError) as e:
        print(f"vidtune search: error: {e}", file=sys.stderr)
        return 2
    except ImportError as e:      # torch or Ray cannot load: most often a memory limit (ulimit -v)
        print(f"vidtune search: error: {import_failure_message(e)}", file=sys.stderr)
        return 1
    except VidtuneError as e:   # Ray cannot start here (RayStartError), the storage is full (DiskFullError)
        print(f"vidtune search: error: {e}", file=sys.stderr)
        return 1
    except SearchInterrupted as e:   # before the first trial: what was kept, and what to run
        print(f"vidtune search: {e}", file=sys.stderr)
        return 130
    except KeyboardInterrupt:   # a second Ctrl-C during the graceful stop: Tune's last saved state
        print("vidtune search: interrupted; every MLflow run was closed (KILLED). Continue with --resume.",
              file=sys.stderr)
        return 130


def run_search(opts: SearchOptions, given: dict[str, object] | None = None) -> tuple[int, Plan | None]:
    """Check everything on the driver (`tune.preflight.prepare`), then run the search
    (`tune.runner.execute`) or, with --dry-run, print the resolved configuration; a --resume of a
    finished search prints one line and runs nothing (`tune.state.finished`). Returns the exit code (a
    finished search's own) and the plan (None for a dry run). `given`: the options the caller set
    (`tune.config.options.given_options`), which a --resume checks against the search's saved ones.
    The command (`main`) and the Python API (`vidtune.search`) both run a search through here."""
    from vidtune.tune import preflight, runner  # heavy (Ray, Optuna, MLflow, torch): flags first
    from vidtune.tune.state import finished  # heavy (Ray): flags first

    started_at = time.time()    # the search's time, not the process's (a notebook runs several)
    # --quiet: nothing before the summary, which writes to the real stdout (tune.summary.summarise)
    quiet = opts.quiet and not opts.dry_run
    with contextlib.redirect_stdout(io.StringIO()) if quiet else contextlib.nullcontext():
        try:
            plan = replace(preflight.prepare(opts, given=given), started_at=started_at)
        except KeyboardInterrupt:   # the options, the dataset's index: nothing of the search written yet
            raise SearchInterrupted("interrupted before the search started; nothing was written: " + (
                "continue it with --resume (resume=True from Python)" if opts.resume else
                "run the same command again")) from None
        if opts.dry_run and plan.finished is None:
            print(preflight.describe(plan))
            print("dry run: everything checked (cluster resources are checked when the search connects); "
                  "nothing ran.")
            return 0, None
        if plan.finished is None:
            return runner.execute(plan), plan
    # a finished search resumed: one line, its own exit code, nothing written (tune/state/finished.py)
    print(finished.finished_line(plan.finished, plan.search_path), flush=True)
    return (0, None) if opts.dry_run else (plan.finished.exit_code, plan)


if __name__ == "__main__":
    sys.exit(main())
