"""A researcher's own model: `--model package.module:function` or `--model path/to/file.py:function`.

The function is a factory, `function(num_classes=2) -> nn.Module`, whose module maps float
`B x 3 x T x H x W` clips (normalised by its spec) to `B x num_classes` logits; its input spec is
the function's `input_spec` attribute (`vidtune.own_model_spec.video_model` sets it). Here: the
factory imported by name (`load`), its spec read and checked, and where its code is, which is
what Ray ships to every worker (`modules_to_ship`, `runtime_env={"py_modules": [...]}`) and what a
logged MLflow model carries (`code_location`, `code_paths`). A module installed in site-packages
needs neither: every node has it.

Imports as uvicorn does `module:app`: the current folder first on `sys.path` (a console script's
`sys.path` does not hold it), so `mymodels:build` beside the user imports; a file path puts its
folder there instead. On a Ray worker and in a process loading a registered model, the module is
importable by its name from the copy Ray or MLflow put on `sys.path`.

No torch here (the user's module brings it): `trainer.ray_setup.launch` reads what to ship without loading
it. The checks that build the model (an `nn.Module`, one clip's output shape) are
`trainer.training.model_checks`', on the driver before Ray starts. Errors are `OwnModelError` (a
ValueError, as for an unknown model name), one line naming the factory and what to do.
"""
from __future__ import annotations

import importlib
import os
import site
import sys
import sysconfig
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from vidtune.own_model_spec import SPEC_ATTRIBUTE, checked_input_spec

SEPARATOR = ":"
EXAMPLE = "mymodels:build"
SPEC_HINT = ("decorate it with @vidtune.video_model(num_frames=..., height=..., width=...), or set its "
             "input_spec = {'num_frames': 16, 'height': 112, 'width': 112} (mean and std optional)")
# Never shipped: vidtune itself, installed on every node (site-packages and the standard library
# are set apart by where they are: `_installed`).
NOT_SHIPPED = ("vidtune",)


class OwnModelError(ValueError):
    """An own model that cannot be used; the message names the factory and says what to do."""


@dataclass(frozen=True)
class FactoryName:
    """`--model`'s `target:attribute`: a dotted module name or a `.py` file's path, and the
    factory's (dotted) name inside it."""

    text: str
    target: str
    attribute: str

    @property
    def is_file(self) -> bool:
        return self.target.endswith(".py") or "/" in self.target or os.sep in self.target

    @property
    def module(self) -> str:
        """The module's import name: the file's stem for a path."""
        return Path(self.target).stem if self.is_file else self.target


def is_factory_name(name: str) -> bool:
    """Whether `--model name` names a factory (`module:function`) rather than a registry model; an
    `hf:` name is set apart first (`trainer.models.registry.is_own_model`)."""
    return SEPARATOR in name


def parse(name: str) -> FactoryName:
    """`name` split into module and factory; OwnModelError when either part is not a name."""
    target, _, attribute = name.rpartition(SEPARATOR)
    ref = FactoryName(name, target.strip(), attribute.strip())
    names_ok = all(p.isidentifier() for p in ref.attribute.split("."))
    module_ok = ref.is_file or all(p.isidentifier() for p in ref.target.split("."))
    if not ref.target or not names_ok or not module_ok or (ref.is_file and not ref.module.isidentifier()):
        raise OwnModelError(f"own model {name!r}: write it as package.module:function (e.g. {EXAMPLE}) or "
                            "path/to/file.py:function, the file's name a Python identifier")
    return ref


def load(name: str) -> tuple[Callable[..., Any], dict[str, Any]]:
    """The factory `name` names and its checked input spec (`checked_input_spec`'s dict). Imports
    its module (the current folder first on sys.path) and remembers what to ship for it
    (`modules_to_ship`). OwnModelError naming the factory and what to do."""
    ref = parse(name)
    module = _import(ref)
    factory: Any = module
    for part in ref.attribute.split("."):
        try:
            factory = getattr(factory, part)
        except AttributeError:
            raise OwnModelError(f"own model {name}: module {module.__name__} ({_where(module)}) has no "
                                f"{ref.attribute!r}; define def {ref.attribute.split('.')[-1]}"
                                "(num_classes=2) there, or fix the name after ':'") from None
    if not callable(factory):
        raise OwnModelError(f"own model {name}: {ref.attribute} is not callable (its type: "
                            f"{type(factory).__name__}); name a factory function(num_classes=2) -> "
                            "nn.Module after ':'")
    raw = getattr(factory, SPEC_ATTRIBUTE, None)
    if raw is None:
        raise OwnModelError(f"own model {name}: {ref.attribute} has no input spec; {SPEC_HINT}")
    try:
        spec = checked_input_spec(raw)
    except ValueError as e:
        raise OwnModelError(f"own model {name}: its input_spec {e}") from None
    location = code_location(module, name)
    if location is not None:
        _TO_SHIP[name] = location
    else:
        _TO_SHIP.pop(name, None)
    return factory, spec


