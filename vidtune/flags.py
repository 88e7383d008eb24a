"""A configuration field's command-line flag, defined once, beside the field.

The typed configurations (`vidtune.datasets.config.DataConfig`, `vidtune.trainer.training.config.TrainConfig`,
`vidtune.tune.config.options.SearchOptions`) declare each field with `option(...)`: its default, flag, help
text
and bounds. From that one definition come

- the argparse flags of every CLI that exposes the field (`add_flags`), with the same flag name
  in `vidtune train` and `vidtune search`;
- the config file's keys (the flag without its dashes, `-` or `_`, or the field's dotted path)
  and their types (`coerce`), which `vidtune.config_file.read_config_file`, the one reader of
  both CLIs' `--config`, reads;
- the nested dataclass built from flat `{dotted.path: value}` pairs (`build`);
- the range checks, whose errors name the flag (`check_bounds`, raising `ConfigError`).

Lives on the floor under the three layers (`vidtune`, beside `config_file` and `errors`), so the
data, training and search configurations all use it; it imports nothing of this project but
`vidtune.errors` (its `ConfigError`).
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import types
import typing
from collections.abc import Callable, Iterable
from dataclasses import MISSING, dataclass
from typing import Any

from vidtune.errors import ConfigError  # declared there; the configurations import it from here too

NO_PREFIX = "--no-"


def option(default: Any = MISSING, *, flag: str, help: str, metavar: str | None = None,
           choices: Iterable[str] | None = None, default_factory: Any = MISSING,
           ge: float | None = None, gt: float | None = None, lt: float | None = None,
           group: str | None = None) -> Any:
    """A dataclass field with its flag. A bool field whose flag starts with `--no-` is switched
    off by the flag; any other bool is switched on. `ge`/`gt`/`lt`: bounds `check_bounds`
    enforces (None values, meaning "decide later", are not checked). `group`: the help section,
    when not the one the caller gives the field's class."""
    meta = {"flag": flag, "help": help, "metavar": metavar, "choices": tuple(choices) if choices else None,
            "ge": ge, "gt": gt, "lt": lt, "group": group}
    if default_factory is not MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


@dataclass(frozen=True)
class FlagSpec:
    """One flag-backed field. `path` is its dotted place in the configuration (`data.height`)."""

    path: str
    flag: str
    kind: str                  # bool | int | float | str | int_list
    optional: bool             # None is a valid value ("decide from the model / hardware")
    default: Any
    help: str
    owner: type                # the dataclass declaring it
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    ge: float | None = None
    gt: float | None = None
    lt: float | None = None
    group: str | None = None

    @property
    def negated(self) -> bool:
        return self.kind == "bool" and self.flag.startswith(NO_PREFIX)

    @property
    def keys(self) -> tuple[str, ...]:
        """The config-file keys of this field (`lr-min`, `lr_min`; `no-cache` or `cache` = false)."""
        name = self.flag.lstrip("-")
        keys = [name, name.replace("-", "_")]
        if self.negated:
            base = name[len("no-"):]
            keys += [base, base.replace("-", "_")]
        return tuple(dict.fromkeys(keys))


def _kind(annotation: Any) -> tuple[str, bool]:
    """(kind, optional) of a field's resolved type annotation."""
    args = typing.get_args(annotation)
    optional = type(None) in args
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        annotation = next(a for a in args if a is not type(None))
    if typing.get_origin(annotation) is tuple:
        return "int_list", optional
    names = {bool: "bool", int: "int", float: "float", str: "str"}
    if annotation not in names:
        raise TypeError(f"no flag kind for type {annotation!r}")
    return names[annotation], optional


