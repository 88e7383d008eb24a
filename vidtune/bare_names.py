"""A bare `import datasets` (or `trainer`, `tune`) from a clone's root is not vidtune's to answer.

The repository keeps its layers in the folders `datasets/`, `trainer/` and `tune/` (the product
spec fixes them), installed as `vidtune.datasets`, `vidtune.trainer` and `vidtune.tune`. Where
the clone's root is first on `sys.path` (Python started in that folder: `python -c`, `python -m
pytest`, a notebook), the folder would also be found under its bare name, and any library in
that process that imports Hugging Face's `datasets` would get vidtune's folder instead. Each
folder's `__init__.py` therefore hands a bare import over to the installed package of that name
(or raises `ModuleNotFoundError` naming the vidtune one), the way Python would have resolved it
without the clone on the path.
"""
from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

CLONE_ROOT = Path(__file__).resolve().parents[1]


def hand_over(name: str) -> ModuleType:
    """Load the package `name` from `sys.path` without the clone's root, and put it in
    `sys.modules[name]`, where the import system then finds it as the result of `import name`.
    Call only from one of the three folders' `__init__.py`, when imported under its bare name."""
    elsewhere = [p for p in sys.path if Path(p or os.getcwd()).resolve() != CLONE_ROOT]
    spec = importlib.machinery.PathFinder.find_spec(name, elsewhere)
    if spec is None or spec.loader is None:
        raise ModuleNotFoundError(
            f"No module named {name!r} (the folder {CLONE_ROOT / name} is vidtune's: "
            f"import it as vidtune.{name})", name=name)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module
