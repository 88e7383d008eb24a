"""A configuration field's command-line flag, defined once, beside the field.

The typed configurations (`datasets.config.DataConfig`, `trainer.config.TrainConfig`,
`tune.options.SearchOptions`) declare each field with `option(...)`: its default, flag, help text
and bounds. From that one definition come

- the argparse flags of every CLI that exposes the field (`add_flags`), with the same flag name
  in `python -m trainer.train` and `python tune/search.py`;
- the config file's keys (the flag without its dashes, `-` or `_`, or the field's dotted path)
  and their types (`coerce`); `read_config_file` is the one reader of both CLIs' `--config`
  (TOML or YAML, tables, the one `no-X` negation rule) and `ConfigFile.blame` names the file's
  key when a value it set fails a check;
- the nested dataclass built from flat `{dotted.path: value}` pairs (`build`);
- the range checks, whose errors name the flag (`check_bounds`, raising `ConfigError`).

Lives in the lowest layer (`datasets`) so the data configuration can use it; it imports nothing
of this project.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import re
import tomllib
import types
import typing
from collections.abc import Callable, Iterable
from dataclasses import MISSING, dataclass
from pathlib import Path
from typing import Any

import yaml

NO_PREFIX = "--no-"


class ConfigError(ValueError):
    """An option cannot be used. `flag` names it as the user gave it: a CLI flag, or a config
    file's key and file; the message says what to do."""

    def __init__(self, flag: str, message: str):
        super().__init__(f"{flag}: {message}")
        self.flag = flag


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
    """`--lr-min -1e-3` -> `--lr-min=-1e-3` for the number flags of `specs`, so a negative value
    reaches the range check (which names the flag and the rule) instead of argparse's "expected
    one argument": argparse takes a token that starts with '-' and is not a plain decimal for a flag."""
    numeric = {s.flag for s in specs if s.kind in ("int", "float")}
    out: list[str] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        if token in numeric and i + 1 < len(argv) and argv[i + 1].startswith("-") and _is_number(argv[i + 1]):
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


# The suffixes a config file may have, and the format each is read as. JSON is read by the YAML
# parser (JSON is YAML), so a search's best_config.json is one more YAML file.
FILE_FORMATS = {".json": "JSON", ".toml": "TOML", ".yaml": "YAML", ".yml": "YAML"}
CONFIG_SUFFIXES = (".toml", ".yaml", ".yml")


class _YamlLoader(yaml.SafeLoader):
    """PyYAML's safe loader, reading floats as YAML 1.2 and JSON do. PyYAML follows YAML 1.1,
    where a float needs a dot: `lr-min: 1e-5`, or `1e-05` as json.dumps writes it, would be the
    string '1e-05' and refused as not a number."""


_YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"))


def read_options_file(file: Path, *, suffixes: tuple[str, ...], instead: str, flag: str = "--config") -> Any:
    """The parsed config file: TOML, or YAML (JSON included) by its suffix, which must be one of
    `suffixes` (keys of FILE_FORMATS). ConfigError(flag) naming the file when it is not a file
    (the message suggests `instead`), of another type, or cannot be parsed."""
    if not file.is_file():
        raise ConfigError(flag, f"{file} is not a file; pass {instead}")
    suffix = file.suffix.lower()
    if suffix not in suffixes:
        raise ConfigError(flag, f"{file}: unknown file type {file.suffix or '(none)'!r}; use "
                          f"{', '.join(suffixes[:-1])} or {suffixes[-1]}")
    try:
        text = file.read_text(encoding="utf-8")
        if suffix == ".toml":
            return tomllib.loads(text)
        return yaml.load(text, Loader=_YamlLoader) or {}
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError, yaml.YAMLError) as e:
        detail = " ".join(str(e).split())[:300]
        raise ConfigError(flag, f"{file} cannot be read as {FILE_FORMATS[suffix]}: it cannot be parsed "
                          f"({detail}); fix the file or pass another") from None


@dataclass(frozen=True)
class ConfigFile:
    """A config file read by `read_config_file`. `values`: {dotted path: value} in the fields'
    types; `keys`: {dotted path: the key as written, its tables dotted in front
    (`train_config.data.root`)}; `about`: the file's other keys when its options sit in a
    `document` table (a search's best_config.json: the best trial's row), else None."""

    file: Path
    values: dict[str, Any] = dataclasses.field(default_factory=dict)
    keys: dict[str, str] = dataclasses.field(default_factory=dict)
    about: dict[str, Any] | None = None

    def blame(self, error: ConfigError, specs: Iterable[FlagSpec], given: Iterable[str]) -> ConfigError:
        """`error`, a check of the option its flag names, reworded to name this file's key when
        the value came from the file: no flag (`given`: the dotted paths set on the command line)
        overrode it. Other errors come back unchanged."""
        spec = next((s for s in specs if s.flag == error.flag), None)
        if spec is None or spec.path not in self.keys or spec.path in set(given):
            return error
        message = str(error)[len(error.flag) + 2:]
        return ConfigError(error.flag, f"{message} (set by {self.keys[spec.path]} in {self.file}: correct it "
                           f"there, or override it with {error.flag})")


