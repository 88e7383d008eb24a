"""tune.config.searched: a searched hyperparameter is declared in one place, and every output follows.

The proof the declaration is the only place: these tests declare one more searched parameter,
the warmup share (`TrainConfig.warmup_frac`, uniform in 0.02..0.3), by replacing
`searched.PARAMS` alone, and find it in the Tune space, the trial names, the trial's config, the
console, the tables and trials.csv, the plot, the importance, --warm-start, the answer and
MLflow's view; then a real smoke search run with that one change shows it in its console, its
trials.csv and its MLflow runs.
"""
from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
from mlflow.tracking import MlflowClient
from ray.tune.search.sample import Float

from vidtune.numbers import short_number
from vidtune.trainer.training.config import TrainConfig
from vidtune.tune.config import searched
from vidtune.tune.config.options import SearchOptions, SearchSpace
from vidtune.tune.outputs import tables
from vidtune.tune.outputs.answer import answer_lines
from vidtune.tune.outputs.console import SearchConsole
from vidtune.tune.outputs.importance import MIN_TRIALS, param_importances
from vidtune.tune.outputs.plots import params_figure
from vidtune.tune.outputs.results import TrialResult
from vidtune.tune.running.trial import short_name, trial_config
from vidtune.tune.study import space
from vidtune.tune.study.warm_start import load_warm_start
from vidtune.tune.tracking import view
from vidtune.tune.tracking.schema import PARENT_TAG

REPO = Path(__file__).resolve().parents[1]
# The declaration a contributor would add to tune/config/searched.py's PARAMS (fixed bounds: no new flag)
WARMUP = searched.Param("warmup_frac", words="warmup", column="warmup", short="wu", scale="linear",
                        low=0.02, high=0.3, axis="warmup share of training")
DECLARE = "searched.PARAMS = searched.PARAMS + (searched.Param('warmup_frac', words='warmup', " \
          "column='warmup', short='wu', scale='linear', low=0.02, high=0.3),)"


@pytest.fixture
def with_warmup(monkeypatch):
    monkeypatch.setattr(searched, "PARAMS", searched.PARAMS + (WARMUP,))


def _row(i: int, *, warmup: float, acc: float, batch: int = 8, lr: float = 1e-3) -> TrialResult:
    return TrialResult(trial_id=f"id{i}", batch_size=batch, lr=lr, val_acc=acc, val_f1=acc,
                    clips_per_s=10.0, epoch_time_s=1.0, epochs=3, status="DONE", checkpoint=None,
                    name=f"t{i:02d}", best_epoch=3,
                    params={"batch_size": batch, "lr": lr, "warmup_frac": warmup})


def test_the_declared_parameters_are_batch_size_lr_and_weight_decay_with_their_flags():
    assert [p.name for p in searched.PARAMS] == ["batch_size", "lr", "weight_decay"]
    every = SearchSpace(batch_sizes=(4, 8), search_weight_decay=True)
    assert {name: d.flags for name, d in searched.domains(every).items()} == {
        "batch_size": "--batch-sizes", "lr": "--lr-min/--lr-max",
        "weight_decay": "--weight-decay-min/--weight-decay-max"}
    # weight decay is searched only when asked
    assert list(searched.domains(SearchSpace(batch_sizes=(4,)))) == ["batch_size", "lr"]
    for p in searched.PARAMS:    # each names a TrainConfig field, where a trial puts its value
        assert hasattr(TrainConfig(), p.name)


def test_one_declaration_reaches_the_space_names_config_console_and_tables(with_warmup, capsys):
    opts = SearchOptions(space=SearchSpace(batch_sizes=(4, 8)))
    tune_space = space.param_space(opts)
    assert isinstance(tune_space["warmup_frac"], Float)
    assert (tune_space["warmup_frac"].lower, tune_space["warmup_frac"].upper) == (0.02, 0.3)

    trial = SimpleNamespace(experiment_tag="3_x", trial_id="abc", status="RUNNING", last_result={},
                            error_file=None, config={"batch_size": 8, "lr": 2.5e-4, "warmup_frac": 0.15})
    assert short_name(trial) == "t03-bs8-lr2.5e-4-wu1.5e-1"
    assert trial_config(TrainConfig(), trial.config).warmup_frac == 0.15   # what the worker trains with

    console = SearchConsole(num_samples=4, epochs=3, objective="val_acc")
    console.on_trial_start(0, [trial], trial)
    assert "started: batch size 8, lr 0.00025, warmup 0.15" in capsys.readouterr().out

    rows = [_row(1, warmup=0.25, acc=0.8), _row(2, warmup=0.05, acc=0.6)]
    head, _, first, *_ = tables.format_table(rows).splitlines()
    assert head.split()[:4] == ["trial", "batch", "lr", "warmup"] and first.split()[3] == "2.50e-01"
    assert "| warmup |" in tables.format_markdown(rows)
    assert tables.csv_record(rows[0])["warmup_frac"] == "0.25"