def flag_specs(cls: type, *, exclude: Iterable[str] = (), prefix: str = "") -> list[FlagSpec]:
    """Every flag-backed field of `cls` and of the dataclasses nested in it, in declaration
    order. `exclude`: dotted paths left out (e.g. the fields a search varies itself)."""
    exclude = set(exclude)
    hints = typing.get_type_hints(cls)
    specs: list[FlagSpec] = []
    for f in dataclasses.fields(cls):
        path = prefix + f.name
        if path in exclude:
            continue
        if dataclasses.is_dataclass(hints[f.name]):
            specs += flag_specs(hints[f.name], exclude=exclude, prefix=path + ".")
            continue
        if "flag" not in f.metadata:
            continue
        m = f.metadata
        kind, optional = _kind(hints[f.name])
        default = f.default if f.default is not MISSING else f.default_factory()
        specs.append(FlagSpec(path=path, flag=m["flag"], kind=kind, optional=optional, default=default,
                              help=m["help"], owner=cls, metavar=m["metavar"], choices=m["choices"],
                              ge=m["ge"], gt=m["gt"], lt=m["lt"], group=m["group"]))
    return specs


def parse_int_list(text: str) -> tuple[int, ...]:
    """'4, 8,16' -> (4, 8, 16). argparse's type for int_list flags."""
    parts = [p.strip() for p in str(text).split(",") if p.strip()]
    try:
        return tuple(int(p) for p in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of integers (e.g. 4,8,16)") from None


def _number(kind: str) -> Callable[[str], Any]:
    """argparse type of a number flag that also reads negative values (`--lr-min -1e-3`) as the
    value, so the range check, not argparse, tells the user what is wrong."""
    convert = int if kind == "int" else float

    def parse(text: str) -> Any:
        try:
            return convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not {'an integer' if kind == 'int' else 'a number'}") from None

    parse.__name__ = kind
    return parse


def add_flags(parser: argparse.ArgumentParser, specs: Iterable[FlagSpec], *,
              group_of: Callable[[FlagSpec], str], defaults: dict[str, Any] | None = None,
              suppress: bool = True) -> None:
    """Add one argparse flag per spec, `dest` its dotted path, under the help section
    `group_of(spec)` names (created on first use, in order). `defaults`: {path: value} shown in
    the help instead of the field's default (a CLI's preset). `suppress`: leave flags not given
    out of the namespace (so a config file can fill them) instead of setting the default."""
    groups: dict[str, Any] = {}
    shown = defaults or {}
    for s in specs:
        title = s.group or group_of(s)
        if title not in groups:
            groups[title] = parser.add_argument_group(title)
        default = shown.get(s.path, s.default)
        help_text = s.help
        if "default" not in help_text and default not in (None, "") and s.kind != "bool":
            value = ",".join(map(str, default)) if isinstance(default, tuple) else default
            help_text += f" (default {value})"
        kw: dict[str, Any] = {"dest": s.path, "help": help_text}
        kw["default"] = argparse.SUPPRESS if suppress else default
        if s.kind == "bool":
            kw["action"] = "store_false" if s.negated else "store_true"
        else:
            kw["metavar"] = s.metavar
            if s.choices:
                kw["choices"] = s.choices
            kw["type"] = {"int": _number("int"), "float": _number("float"), "str": str,
                          "int_list": parse_int_list}[s.kind]
        groups[title].add_argument(s.flag, **kw)


def join_negative_values(argv: list[str], specs: Iterable[FlagSpec]) -> list[str]:
    """`--lr-min -1e-3` -> `--lr-min=-1e-3` (and `--time-budget -5m` -> `--time-budget=-5m`) for
    the value flags of `specs`, so a negative value reaches the flag's own check (which names the
    flag and the rule) instead of argparse's "expected one argument": argparse takes a token that
    starts with '-' and is not a plain decimal for a flag. A token starting with '-' and a digit
    is never a flag."""
    numeric = {s.flag for s in specs if s.kind in ("int", "float")}
    text = {s.flag for s in specs if s.kind == "str"}
    out: list[str] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        value = argv[i + 1] if i + 1 < len(argv) else ""
        if (token in numeric and value.startswith("-") and _is_number(value)) or \
                (token in text and value[:1] == "-" and value[1:2].isdigit()):
            out.append(f"{token}={argv[i + 1]}")
            i += 2
            continue
        out.append(token)
        i += 1
    return out


def _is_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


def coerce(spec: FlagSpec, value: Any, where: str) -> Any:
    """A config-file value in the field's type (TOML/YAML give ints for floats, lists for
    tuples). `where` names the key and file in the ConfigError."""
    if value is None and spec.optional:
        return None
    if spec.kind == "int_list":
        if isinstance(value, str):
            try:
                return parse_int_list(value)
            except argparse.ArgumentTypeError as e:
                raise ConfigError(where, str(e)) from None
        if isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            return tuple(value)
        raise ConfigError(where, f"got {value!r}; give a list of integers such as [4, 8, 16]")
    if spec.kind == "bool":
        if isinstance(value, bool):
            return value
        raise ConfigError(where, f"got {value!r}; give true or false")
    if spec.kind == "float":
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(where, f"got {value!r}; give a number")
    if spec.kind == "int":
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(where, f"got {value!r}; give an integer")
    if spec.choices and str(value) not in spec.choices:
        raise ConfigError(where, f"got {value!r}; choose one of {', '.join(spec.choices)}")
    return str(value)


def build(cls: type, values: dict[str, Any], *, prefix: str = "") -> Any:
    """The (nested) dataclass `cls` from flat {dotted path: value} pairs; absent paths keep the
    defaults. Unknown paths raise KeyError (a bug: the flags come from the same fields)."""
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    used = set()
    for f in dataclasses.fields(cls):
        path = prefix + f.name
        if dataclasses.is_dataclass(hints[f.name]):
            nested = {k: v for k, v in values.items() if k.startswith(path + ".")}
            kwargs[f.name] = build(hints[f.name], nested, prefix=path + ".")
            used |= set(nested)
        elif path in values:
            kwargs[f.name] = values[path]
            used.add(path)
    unknown = set(values) - used
    if unknown:
        raise KeyError(f"unknown option path(s) {sorted(unknown)} for {cls.__name__}")
    return cls(**kwargs)


def get_path(obj: Any, path: str) -> Any:
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def flag_of(specs: Iterable[FlagSpec], path: str) -> str:
    """The flag of the field at `path` (e.g. "data.height" -> "--height")."""
    return next(s.flag for s in specs if s.path == path)


def check_bounds(obj: Any, specs: Iterable[FlagSpec]) -> None:
    """Raise ConfigError naming the flag of the first value outside its declared bounds, or not
    among its choices. None (decided later) passes."""
    for s in specs:
        value = get_path(obj, s.path)
        if value is None:
            continue
        if s.choices and value not in s.choices:
            raise ConfigError(s.flag, f"got {value!r}; choose one of {', '.join(s.choices)}")
        numbers = value if isinstance(value, tuple) else (value,)
        if s.kind not in ("int", "float", "int_list"):
            continue
        for v in numbers:
            ok = math.isfinite(v) and (s.ge is None or v >= s.ge) and (s.gt is None or v > s.gt) \
                and (s.lt is None or v < s.lt)
            if not ok:
                raise ConfigError(s.flag, f"got {_show(value)}; it must be {_rule(s)}")
        if s.kind == "int_list" and not value:
            raise ConfigError(s.flag, f"got an empty list; it must be {_rule(s)}")


def _show(value: Any) -> str:
    return ",".join(map(str, value)) if isinstance(value, tuple) else repr(value)


def _rule(s: FlagSpec) -> str:
    what = {"int": "an integer", "float": "a number",
            "int_list": "a comma-separated list of integers"}[s.kind]
    parts = [f">= {s.ge:g}" if s.ge is not None else "", f"> {s.gt:g}" if s.gt is not None else "",
             f"< {s.lt:g}" if s.lt is not None else ""]
    bounds = " and ".join(p for p in parts if p)
    if s.kind == "int_list":
        return f"{what}, each {bounds}" if bounds else what
    return f"{what} {bounds}".strip()


def check_folder_name(flag: str, name: str, *, what: str, under: str, example: str) -> None:
    """`name` is one folder's name under `under` (the folder the option places `what` in): never a
    path that leaves it (`../x`, `/etc`, `a/b`), nor empty or padded. ConfigError naming `flag`."""
    if name in ("", ".", "..") or any(c in name for c in "/\\\0") or name != name.strip():
        raise ConfigError(flag, f"{name!r} is not a folder name: {what} is {under}/NAME, so give "
                          f"one name without '/', '\\', '..' or surrounding spaces (e.g. {example})")