def read_config_file(path: str | Path, specs: Iterable[FlagSpec], *, known: str, flag: str = "--config",
                     tables: Iterable[str] = (), document: str | None = None,
                     suffixes: tuple[str, ...] = CONFIG_SUFFIXES,
                     instead: str = "a .toml or .yaml file of options",
                     hints: dict[str, str] | None = None) -> ConfigFile:
    """Read a config file of the options `specs` declare: TOML or YAML by its suffix (`.json`,
    when among `suffixes`, reads as YAML).

    Keys: a flag without its dashes (`lr-min` or `lr_min`), or the field's dotted path as
    `to_dict()` names it (`grad_accum_steps`). The negation rule, the only one: a `--no-X` switch's
    key `no-X = true` sets the field false, its key `X` (or the field's name) sets it as written.
    Tables: a table named in `tables` (e.g. `[search]`) holds keys read like the top-level ones;
    a table named after a nested configuration (`[data]`, `[train.data]`) does too, its name put
    in front of a key first looked up as a path (so `cache_dir` in a `data` table is the field
    `data.cache_dir`, while `cache-dir` is the flag `--cache-dir`). `document`: when the file has
    that table (best_config.json's `train_config`), only it is read and the rest kept as `about`.

    Raises ConfigError(flag), the message starting with the file: unknown keys (all of them, with
    `hints[key]` when given, then `known`, which says what the keys may be), a value of the wrong
    type or null, two keys setting one option. Bounds are checked later, with the flags
    (`check_bounds`; `ConfigFile.blame` then names the key).
    """
    file = Path(path).expanduser()
    raw = read_options_file(file, suffixes=suffixes, instead=instead, flag=flag)
    if not isinstance(raw, dict):
        raise ConfigError(flag, f"{file} must hold an object of options (key: value), not "
                          f"{type(raw).__name__}")
    about = None
    if document is not None and document in raw:
        about, raw = {k: v for k, v in raw.items() if k != document}, raw[document]
        if not isinstance(raw, dict):
            raise ConfigError(flag, f"{file}: {document} must be an object of options, not "
                              f"{type(raw).__name__}")
        raw = {document: raw}
        tables = (document,)
    specs = list(specs)
    by_path = {s.path: s for s in specs}
    by_key = {k: s for s in specs for k in s.keys}
    nested = {s.path.rsplit(".", i)[0] for s in specs for i in range(1, s.path.count(".") + 1)}
    roots = set(tables)
    loaded = ConfigFile(file=file, about=about)
    unknown: list[str] = []

    def read(table: dict[Any, Any], prefix: str, label: str) -> None:
        for key, value in table.items():
            key = str(key)
            if isinstance(value, dict) and not prefix and not label and key in roots:
                read(value, "", f"{key}.")
            elif isinstance(value, dict) and prefix + key in nested:
                read(value, f"{prefix}{key}.", f"{label}{key}.")
            elif prefix + key in by_path:
                put(by_path[prefix + key], key, label + key, value, flag_key=False)
            elif key in by_key:
                put(by_key[key], key, label + key, value, flag_key=True)
            else:
                unknown.append(label + key)

    def put(spec: FlagSpec, key: str, label: str, value: Any, *, flag_key: bool) -> None:
        value = _typed(spec, value, f"{file}: {label} (in the file, for {spec.flag})", flag)
        if flag_key and spec.negated and key in spec.keys[:2]:       # `no-cache = true` is clip_cache false
            value = not value
        if spec.path in loaded.values:
            raise ConfigError(flag, f"{file}: {loaded.keys[spec.path]} and {label} both set {spec.flag}; "
                              "keep one")
        loaded.values[spec.path], loaded.keys[spec.path] = value, label

    read(raw, "", "")
    if unknown:
        hints = hints or {}
        said = dict.fromkeys(hints[k.rsplit(".", 1)[-1]] for k in unknown if k.rsplit(".", 1)[-1] in hints)
        what = "option" if len(unknown) == 1 else "options"
        raise ConfigError(flag, f"{file}: unknown {what} {', '.join(map(repr, unknown))} in the file"
                          + "".join(f"; {h}" for h in said) + f"; {known}")
    return loaded


def _typed(spec: FlagSpec, value: Any, where: str, flag: str) -> Any:
    """A config file's value in the field's type, or ConfigError(flag) saying `where` it is."""
    if value is None and not spec.optional:
        raise ConfigError(flag, f"{where}: got null; give a value, or leave the key out for the default")
    if spec.kind == "str" and isinstance(value, (bool, list, dict)):
        raise ConfigError(flag, f"{where}: got {value!r}; give a string")
    try:
        return coerce(spec, value, where)
    except ConfigError as e:
        raise ConfigError(flag, str(e)) from None


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
