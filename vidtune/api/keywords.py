"""How the Python API reads its keywords: each named as its command's flag with underscores,
typed and checked by the flags' own declarations (`vidtune.flags`), and the errors of the checks
the command shares said in Python's terms (the keyword first, then its flag). A model factory
given as a function is recorded by its importable name."""
from __future__ import annotations

import contextlib
import difflib
import os
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from vidtune.errors import ConfigError
from vidtune.flags import FlagSpec, coerce

OPTIONS_DOC = "docs/options.md lists them; `vidtune search --help` (`vidtune train --help`) prints the same"


_IMPORTABLE = re.compile(r"^[A-Za-z_][\w.]*$")


def model_reference(model: str | Callable[..., Any]) -> str:
    """`model` as `--model` takes it: a name as given, or a factory function as
    "package.module:function", the form recorded with the search so that a resume, `vidtune
    train --config best_config.json` and the registered model rebuild it. A function defined in
    `__main__` (a notebook cell, a script) has no importable name: ConfigError saying to move it
    into a module file."""
    if isinstance(model, str):
        return model
    if not callable(model):
        raise ConfigError("model", f"got {type(model).__name__}; give a model name (tiny, mvit_v2_s, "
                          "hf:ID), 'package.module:function', or the factory function itself")
    module, name = getattr(model, "__module__", None), getattr(model, "__qualname__", "")
    if module in (None, "__main__", "builtins") or not _IMPORTABLE.match(name):
        where = "a notebook cell or a script" if module == "__main__" else f"{module}"
        raise ConfigError("model", f"{getattr(model, '__name__', model)!r} is defined in {where}, where "
                          "Ray's workers, a resume and the registered model cannot import it again; put the "
                          "factory in a module file beside you (e.g. %%writefile mymodels.py in a notebook) "
                          "and pass model='mymodels:build' (docs/own-model.md)")
    return f"{module}:{name}"


def keyword_values(call: str, specs: Sequence[FlagSpec], keywords: Mapping[str, Any]) -> dict[str, Any]:
    """{dotted path: value} of `call`'s keywords: each named as its flag with underscores
    (`lr_min`), a `--no-X` switch also as `X=False`; values in the field's type (`coerce`, the
    config file's rules: a list or tuple for a list of integers, a path for a string).
    ConfigError naming the keyword for an unknown one (with the nearest known) or a wrong value."""
    by_key = {k: s for s in specs if s.path != "config" for k in s.keys if k.isidentifier()}
    values: dict[str, Any] = {}
    for key, value in keywords.items():
        spec = by_key.get(key)
        if spec is None:
            near = difflib.get_close_matches(key, list(by_key), n=1)
            raise ConfigError(key, f"{call}() has no option {key!r}" + (f" (did you mean {near[0]}?)" if near
                                                                         else "") + f"; {OPTIONS_DOC}")
        if isinstance(value, os.PathLike):
            value = os.fspath(value)
        if isinstance(value, tuple):
            value = list(value)
        label = f"{key} ({spec.flag})"
        if spec.kind == "str" and isinstance(value, (bool, list, dict)):
            raise ConfigError(label, f"got {value!r}; give a string")
        if value is None and not spec.optional:
            raise ConfigError(label, "got None; give a value, or leave it out for the default")
        try:
            value = coerce(spec, value, label)
        except ConfigError as e:
            raise ConfigError(label, str(e)[len(e.flag) + 2:]) from None
        if spec.negated and key == spec.keys[1]:    # no_early_stop=True: early_stop False
            value = not value
        if spec.path in values:
            raise ConfigError(label, f"set twice ({key} and another name of {spec.flag}); keep one")
        values[spec.path] = value
    return values


@contextlib.contextmanager
def python_terms(specs: Sequence[FlagSpec] | Mapping[str, str]) -> Iterator[None]:
    """Inside the block, a ConfigError naming a flag (`--lr-min: ...`, from the checks the command
    shares) is raised again naming the keyword first: `lr_min (--lr-min): ...`. `specs`: the flags
    of the call, or {flag: keyword}."""
    names = dict(specs) if isinstance(specs, Mapping) else \
        {s.flag: s.flag.lstrip("-").replace("-", "_") for s in specs}
    try:
        yield
    except ConfigError as e:
        parts = [names.get(flag) for flag in e.flag.split("/")]     # "--verbose/--quiet": two options
        if not all(parts) or e.flag.startswith(tuple(p for p in parts if p)):
            raise
        raise ConfigError(f"{'/'.join(map(str, parts))} ({e.flag})", str(e)[len(e.flag) + 2:]) from None