def _import(ref: FactoryName) -> ModuleType:
    if ref.is_file:
        path = Path(ref.target).expanduser()
        # Absent on a Ray worker or in a process loading a registered model: there the shipped copy
        # is importable by the module's name.
        if path.is_file():
            _first_on_path(str(path.resolve().parent))
    else:
        _first_on_path(os.getcwd())
    importlib.invalidate_caches()    # a module written since this process last looked (a notebook)
    try:
        module = _fresh(importlib.import_module(ref.module))
    except ModuleNotFoundError as e:
        if e.name and (ref.module == e.name or ref.module.startswith(e.name + ".")):
            raise OwnModelError(f"own model {ref.text}: {_not_found(ref)}") from None
        raise OwnModelError(f"own model {ref.text}: importing {ref.module} failed ({one_line(e)}); "
                            "install what it imports, or fix the module") from None
    except Exception as e:  # noqa: BLE001 - the user's module may raise anything as it loads
        raise OwnModelError(f"own model {ref.text}: importing {ref.module} failed ({one_line(e)}); "
                            f"fix the module (python -c 'import {ref.module}' shows where)") from None
    if ref.is_file and Path(ref.target).expanduser().is_file():
        wanted, got = Path(ref.target).expanduser().resolve(), getattr(module, "__file__", None)
        if got is None or Path(got).resolve() != wanted:
            raise OwnModelError(f"own model {ref.text}: the name {ref.module} is taken by another module "
                                f"({_where(module)}); rename {wanted.name}")
    return module


_SEEN: dict[str, int] = {}   # module name -> its file's mtime (ns) when this process first loaded it


def _fresh(module: ModuleType) -> ModuleType:
    """`module`, imported again when its file changed since this process loaded it: a notebook that
    edits mymodels.py between two searches checks the code Ray ships (the file as it is now)."""
    file = getattr(module, "__file__", None)
    try:
        mtime = os.stat(file).st_mtime_ns if file else None
    except OSError:
        return module
    if mtime is None or _SEEN.setdefault(module.__name__, mtime) == mtime:
        return module
    _SEEN[module.__name__] = mtime
    return importlib.reload(module)


def _first_on_path(folder: str) -> None:
    if folder not in sys.path:
        sys.path.insert(0, folder)


def _not_found(ref: FactoryName) -> str:
    if ref.is_file:
        return (f"no file {ref.target} (from {os.getcwd()}); pass the path of the .py file, or "
                "package.module:function")
    return (f"no module named {ref.module} in the current folder ({os.getcwd()}) or on sys.path; run from "
            f"the folder that holds {ref.module.split('.')[0]}, install it (pip install -e), or pass "
            "path/to/file.py:function")


def one_line(e: BaseException) -> str:
    """`Type: first line of the message` of an error raised by the user's code."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:200]}" if text else type(e).__name__


def _where(module: ModuleType) -> str:
    return getattr(module, "__file__", None) or "built in"


# -- where the code is: what Ray ships, what an MLflow model carries ---------------------------

_TO_SHIP: dict[str, Path] = {}   # model name -> file or folder, for the factories this process loaded


def code_location(module: ModuleType, name: str) -> Path | None:
    """What another machine needs to import `module`: its file (a top-level, single-file module)
    or its top-level package's folder; None when it is installed there already (site-packages,
    the standard library, vidtune). OwnModelError for a package split over several folders."""
    top_name = module.__name__.partition(".")[0]
    top = sys.modules.get(top_name, module)
    if top_name in NOT_SHIPPED:
        return None
    folders = list(getattr(top, "__path__", None) or [])
    if len(folders) > 1:
        raise OwnModelError(f"own model {name}: package {top_name} spans {len(folders)} folders "
                            f"({', '.join(folders)}), which Ray cannot ship to its workers as one; install "
                            "it on every node (pip install), or make it one folder")
    where = folders[0] if folders else getattr(top, "__file__", None)
    if where is None:
        return None
    path = Path(where).resolve()
    return None if _installed(path) else path


def _installed(path: Path) -> bool:
    paths = sysconfig.get_paths()
    roots = {*(paths[k] for k in ("purelib", "platlib", "stdlib", "platstdlib")), *site.getsitepackages()}
    if site.ENABLE_USER_SITE:
        roots.add(site.getusersitepackages())
    return any(path.is_relative_to(Path(root).resolve()) for root in roots if root)


def modules_to_ship() -> list[str]:
    """The files and folders of the own models this process loaded that Ray workers cannot import
    without them: `runtime_env={"py_modules": ...}` (`trainer.ray_setup.launch.worker_runtime_env`)."""
    return sorted({str(p) for p in _TO_SHIP.values() if p.exists()})


def code_paths(name: str) -> list[str]:
    """What a logged MLflow model of own model `name` carries (`code_paths`), so that it loads in a
    process where the module is not importable: [file or folder], or [] when it is installed."""
    load(name)
    location = _TO_SHIP.get(name)
    return [str(location)] if location is not None else []
