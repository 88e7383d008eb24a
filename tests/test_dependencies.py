"""pyproject.toml declares what the library imports, and nothing that nothing uses.

The library is the installed package: `vidtune/` and the three layer folders. Each third-party
top-level name it imports (anywhere: module level or inside a function) must belong to a
declared distribution, and each declared distribution must be imported, or be in `INDIRECT`
with the call that needs it (checked to still be in the source). A distribution of an optional
extra (`[project.optional-dependencies]`, the test extra aside) may be imported only where its
absence is handled: inside `try:` ... `except ImportError`.
"""
from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
LIBRARY_FOLDERS = ("vidtune", "datasets", "trainer", "tune")

# Declared, never imported by name: {distribution: (file, the call that needs it)}.
INDIRECT = {
    # Optuna's fANOVA parameter importance fits scikit-learn's random forests inside Optuna
    "scikit-learn": ("tune/outputs/importance.py", "FanovaImportanceEvaluator"),
    # torch.cuda.utilization reads GPU utilisation through NVML's Python bindings (pynvml)
    "nvidia-ml-py": ("trainer/training/utilization.py", "torch.cuda.utilization("),
}


def normalise(name: str) -> str:
    """A distribution name as PEP 503 compares them."""
    return re.sub(r"[-_.]+", "-", name).lower()


def declared() -> set[str]:
    """The distributions `[project] dependencies` names (extras and version ranges dropped)."""
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    return {normalise(re.split(r"[\[<>=!~; ]", req, maxsplit=1)[0]) for req in project["dependencies"]}


def optional_extras() -> set[str]:
    """The distributions of the optional extras users install (`vidtune[dashboard]`), not the tests'."""
    extras = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    return {normalise(re.split(r"[\[<>=!~; ]", req, maxsplit=1)[0])
            for name, reqs in extras.items() if name != "test" for req in reqs}


def _guarded_imports(tree: ast.Module) -> set[int]:
    """ids of the import nodes inside a `try:` whose handlers catch ImportError."""
    guarded: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Try) and any(
                isinstance(h.type, ast.Name) and h.type.id in ("ImportError", "ModuleNotFoundError")
                for h in node.handlers):
            guarded |= {id(n) for stmt in node.body for n in ast.walk(stmt)
                        if isinstance(n, (ast.Import, ast.ImportFrom))}
    return guarded


def imported_top_level_names(*, guarded: bool | None = None) -> dict[str, set[str]]:
    """{third-party top-level import name: the library files importing it}; `guarded` True: only
    imports whose absence is handled (`_guarded_imports`), False: only the others, None: all."""
    found: dict[str, set[str]] = {}
    for folder in LIBRARY_FOLDERS:
        for file in sorted((REPO_ROOT / folder).rglob("*.py")):
            tree = ast.parse(file.read_text(), filename=str(file))
            handled = _guarded_imports(tree)
            for node in ast.walk(tree):
                if guarded is not None and (id(node) in handled) != guarded:
                    continue
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    top = name.split(".")[0]
                    if top not in sys.stdlib_module_names and top != "vidtune":
                        found.setdefault(top, set()).add(str(file.relative_to(REPO_ROOT)))
    return found


def missing_declarations(deps: set[str], optional: set[str] = frozenset()) -> list[str]:
    """Third-party names the library imports whose distribution is not in `deps`, or, for an
    import whose absence is handled, in `optional` either."""
    providers = importlib.metadata.packages_distributions()
    missing = []
    for kind, allowed in ((False, deps), (True, deps | optional)):
        for name, files in sorted(imported_top_level_names(guarded=kind).items()):
            dists = {normalise(d) for d in providers.get(name, [])}
            assert dists, f"{name} (imported by {sorted(files)}) is not installed here"
            if not dists & allowed:
                missing.append(f"{name} (distribution {'/'.join(sorted(dists))}), imported by "
                               f"{sorted(files)}")
    return missing


def unused_declarations(deps: set[str]) -> list[str]:
    """Distributions in `deps` the library neither imports nor needs for a call in INDIRECT."""
    providers = importlib.metadata.packages_distributions()
    used = {normalise(d) for name in imported_top_level_names() for d in providers.get(name, [])}
    return sorted(deps - used - set(INDIRECT))


def test_every_imported_package_is_declared():
    missing = missing_declarations(declared(), optional_extras())
    assert not missing, "imported but not in pyproject.toml's dependencies:\n" + "\n".join(missing)


def test_every_declared_package_is_imported_or_needed_by_a_call_we_make():
    unused = unused_declarations(declared() | optional_extras())
    assert not unused, f"declared in pyproject.toml but imported nowhere in the library: {unused}"
    for dist, (file, call) in INDIRECT.items():
        assert dist in declared(), f"INDIRECT lists {dist}, which pyproject.toml no longer declares"
        assert call in (REPO_ROOT / file).read_text(), (
            f"{dist} is declared for {call} in {file}, which no longer makes that call")


def test_the_checks_catch_a_missing_and_an_unused_declaration():
    deps = declared()
    assert [m.split(" ")[0] for m in missing_declarations(deps - {"pyyaml"}, optional_extras())] == ["yaml"]
    # an optional extra's package, imported where its absence is handled: declared by the extra
    assert [m.split(" ")[0] for m in missing_declarations(deps)] == ["optuna_dashboard"]
    assert not missing_declarations(deps, optional_extras())
    assert unused_declarations(deps | {"polars"}) == ["polars"]