def test_one_declaration_reaches_the_plot_importance_warm_start_answer_and_view(with_warmup, tmp_path):
    rows = [_row(i, warmup=0.02 + 0.03 * i, acc=0.5 + 0.04 * i, batch=(4, 8)[i % 2])
            for i in range(MIN_TRIALS)]
    space_ = SearchSpace(batch_sizes=(4, 8))
    domains = searched.domains(space_)

    fig = params_figure(rows, objective="val_acc", domains=domains)
    labels = [ax.get_xlabel() for ax in fig.axes if ax.get_xlabel()]
    assert "warmup share of training (linear scale)" in labels
    warmup_ax = fig.axes[labels.index("warmup share of training (linear scale)")]
    assert warmup_ax.get_xscale() == "linear"
    assert sorted(ln.get_xdata()[0] for ln in warmup_ax.get_lines() if ln.get_gid() == "searched_range") == \
        pytest.approx([0.02, 0.3])

    importance = param_importances(rows, space=space_)
    assert set(importance.shares) == {"batch_size", "lr", "warmup_frac"}
    assert next(iter(importance.shares)) == "warmup_frac"      # the accuracy follows the warmup alone

    folder = tmp_path / "earlier"
    tables.write_csv(rows, folder / "trials.csv")
    seed = load_warm_start(str(folder), space_, "val_acc")
    assert len(seed.points_to_evaluate) == MIN_TRIALS
    assert sorted(p["warmup_frac"] for p in seed.points_to_evaluate) == \
        pytest.approx(sorted(r.value("warmup_frac") for r in rows))
    narrower = searched.Param("warmup_frac", words="warmup", column="warmup", short="wu", scale="linear",
                              low=0.02, high=0.1)
    searched.PARAMS = (*searched.PARAMS[:-1], narrower)    # the fixture restores it
    seed = load_warm_start(str(folder), space_, "val_acc")
    assert seed.left_out == {"outside the new space (warmup outside 0.02..0.1)": 5}

    best = _row(9, warmup=0.29, acc=0.9)
    edge = [line for line in answer_lines([best], objective="val_acc", val_clips=32, domains=domains)
            if "edge" in line]
    assert edge and edge[0].startswith("The best warmup (2.90e-01) is at the upper edge")

    assert "params.`warmup_frac`" in view.view_columns("val_acc")


def test_a_bad_value_names_the_parameter():
    with pytest.raises(ValueError, match="momentum"):
        trial_config(TrainConfig(), {"momentum": 0.9})


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_smoke_search_with_one_more_declared_parameter_shows_it_everywhere(shared_ray, synthetic_root,
                                                                               tmp_path):
    """The search run as `vidtune search` runs it, with WARMUP declared and nothing else changed."""
    script = textwrap.dedent(f"""
        import sys
        from vidtune.tune.config import searched
        {DECLARE}
        from vidtune.tune.search import main
        sys.exit(main(sys.argv[1:]))
    """)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    out = subprocess.run([sys.executable, "-c", script, "--smoke-test", "--data", str(synthetic_root),
                          "--address", shared_ray, "--no-log-model", "--name", "warmup",
                          "--num-samples", "1"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "warmup 0.02..0.3" in out.stdout                                  # the plan's first line
    started = [line for line in out.stdout.splitlines() if " started: " in line]
    assert len(started) == 1 and ", warmup 0." in started[0] and "-wu" in started[0]
    table = out.stdout.split("\ntrials:\n", 1)[1].splitlines()
    assert table[0].split()[:4] == ["trial", "batch", "lr", "warmup"]

    with open(tmp_path / "vidtune-results" / "warmup" / "trials.csv", newline="") as f:
        read = list(csv.DictReader(f))
    values = {r["name"]: float(r["warmup_frac"]) for r in read}
    assert len(values) == 1 and all(0.02 <= v <= 0.3 for v in values.values())
    assert all(f"-wu{short_number(v)}" in name for name, v in values.items())
    best = json.loads((tmp_path / "vidtune-results" / "warmup" / "best_config.json").read_text())
    assert math.isclose(best["train_config"]["warmup_frac"], values[best["name"]], rel_tol=5e-3)

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlruns.db'}")
    exp = client.get_experiment_by_name("vidtune")
    runs = client.search_runs([exp.experiment_id])
    children = {r.info.run_name: r for r in runs if PARENT_TAG in r.data.tags}
    assert {name: float(r.data.params["warmup_frac"]) for name, r in children.items()} == \
        pytest.approx(values, rel=5e-3)
    tags = client.get_experiment(exp.experiment_id).tags
    states = [json.loads(json.loads(v)["state"]) for k, v in tags.items()
              if k.startswith("mlflow.sharedViewState.")]
    assert states and "params.`warmup_frac`" in states[0]["selectedColumns"]
