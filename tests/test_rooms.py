"""The rooms of docs/ARCHITECTURE.md hold against the code: the table under "The rooms" lists
every subpackage of `trainer/` and `tune/` (no more, no fewer), each room's "imports" are exactly
the rooms of its own layer its modules import (module-level or inside a function), each room
imports only rooms listed before it, and none holds more than 15 modules."""
from __future__ import annotations

import ast
import re

from test_imports import MODULES, REPO_ROOT, _imported

DOC = REPO_ROOT / "docs" / "ARCHITECTURE.md"
LAYERS = ("vidtune.trainer", "vidtune.tune")
MAX_MODULES = 15
ROW = re.compile(r"^\| `(vidtune\.(?:trainer|tune)\.\w+)` \| ([^|]*) \| (.*) \|$")


def documented_rooms() -> dict[str, list[str]]:
    """{room: the rooms of its layer it may import} in the table's order."""
    section = DOC.read_text().split("## The rooms", 1)[1]
    rooms = {}
    for line in section.splitlines():
        if m := ROW.match(line):
            layer = m.group(1).rpartition(".")[0]
            names = [n.strip() for n in m.group(2).split(",") if n.strip() not in ("", "-")]
            rooms[m.group(1)] = [f"{layer}.{n}" for n in names]
    return rooms


def room_of(module: str) -> str | None:
    """`vidtune.tune.outputs.console` -> `vidtune.tune.outputs`; a hub module (`vidtune.tune.runner`)
    or a module outside the two layers -> None."""
    for layer in LAYERS:
        if module.startswith(layer + "."):
            parts = module[len(layer) + 1:].split(".")
            folder = REPO_ROOT / layer.split(".")[1] / parts[0]
            return f"{layer}.{parts[0]}" if folder.is_dir() else None
    return None


def code_rooms() -> dict[str, set[str]]:
    """{room on disk: the rooms of its own layer its modules import}."""
    rooms: dict[str, set[str]] = {}
    for name, file in MODULES.items():
        room = room_of(name)
        if room is None:
            continue
        rooms.setdefault(room, set())
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in _imported(node):
                    other = room_of(target)
                    if other and other != room and other.rpartition(".")[0] == room.rpartition(".")[0]:
                        rooms[room].add(other)
    return rooms


def test_the_table_lists_the_rooms_on_disk():
    assert set(documented_rooms()) == set(code_rooms())


def test_each_room_imports_what_the_table_says_and_nothing_after_it():
    documented, code = documented_rooms(), code_rooms()
    order = list(documented)
    wrong = [f"{room} imports {sorted(code[room])}, the table says {sorted(allowed)}"
             for room, allowed in documented.items() if set(allowed) != code.get(room)]
    assert not wrong, "docs/ARCHITECTURE.md's rooms disagree with the imports:\n" + "\n".join(wrong)
    upward = [f"{room} imports {other}" for room, allowed in documented.items() for other in allowed
              if order.index(other) > order.index(room)]
    assert not upward, "a room imports a room listed after it:\n" + "\n".join(upward)


def test_no_room_holds_more_than_15_modules():
    sizes = {room: sum(1 for name in MODULES if room_of(name) == room and name != room)
             for room in code_rooms()}
    assert all(n > 0 for n in sizes.values()), sizes
    assert max(sizes.values()) <= MAX_MODULES, sizes


def test_the_table_names_each_rooms_modules():
    """The "holds" column names every module of its room, and only those."""
    section = DOC.read_text().split("## The rooms", 1)[1]
    for line in section.splitlines():
        if m := ROW.match(line):
            room = m.group(1)
            named = set(re.findall(r"`(\w+)`", m.group(3)))
            on_disk = {name.rpartition(".")[2] for name in MODULES if room_of(name) == room and name != room}
            assert named == on_disk, (room, named ^ on_disk)


def test_no_room_imports_its_layers_hub():
    """The modules at the top of `tune/` (`search`, `preflight`, `runner`, `summary`, `best_model`)
    may import every room; no room imports them back (`tune.tracking` reads the end of a search as
    `tune.outputs.found.Summary`, not from `tune.summary`)."""
    up = []
    for name, file in MODULES.items():
        room = room_of(name)
        if room is None:
            continue
        layer = room.rpartition(".")[0]
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                up += [f"{name}:{node.lineno} imports {t}" for t in _imported(node)
                       if t.startswith(layer + ".") and room_of(t) is None]
    assert not up, "\n".join(up)
