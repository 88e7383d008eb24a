"""vidtune.tune.running.ray_internals and vidtune.trainer.cluster.torch_trainer: the two modules allowed to
touch Ray's
private APIs, and their version check (vidtune.ray_version)."""
from __future__ import annotations

import ast
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from vidtune.tune.running import ray_internals

REPO_ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("datasets", "trainer", "tune", "bench")
# The search's uses, and the trainer layer's one (it cannot import from tune/).
FENCES = (REPO_ROOT / "tune" / "running" / "ray_internals.py",
          REPO_ROOT / "trainer" / "cluster" / "torch_trainer.py")

# Private attributes of Ray objects that vidtune has used (ResultGrid, OptunaSearch); an access to
# any of them, or to any `_name` module of the `ray` package, belongs in tune/running/ray_internals.py.
PRIVATE_RAY_ATTRS = {"_experiment_analysis", "_ot_trials", "_ot_study", "_completed_trials",
                     "_raylet", "_private", "_internal", "_common"}


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_ray_uses(source: str, filename: str = "<string>") -> list[str]:
    """`line: what` for each private Ray API the Python source touches."""
    found: list[str] = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            parts = node.module.split(".")
            if parts[0] == "ray" and (any(map(_is_private, parts)) or
                                      (len(parts) == 1 and any(_is_private(a.name) for a in node.names))):
                names = ", ".join(a.name for a in node.names)
                found.append(f"{node.lineno}: from {node.module} import {names}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "ray" and any(map(_is_private, parts)):
                    found.append(f"{node.lineno}: import {alias.name}")
        elif isinstance(node, ast.Attribute):
            on_ray = isinstance(node.value, ast.Name) and node.value.id == "ray"
            if node.attr in PRIVATE_RAY_ATTRS or (on_ray and _is_private(node.attr)):
                found.append(f"{node.lineno}: .{node.attr}")
        elif isinstance(node, ast.Constant) and node.value in PRIVATE_RAY_ATTRS:   # getattr(x, "_...")
            found.append(f"{node.lineno}: {node.value!r}")
    return found


def test_scanner_finds_each_kind_of_private_use():
    source = "\n".join([
        "import ray",
        "from ray.train.v2._internal.execution.callback import WorkerGroupCallback",
        "from ray._raylet import PlacementGroupID",
        "import ray._private.services",
        "from ray import _private",
        "trials = results._experiment_analysis.trials",
        "ot = self._ot_trials.get(trial_id)",
        "x = ray._something",
        "y = getattr(results, '_experiment_analysis')",
        # public: none of these count
        "print(ray.__version__, ray.PlacementGroupID, self._groups, model._orig_mod)",
        "from ray.util.placement_group import placement_group_table",
    ])
    lines = [int(hit.split(":")[0]) for hit in private_ray_uses(source)]
    assert sorted(set(lines)) == [2, 3, 4, 5, 6, 7, 8, 9]


def test_no_private_ray_api_outside_the_fence():
    """Done when no project file outside the two fences touches a private Ray attribute."""
    offenders = []
    for top in SCANNED:
        for path in sorted((REPO_ROOT / top).rglob("*.py")):
            if path in FENCES:
                continue
            for hit in private_ray_uses(path.read_text(encoding="utf-8"), str(path)):
                offenders.append(f"{path.relative_to(REPO_ROOT)}:{hit}")
    assert not offenders, ("private Ray APIs outside tune/running/ray_internals.py and "
                           "trainer/cluster/torch_trainer.py (use "
                           "a public API, or add a documented wrapper there):\n  " + "\n  ".join(offenders))


def test_version_check_passes_on_the_installed_ray():
    import ray

    assert ray_internals.check_ray_version() == ray.__version__
    assert ray_internals.check_ray_version("2.60.3") == "2.60.3"


@pytest.mark.parametrize("other", ["2.61.0", "2.59.1", "3.60.0", "2.6.0", "2.600.0", "nightly"])
def test_version_check_names_the_tested_version_and_the_fix(monkeypatch, other):
    import ray

    monkeypatch.delenv(ray_internals.ALLOW_UNTESTED_ENV, raising=False)
    monkeypatch.setattr(ray, "__version__", other)
    with pytest.raises(RuntimeError) as err:
        ray_internals.check_ray_version()
    assert isinstance(err.value, ray_internals.UnsupportedRayError)
    message = str(err.value)
    assert f"Ray {other} is installed" in message
    assert "tested with Ray 2.60.x" in message
    assert "pip install -c constraints.txt -e ." in message


def test_version_check_can_be_overridden_to_try_another_ray(monkeypatch, caplog):
    monkeypatch.setenv(ray_internals.ALLOW_UNTESTED_ENV, "1")
    with caplog.at_level("WARNING", logger="vidtune.ray_version"):
        assert ray_internals.check_ray_version("2.61.0") == "2.61.0"
    assert "tested with Ray 2.60.x" in caplog.text


def test_supported_minor_matches_the_pins():
    """pyproject.toml, constraints.txt and SUPPORTED_RAY name the same Ray minor."""
    import tomllib

    major, minor = ray_internals.SUPPORTED_RAY
    deps = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    ray_dep = next(d for d in deps if re.match(r"ray\b", d))
    assert ray_dep.endswith(f">={major}.{minor},<{major}.{minor + 1}"), ray_dep
    pinned = re.search(r"^ray==(\S+)", (REPO_ROOT / "constraints.txt").read_text(), re.M).group(1)
    assert pinned.startswith(f"{major}.{minor}."), pinned


def test_trial_states_follow_the_result_grid_order():
    trials = [SimpleNamespace(trial_id="a_00001", status="ERROR"),
              SimpleNamespace(trial_id="a_00000", status="TERMINATED"),
              SimpleNamespace(trial_id="a_00002", status="PENDING")]

    class Grid(list):
        _experiment_analysis = SimpleNamespace(trials=trials)

    assert ray_internals.trial_states(Grid([1, 2, 3])) == [("a_00001", "ERROR"), ("a_00000", "TERMINATED"),
                                                           ("a_00002", "PENDING")]
    with pytest.raises(ray_internals.UnsupportedRayError, match="3 trials"):
        ray_internals.trial_states(Grid([1, 2]))
    with pytest.raises(ray_internals.UnsupportedRayError, match="_experiment_analysis"):
        ray_internals.trial_states([])


def test_optuna_pending_trial_until_ray_tells_the_study():
    from ray import tune
    from ray.tune.search.optuna import OptunaSearch

    searcher = OptunaSearch(space={"lr": tune.loguniform(1e-4, 1e-1)}, metric="acc", mode="max", seed=0)
    assert ray_internals.optuna_pending_trial(searcher, "t1") is None          # not asked yet
    searcher.suggest("t1")
    ot_trial = ray_internals.optuna_pending_trial(searcher, "t1")
    assert ot_trial is not None and "lr" in ot_trial.params
    ot_trial.set_user_attr("note", "seen")
    searcher.on_trial_complete("t1", result={"acc": 0.5})
    assert ray_internals.optuna_pending_trial(searcher, "t1") is None          # told: too late to edit
    (done,) = ray_internals.optuna_study(searcher).trials
    assert done.value == 0.5 and done.user_attrs == {"note": "seen"}
    with pytest.raises(ray_internals.UnsupportedRayError, match="_ot_trials"):
        ray_internals.optuna_pending_trial(object(), "t1")


def test_worker_group_placement_group_names_what_moved():
    pg = object()
    group = SimpleNamespace(get_worker_group_state=lambda: SimpleNamespace(
        placement_group_handle=SimpleNamespace(placement_group=pg)))
    assert ray_internals.worker_group_placement_group(group) is pg
    with pytest.raises(ray_internals.UnsupportedRayError, match="placement group of a Train worker group"):
        ray_internals.worker_group_placement_group(object())


def test_cleanup_recorder_is_a_train_worker_group_callback():
    from vidtune.tune.running import cleanup

    assert issubclass(cleanup.PlacementGroupRecorder, ray_internals.WorkerGroupCallback)


@pytest.mark.slow
def test_trial_states_of_a_real_search(ray_session, tmp_path):
    """On the installed Ray: statuses and ids pair with the ResultGrid's Results as runner expects."""
    from ray import tune

    def trainable(config):
        if config["k"] == 1:
            raise ValueError("boom")
        tune.report({"score": config["k"]})

    grid = tune.Tuner(
        trainable, param_space={"k": tune.grid_search([0, 1, 2])},
        run_config=tune.RunConfig(name="states", storage_path=str(tmp_path), verbose=0,
                                  failure_config=tune.FailureConfig(max_failures=0)),
    ).fit()
    states = ray_internals.trial_states(grid)
    assert len(states) == len(grid) == 3
    by_k = {}
    for (trial_id, status), result in zip(states, grid, strict=True):
        if result.metrics.get("trial_id"):
            assert result.metrics["trial_id"] == trial_id
        by_k[result.config["k"]] = status
    assert by_k == {0: "TERMINATED", 1: "ERROR", 2: "TERMINATED"}


def test_quiet_report_lines_silences_trains_per_report_dump_only():
    """Train's workers log a ~2 KB "Reporting training result N: TrainingReport(...)" line at INFO
    for every report; vidtune train's console would echo it after each epoch line."""
    import logging

    from ray.train.v2._internal.execution import context

    from vidtune.trainer.cluster.torch_trainer import quiet_report_lines

    quiet_report_lines()
    assert not context.logger.isEnabledFor(logging.INFO)
    assert context.logger.isEnabledFor(logging.WARNING)
