"""The command that continues a search (`--resume`), printed when the search starts and again
when it ends interrupted (`tune.summary.print_summary`).

At the start because a driver that is killed (kill -9, the out-of-memory killer, a lost node)
prints nothing at its end: the line is then in the console's scroll-back and in the search's log
file (`tune.outputs.search_log.log_file_for`), written before the first trial.
"""
from __future__ import annotations

import contextlib

from vidtune.servers import vidtune_line
from vidtune.tune.config.options import SearchOptions
from vidtune.tune.outputs.search_log import log_file_for

DEFAULT_MLFLOW_URI = "sqlite:///mlruns.db"     # the search's own default: left off the line
AT_START = "if it stops, even killed, continue it with: "     # the start's line, before the command


def resume_command(name: str, storage: str, opts: SearchOptions) -> str:
    """`vidtune search --resume --name NAME --storage FOLDER [--mlflow-uri URI]` for the search
    `name` in `storage` (the plan's): every command printed runs as printed in a shell without the
    venv (`vidtune.servers`)."""
    uri = opts.tracking.mlflow_uri
    return vidtune_line("search", "--resume", "--name", name, "--storage", storage,
                        *(() if uri == DEFAULT_MLFLOW_URI else ("--mlflow-uri", uri)))


def announce_resume(name: str, storage: str, search_path: str, opts: SearchOptions) -> str:
    """Print the start's resume line (once, before the first trial) and, unless --verbose (no
    log file then), append it to the log of the search in `search_path`. Returns the line."""
    line = AT_START + resume_command(name, storage, opts)
    print(line, flush=True)
    if not opts.verbose:
        with contextlib.suppress(OSError):     # a full disk must not stop the search here
            with open(log_file_for(search_path, name), "a", encoding="utf-8") as log:
                log.write(line + "\n")
    return line
