"""The import structure: layers that only import to their left, no circles, imports at the top.

The layers are vidtune (the floor: flags, config file, errors, the command) <- vidtune.datasets
<- vidtune.trainer <- vidtune.tune <- vidtune.api (the Python API) <- bench: each package imports
only the packages to its left.
Two proofs that there is no import circle: the module-level import graph (read from the source,
`if TYPE_CHECKING:` blocks included, since a type-only circle is still two modules that cannot be
understood apart) has no cycle, and every module imports alone in a fresh interpreter.
Function-local imports are kept for optional or heavy-at-start dependencies only, each with its
reason on the line.
"""
from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
# Each layer, lowest first, with the folder it lives in (vidtune/datasets etc. link to these).
# A layer may import only those before it.
LAYER_FOLDERS = {"vidtune": "vidtune", "vidtune.datasets": "datasets", "vidtune.trainer": "trainer",
                 "vidtune.tune": "tune", "vidtune.api": "vidtune/api", "bench": "bench"}
LAYERS = tuple(LAYER_FOLDERS)
LIBRARY = LAYERS[:5]
# Function-local imports only where a module must stay light (a CLI's --help, a bad flag's
# refusal) or a dependency is optional; a module that mixes light and heavy halves is split
# instead (trainer.training.gpus / trainer.cluster.devices). Not to be raised: split the module.
# 18, not 15, since the rooms: three functions import from two rooms of one layer, one statement
# each (`vidtune predict`, `vidtune export-hf`, `tune.search.run_search`), at the same 15 places.
MAX_LOCAL_IMPORTS = 18
# A module (library or bench/) longer than this does two jobs: split it by job (tune.best_model
# left tune.runner; tune.config.option_groups left tune.config.options; bench.overhead_report left
# bench.search_overhead). Not to be raised.
MAX_LINES = 450


def layer_of(module: str) -> str:
    """The layer a dotted module name belongs to: its longest layer prefix."""
    return max((layer for layer in LAYERS if module == layer or module.startswith(layer + ".")), key=len)


def module_files() -> dict[str, Path]:
    """{dotted module name: file} of every module of the layers, subpackages included."""
    out = {}
    for package, folder in LAYER_FOLDERS.items():
        for file in sorted((REPO_ROOT / folder).rglob("*.py")):
            parts = file.relative_to(REPO_ROOT / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join((package, *parts))] = file
    return out


MODULES = module_files()


def _imported(node: ast.Import | ast.ImportFrom) -> list[str]:
    """The project modules an import statement names (`from vidtune.tune import space` names
    vidtune.tune.study.space; `from vidtune.flags import option` names vidtune.flags)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    elif node.level or node.module is None:
        return []
    else:
        names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
    found = []
    for name in names:
        while name and name not in MODULES:       # `vidtune.tune.study.space.x` -> vidtune.tune.study.space
            name = name.rpartition(".")[0]
        if name and name not in found:
            found.append(name)
    return found


def _module_level_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Imports that run when the module is imported: top-level statements, descending into
    `if` / `try` / `with` blocks (TYPE_CHECKING included) but not into functions or classes."""
    out: list[ast.Import | ast.ImportFrom] = []
    stack: list[ast.stmt] = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            out.append(node)
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            for field in ("body", "orelse", "finalbody", "handlers"):
                stack.extend(getattr(node, field, []) or [])
        elif isinstance(node, ast.ExceptHandler):
            stack.extend(node.body)
    return out


def import_graph() -> dict[str, set[str]]:
    """{module: the project modules it imports at module level}, a package's own __init__ aside."""
    graph = {}
    for name, file in MODULES.items():
        tree = ast.parse(file.read_text(), filename=str(file))
        targets = {t for node in _module_level_imports(tree) for t in _imported(node)}
        # a package's own __init__ (a layer's, a subpackage's) is not a dependency of its modules
        graph[name] = {t for t in targets if t != name and t not in LAYERS and not name.startswith(t + ".")}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as [a, b, ..., a], or None (depth-first search, colours)."""
    colour = dict.fromkeys(graph, 0)            # 0 new, 1 on the current path, 2 done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        colour[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if colour.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if colour.get(nxt) == 0:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        path.pop()
        colour[node] = 2
        return None

    for node in sorted(graph):
        if colour[node] == 0:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def test_find_cycle_finds_a_cycle_and_accepts_a_tree():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_the_import_graph_has_no_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def all_imports_graph() -> dict[str, set[str]]:
    """{module: the project modules it imports anywhere}: at module level, inside functions and in
    its `if __name__ == "__main__":` block. A function-local import still runs, later: a circle
    through one (a `python -m` entry whose `__main__` block imports a module that imports it back
    runs the module twice, as `__main__` and under its name) is still a circle."""
    graph = {}
    for name, file in MODULES.items():
        tree = ast.parse(file.read_text(), filename=str(file))
        targets = {t for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
                   for t in _imported(node)}
        graph[name] = {t for t in targets if t != name and t not in LAYERS and not name.startswith(t + ".")}
    return graph


def test_no_import_circle_even_through_function_local_imports():
    cycle = find_cycle(all_imports_graph())
    assert cycle is None, "import circle (counting function-local imports): " + " -> ".join(cycle)


def _main_block(tree: ast.Module) -> ast.If | None:
    """The module's `if __name__ == "__main__":` block, if any."""
    for node in tree.body:
        test = node.test if isinstance(node, ast.If) else None
        if (isinstance(test, ast.Compare) and isinstance(test.left, ast.Name) and test.left.id == "__name__"
                and isinstance(test.ops[0], ast.Eq) and isinstance(test.comparators[0], ast.Constant)
                and test.comparators[0].value == "__main__"):
            return node
    return None


