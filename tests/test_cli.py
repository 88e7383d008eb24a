"""The `vidtune` command and the import names, as a user meets them from any folder.

Each case runs a fresh interpreter (the installed package, no PYTHONPATH) the way a user does:
from a temporary folder, or from the clone's root, where the folders `datasets/`, `trainer/` and
`tune/` sit beside the working directory.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from vidtune import cli

REPO_ROOT = Path(__file__).resolve().parents[1]
VIDTUNE = Path(sys.executable).with_name("vidtune")     # the console script beside this interpreter
HEAVY = ("ray", "torch", "mlflow", "optuna", "torchvision", "matplotlib")   # decord, av: milliseconds


def run(args: list[str], cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def test_every_subcommand_is_listed_with_its_summary(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    for name, command in cli.COMMANDS.items():
        assert f"  {name} " in out and command.summary in out


def test_an_unknown_command_is_refused_naming_it_and_the_choices(capsys):
    assert cli.main(["serch"]) == 2
    err = capsys.readouterr().err
    assert "unknown command 'serch'" in err and "search, demo, train" in err


def test_the_demo_refuses_a_data_folder_and_says_which_command_takes_one(capsys):
    assert cli.main(["demo", "--data", "/data/rwf"]) == 2
    err = capsys.readouterr().err
    assert "vidtune demo: error: --data:" in err and "vidtune search --data DIR" in err
    assert cli.main(["demo", "--data=/data/rwf"]) == 2


def test_a_bad_flag_of_a_subcommand_exits_2_with_the_subcommands_name(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["index", "/data/rwf", "--no-such-flag"])
    assert exc.value.code == 2
    assert "vidtune index: error: unrecognized arguments: --no-such-flag" in capsys.readouterr().err


HELP_PROBE = """
import json, sys
from vidtune.cli import main
try:
    main([{name!r}, "--help"])
except SystemExit:
    pass
print("LOADED=" + json.dumps(sorted({{m.split(".")[0] for m in sys.modules}} & set({heavy!r}))))
"""


@pytest.mark.parametrize("name", list(cli.COMMANDS))
def test_help_of_each_subcommand_loads_no_heavy_library(name, tmp_path):
    """`vidtune NAME --help` answers without Ray, torch or MLflow: at once, and with the prog name."""
    proc = run([sys.executable, "-c", HELP_PROBE.format(name=name, heavy=HEAVY)], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert f"usage: vidtune {'search' if name == 'demo' else name}" in proc.stdout
    loaded = json.loads(proc.stdout.rsplit("LOADED=", 1)[1])
    assert loaded == [], f"vidtune {name} --help imported {loaded}"


@pytest.mark.skipif(not VIDTUNE.exists(), reason="the vidtune console script is not installed here")
def test_the_console_script_runs_from_another_folder(tmp_path):
    proc = run([str(VIDTUNE), "train", "--help"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "usage: vidtune train" in proc.stdout and "--batch-size" in proc.stdout
    assert run([str(VIDTUNE), "--version"], cwd=tmp_path).stdout.startswith("vidtune ")


@pytest.mark.parametrize("args", [["--help"], ["--version"], ["search", "--help"]])
def test_output_into_a_closed_pipe_ends_quietly(args, tmp_path):
    """`vidtune --help | head -1`: the reader closes the pipe early. The command ends without a
    BrokenPipeError traceback. The pipe's read end is closed before the command starts, so its
    first write meets the closed pipe every time (no race with a real `head`)."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    try:
        proc = subprocess.run([sys.executable, "-m", "vidtune.cli", *args], cwd=tmp_path, env=env,
                              stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write_end)
    assert "Traceback" not in proc.stderr and "BrokenPipeError" not in proc.stderr, proc.stderr
    assert proc.returncode in (0, 1), proc.stderr


def test_module_runs_work_from_another_folder(tmp_path):
    proc = run([sys.executable, "-m", "vidtune.datasets.index", "--help"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "--positive-class" in proc.stdout


def test_the_search_script_by_path_from_another_folder(tmp_path):
    """`python tune/search.py` (the product spec's entry point) runs the installed module."""
    proc = run([sys.executable, str(REPO_ROOT / "tune" / "search.py"), "--help"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "usage: vidtune search" in proc.stdout and "--num-samples" in proc.stdout


SHOW_BOTH = ("import datasets, vidtune.datasets.index as ours; "
             "print('HF=' + datasets.__file__); print('OURS=' + ours.__file__)")


@pytest.mark.parametrize("where", ["tmp", "root"])
def test_hugging_face_datasets_and_ours_import_in_one_process(where, tmp_path):
    """From any folder, the clone's root included (its `datasets/` folder beside the working
    directory), `import datasets` is Hugging Face's and `vidtune.datasets` is ours."""
    proc = run([sys.executable, "-c", SHOW_BOTH], cwd=tmp_path if where == "tmp" else REPO_ROOT)
    assert proc.returncode == 0, proc.stderr
    lines = dict(line.split("=", 1) for line in proc.stdout.splitlines() if "=" in line)
    hf, ours = Path(lines["HF"]), Path(lines["OURS"])
    assert "site-packages" in hf.parts and hf.parent.name == "datasets"
    assert hf.parent != REPO_ROOT / "datasets"
    assert ours.parent.name == "datasets" and ours.name == "index.py"
    # Hugging Face's own submodules resolve inside its package, not in our folder
    proc = run([sys.executable, "-c", "import datasets.config as c; print(c.__file__)"], cwd=REPO_ROOT)
    assert proc.returncode == 0 and Path(proc.stdout.strip()).parent == hf.parent, proc.stderr


def test_a_bare_import_of_a_layer_from_the_root_runs_none_of_its_code():
    """The layer folders are namespace packages (no `__init__.py`): from the clone's root a bare
    `import tune` finds only an empty namespace, where an installed `tune` would win."""
    proc = run([sys.executable, "-c", "import tune, trainer; print(tune.__file__, list(tune.__path__), "
                "hasattr(trainer, 'models'))"], cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split()[0] == "None" and "False" in proc.stdout      # no module file, no code ran


def test_the_package_is_a_folder_static_tools_resolve():
    """vidtune/datasets, /trainer and /tune are links to the top-level folders, so a type checker,
    an IDE and Python's own import system see one package without an import hook."""
    for layer in ("datasets", "trainer", "tune"):
        link = REPO_ROOT / "vidtune" / layer
        assert link.is_symlink() and link.resolve() == REPO_ROOT / layer, link
        assert not (REPO_ROOT / layer / "__init__.py").exists()      # a namespace: HF's `datasets` wins
    finders = list(Path(sysconfig.get_paths()["purelib"]).glob("__editable__*vidtune*finder*.py"))
    assert not finders, f"an import-hook editable install ({finders}): run `make install` again"
