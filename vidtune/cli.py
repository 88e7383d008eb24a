"""The `vidtune` command: one subcommand per thing a user runs.

    vidtune search --data /data/rwf2000      # the hyperparameter search (no --data: the demo)
    vidtune train --data /data/rwf2000 ...   # one training run, no search
    vidtune predict --checkpoint ... a.mp4   # score videos with a trained model
    vidtune ui / vidtune serve MODEL         # MLflow's UI / model server on a search's store

Each subcommand is the `main(argv)` of the module that implements it, with the same flags and
`--help` as `python -m <module>`; this file only picks the module. It imports nothing heavy
(Ray, torch, MLflow), so `vidtune --help` and `vidtune <command> --help` answer at once, as do
bad flags: each command's module imports those libraries only once its flags are checked.
"""
from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from vidtune import __version__

PROG = "vidtune"


@dataclass(frozen=True)
class Command:
    module: str      # its `main(argv) -> int` runs the command
    summary: str     # one line for `vidtune --help`


COMMANDS: dict[str, Command] = {
    "search": Command("vidtune.tune.search",
                      "search batch size and learning rate (Ray Tune + Optuna; MLflow records each trial)"),
    "demo": Command("vidtune.tune.search",
                    "the search on a generated dataset, on this machine (what `search` without --data runs)"),
    "train": Command("vidtune.trainer.commands.train", "train one configuration, no search (Ray Train)"),
    "predict": Command("vidtune.trainer.serving.predict", "score videos with a trained checkpoint"),
    "ui": Command("vidtune.ui_cli", "open MLflow's UI on a search's store (no activated venv needed)"),
    "serve": Command("vidtune.trainer.serving.serve_cli",
                     "serve a registered model over HTTP with MLflow (P(violent) per video)"),
    "index": Command("vidtune.datasets.index", "find and probe a data folder's videos; list unusable ones"),
    "cache": Command("vidtune.trainer.commands.fill_cache",
                     "decode a data folder once into the clip cache, at a model's input size"),
    "synth": Command("vidtune.datasets.synthetic",
                     "write a small learnable violence-like dataset of real video files"),
    "export-hf": Command("vidtune.trainer.serving.hf_export",
                         "write a trained hf: model as save_pretrained does, for use outside vidtune"),
    "batch-probe": Command("vidtune.trainer.commands.batch_probe_cli",
                           "find the largest batch size that fits in one GPU's memory"),
}


def prog(name: str) -> str:
    """The program name a subcommand's parser shows in its usage and errors."""
    return f"{PROG} {name}"


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"usage: {PROG} COMMAND [flags]   ({PROG} COMMAND --help for a command's flags)", "",
             "Find the fastest and most accurate way to fine-tune a video transformer.", "", "commands:"]
    lines += [f"  {name:<{width}}  {cmd.summary}" for name, cmd in COMMANDS.items()]
    lines += ["", "Run without a command (or `vidtune demo`) for the demo search on generated videos.",
              "Every command's flags: docs/options.md."]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Run `vidtune COMMAND [flags]`; returns the command's exit code (2 for an unknown command,
    1 when whoever reads the output closed it early, as `vidtune --help | head -3` does)."""
    try:
        code = run(argv)
        sys.stdout.flush()       # a reader that went away shows here, not in the exit's own flush
        return code
    except BrokenPipeError:
        # What the reader took is all it wanted: no traceback. Point stdout at /dev/null so the
        # interpreter's last flush at exit does not raise again (the Python docs' recipe, "Note
        # on SIGPIPE" in the signal module).
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def run(argv: Sequence[str] | None) -> int:
    """Pick the command from `argv` (sys.argv's flags when None) and run it; its exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        argv = ["demo"]
    name, rest = argv[0], argv[1:]
    if name in ("-h", "--help", "help"):
        print(usage())
        return 0
    if name in ("-V", "--version"):
        print(f"{PROG} {__version__}")
        return 0
    if name not in COMMANDS:
        print(usage(), file=sys.stderr)
        print(f"\n{PROG}: error: unknown command {name!r}; choose one of {', '.join(COMMANDS)}",
              file=sys.stderr)
        return 2
    if name == "demo" and any(a == "--data" or a.startswith("--data=") for a in rest):
        print(f"{prog('demo')}: error: --data: the demo runs on generated videos; "
              f"search your own with `{prog('search')} --data DIR`", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name].module)
    return module.main(rest)


if __name__ == "__main__":
    sys.exit(main())