def test_a_python_m_entry_runs_its_own_main():
    """A module's `__main__` block imports no project module: the `python -m` entry of a command
    lives in one module, the one whose `main` it runs (a block that imports another module's
    `main` is a second entry, and a circle when that module imports this one)."""
    wrong = []
    for name, file in MODULES.items():
        block = _main_block(ast.parse(file.read_text(), filename=str(file)))
        if block is None:
            continue
        for node in ast.walk(block):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                wrong += [f"{name}:{node.lineno} imports {t} in its __main__ block" for t in _imported(node)]
    assert not wrong, "\n".join(wrong)


def test_each_layer_imports_only_the_layers_before_it():
    wrong = []
    for module, targets in import_graph().items():
        allowed = LAYERS[:LAYERS.index(layer_of(module)) + 1]
        wrong += [f"{module} imports {t}" for t in sorted(targets) if layer_of(t) not in allowed]
    # function-local imports too: the layering is about what a module needs, not when
    for name, file in MODULES.items():
        allowed = LAYERS[:LAYERS.index(layer_of(name)) + 1]
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                wrong += [f"{name}:{node.lineno} imports {t}" for t in _imported(node)
                          if layer_of(t) not in allowed]
    assert not wrong, "imports that reach up a layer:\n" + "\n".join(sorted(set(wrong)))


def local_imports() -> list[tuple[str, int, str]]:
    """(file, line, source line) of each import inside a function of the library."""
    out = []
    for name, file in MODULES.items():
        if layer_of(name) not in LIBRARY:
            continue
        lines = file.read_text().splitlines()
        for node in ast.walk(ast.parse("\n".join(lines))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for inner in ast.walk(node):
                    if isinstance(inner, (ast.Import, ast.ImportFrom)):
                        out.append((str(file.relative_to(REPO_ROOT)), inner.lineno, lines[inner.lineno - 1]))
    return sorted(set(out))


def test_function_local_imports_are_few_and_say_why():
    found = local_imports()
    unexplained = [f"{f}:{n}: {line.strip()}" for f, n, line in found if "#" not in line]
    assert not unexplained, ("a function-local import needs its reason on the line (optional or heavy "
                             "at start), or belongs at the top:\n" + "\n".join(unexplained))
    assert len(found) <= MAX_LOCAL_IMPORTS, (
        f"{len(found)} function-local imports in the library (at most {MAX_LOCAL_IMPORTS}):\n"
        + "\n".join(f"{f}:{n}: {line.strip()}" for f, n, line in found))


# Imported before forking, so that each child pays only for the project's own modules. None of
# them imports this project (checked in the parent): a circle among our modules still shows.
THIRD_PARTY = ("numpy", "torch", "torchvision", "ray", "ray.train", "ray.train.torch", "ray.tune",
               "mlflow", "optuna", "matplotlib", "matplotlib.pyplot", "pandas", "yaml", "av", "decord")

ALONE = textwrap.dedent("""
    import importlib, os, sys, traceback
    for name in {third_party!r}:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    ours = [m for m in sys.modules if m.split(".")[0] in ("vidtune", "bench")]
    assert not ours, f"a third-party import loaded this project's modules: {{ours}}"
    failed = []
    for name in {modules!r}:
        pid = os.fork()
        if pid == 0:
            try:
                importlib.import_module(name)
            except BaseException:
                traceback.print_exc()
                os._exit(1)
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        if os.waitstatus_to_exitcode(status) != 0:
            failed.append(name)
    print("FAILED:", " ".join(failed))
    sys.exit(1 if failed else 0)
""")


@pytest.mark.slow   # a fresh interpreter with torch, Ray and MLflow, forked per module (10-17 s)
@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="needs fork")
def test_every_module_imports_alone_in_a_fresh_interpreter():
    """One fresh interpreter imports the third-party libraries, then forks once per project
    module: each child imports just that module, so a module that only imports after another
    (a circle, or a name defined late) fails here."""
    code = ALONE.format(third_party=THIRD_PARTY, modules=sorted(MODULES))
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]


def test_no_module_is_longer_than_the_cap():
    """The library's modules and bench/'s scripts and their helpers alike."""
    assert {layer_of(name) for name in MODULES} == set(LAYERS)          # bench/ included
    long = {f"{file.relative_to(REPO_ROOT)}: {n} lines"
            for file in MODULES.values()
            for n in [len(file.read_text().splitlines())] if n > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines:\n" + "\n".join(sorted(long))
