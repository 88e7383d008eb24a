"""The one reader of both CLIs' `--config` file (`vidtune train`, `vidtune search`):
TOML or YAML (JSON included, as YAML), keys as the flags or the fields' dotted paths, tables, the
one `no-X` negation rule; `ConfigFile.blame` names the file's key when a value it set fails a
check. The keys and types come from the fields' declarations (`vidtune.flags`).
"""
from __future__ import annotations

import dataclasses
import re
import tomllib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from vidtune.flags import ConfigError, FlagSpec, coerce

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
