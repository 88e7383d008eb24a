"""`python tune/search.py`: search batch size and learning rate for fine-tuning a video
transformer. Ray Tune + Optuna propose trials, each trial is a Ray Train run, MLflow records them.

With no arguments it runs the embedded demo (generated data, the `tiny` model, the CPU).
Bad input fails in seconds, before Ray starts, with exit code 2 and a message naming the flag.
`--help` and a bad flag are answered before Ray, torch or MLflow are imported: the search itself
(`tune.preflight`, then `tune.runner`) is imported once the options are parsed.
"""
from __future__ import annotations

import sys

# Run by path (not as tune.search, nor as the copy multiprocessing's spawned children import,
# which inherit the fixed sys.path): put the repository root first on sys.path.
if __name__ == "__main__" and not __package__:
    import script_path  # noqa: F401

import contextlib
import io
from collections.abc import Sequence

from datasets.errors import DataError
from datasets.flags import ConfigError
from tune.options import SearchOptions, build_parser, parse_options

__all__ = ["build_parser", "main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the search; returns the exit code (2 for unusable input, with a one-paragraph message)."""
    try:
        opts = parse_options(argv)
        return run(opts)
    except (ConfigError, DataError) as e:
        print(f"vidtune search: error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:
        from tune.faults import DiskFullError  # imports Ray: loaded by then if the search ran

        if not isinstance(e, DiskFullError):
            raise
        print(f"vidtune search: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("vidtune search: interrupted; every MLflow run was closed (KILLED). Continue with --resume.",
              file=sys.stderr)
        return 130


def run(opts: SearchOptions) -> int:
    """Check everything on the driver (`tune.preflight.prepare`), then run the search
    (`tune.runner.execute`) or, with --dry-run, print the resolved configuration."""
    from tune import preflight, runner  # heavy (Ray, Optuna, MLflow, torch): not before the flags are checked

    # --quiet: nothing before the summary, which writes to the real stdout (tune.summary.summarise)
    quiet = opts.quiet and not opts.dry_run
    with contextlib.redirect_stdout(io.StringIO()) if quiet else contextlib.nullcontext():
        plan = preflight.prepare(opts)
        if opts.dry_run:
            print(preflight.describe(plan))
            print("dry run: everything checked (cluster resources are checked when the search connects); "
                  "nothing ran.")
            return 0
        return runner.execute(plan)


if __name__ == "__main__":
    sys.exit(main())
