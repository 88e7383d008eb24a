"""The one bootstrap of a script run by path, `python tune/search.py`: imported first (one line),
it puts the repository root first on `sys.path` and drops the script's own folder.

Run by path, `sys.path[0]` is `tune/`: its modules (report, options, ...) would shadow installed
packages of the same name, and Hugging Face's `datasets` (installed with Ray's extras) would win
over this project's. Every other entry point runs as a module from the repository root
(`python -m trainer.train`, `python -m datasets.cache`, `python -m bench.data_loading`), where
the root already comes first; the tests get it from pytest's `pythonpath` setting.
"""
from __future__ import annotations

import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]

if sys.path and Path(sys.path[0] or ".").resolve() == Path(__file__).resolve().parent:
    sys.path.pop(0)
if sys.path[:1] != [str(REPO_ROOT)]:
    sys.path.insert(0, str(REPO_ROOT))
