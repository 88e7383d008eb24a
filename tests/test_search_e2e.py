"""The search end to end on the CPU: `vidtune search` as a user runs it (a subprocess joined to
the test session's Ray with `--address`, as a search joins a cluster), and ASHA stopping trials
with their resources released at once. (A driver killed mid-search and resumed: test_faults.)"""
from __future__ import annotations

import csv
import functools
import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
import torch
from mlflow.tracking import MlflowClient

from vidtune.trainer.commands import train
from vidtune.trainer.ray_setup.launch import (
    DEFAULT_HEALTH_CHECK_INTERVAL_S,
    HEALTH_CHECK_ENV,
    validate_config,
)
from vidtune.trainer.training.precision import choose_precision
from vidtune.tune.outputs.resume_line import AT_START
from vidtune.tune.tracking.description import CELL_PAD
from vidtune.tune.tracking.schema import FAILURE_TAG, NODE_ID_TAG, PARENT_TAG, STOP_TAG, TRIAL_ID_TAG

REPO = Path(__file__).resolve().parents[1]
SEARCH = [sys.executable, str(REPO / "tune" / "search.py")]
# --no-log-model: the best model's logging is tested on the session's smoke search
SMALL = ["--epochs", "2", "--loader-workers", "0", "--batch-sizes", "4,8", "--lr-min", "3e-4",
         "--lr-max", "3e-3", "--no-log-model"]
TRAINER_METRICS = {"train_loss", "val_loss", "val_acc", "val_f1", "val_recall", "val_auc", "clips_per_s",
                   "compute_clips_per_s", "epoch_time_s", "data_wait_frac",
                   "peak_mem_mb", "lr_current", "cache_hit_frac", "concurrent_trainings", "device_wait_s",
                   "device_util_pct"}
# params or tags, never metrics; steady_clips_per_s is Tune's, its last value the run's speed_clips_per_s
CONSTANTS = {"epoch", "batch_size", "oom", "reader_failures", "lr", "steady_clips_per_s"}


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)          # the subprocess joins the Ray given by --address
    env[HEALTH_CHECK_ENV] = DEFAULT_HEALTH_CHECK_INTERVAL_S
    return env


def _runs(uri: str, experiment: str = "vidtune") -> tuple[object, list]:
    c = MlflowClient(uri)
    exp = c.get_experiment_by_name(experiment)
    if exp is None:
        return None, []
    runs = c.search_runs([exp.experiment_id])
    parents = [r for r in runs if PARENT_TAG not in r.data.tags]
    children = [r for r in runs if PARENT_TAG in r.data.tags]
    return (parents[0] if len(parents) == 1 else parents), children


@pytest.mark.slow
def test_search_end_to_end(shared_ray, synthetic_root, tmp_path):
    """2 trials x 2 epochs, run by path from a fresh folder; the MLflow store holds the parent,
    2 children with params and per-epoch metrics, the right statuses and the summary artifacts."""
    # Two trials at a time on the CPU (the default there is one per machine): both start at once
    # and the second must wait for the device lease before it trains.
    out = subprocess.run(SEARCH + ["--address", shared_ray, "--data", str(synthetic_root), "--num-samples",
                                   "2", "--cache-dir", str(tmp_path / "clip-cache"),
                                   "--max-concurrent-trials", "2", *SMALL],
                         cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    db = tmp_path / "mlruns.db"
    assert f"vidtune ui --mlflow-uri sqlite:///{db}" in out.stdout     # runs without the venv active
    assert "\nBest: t" in out.stdout and "\nbest checkpoint (" in out.stdout     # the answer first
    table = out.stdout.split("\ntrials:\n", 1)[1]
    assert "batch" in table and "clips/s" in table
    assert sum(line.rstrip().endswith(" DONE") for line in table.splitlines()) == 2

    uri = f"sqlite:///{db}"
    parent, children = _runs(uri)
    assert parent.info.status == "FINISHED" and len(children) == 2
    assert {"batch_sizes", "lr_min", "lr_max", "dataset", "model", "objective", "tpe", "early_stopping",
            "random_start_trials"} <= set(parent.data.params)
    c = MlflowClient(uri)
    # --no-log-model: no model in the store nor its registry, and the summary says nothing of one
    assert not c.search_logged_models(experiment_ids=[parent.info.experiment_id])
    assert not c.search_registered_models() and "best model:" not in out.stdout
    for run in children:
        assert run.info.status == "FINISHED"
        assert run.data.tags[PARENT_TAG] == parent.info.run_id
        assert run.data.tags[TRIAL_ID_TAG] and run.data.tags[NODE_ID_TAG]
        p = run.data.params
        assert p["batch_size"] in ("4", "8") and 3e-4 <= float(p["lr"]) <= 3e-3
        assert p["model"] == "tiny" and p["precision"] == "auto" and p["workers"] == "1" and \
            p["dataset"] == str(synthetic_root)
        assert TRAINER_METRICS <= set(run.data.metrics) and not CONSTANTS & set(run.data.metrics)
        assert [m.step for m in c.get_metric_history(run.info.run_id, "val_acc")] == [1, 2]
        # what its worker trained with, as the worker read it back from torch (trainer.training.settings)
        assert run.data.tags["vidtune.precision_used"] == choose_precision("auto", "cpu").name
        assert run.data.tags["vidtune.torch"] == torch.__version__ and run.data.tags["vidtune.device"]
        # its page opens with how it did (the trial's MLflow description)
        assert re.fullmatch(r"best val_acc \d\.\d{3} \[\d\.\d\d, \d\.\d\d\] at epoch [12] of 2; done; "
                            r"[\d.]+ clips/s", run.data.tags["mlflow.note.content"]), run.data.tags
    assert len({r.data.tags[TRIAL_ID_TAG] for r in children}) == 2
    artifacts = {a.path for a in c.list_artifacts(parent.info.run_id)}
    assert {"trials.csv", "accuracy_vs_speed.png", "best_config.json", "best_checkpoint"} <= artifacts
    assert c.list_artifacts(parent.info.run_id, "best_checkpoint")
    # MLflow opens ready: this search's saved runs-table view, model-training links, one number
    exp_tags = c.get_experiment(parent.info.experiment_id).tags
    views = [json.loads(json.loads(v)["state"]) for k, v in exp_tags.items()
             if k.startswith("mlflow.sharedViewState.")]
    assert len(views) == 1 and {"params.`batch_size`", "params.`lr`", "metrics.`best_val_acc`"} <= \
        set(views[0]["selectedColumns"])
    links = [u for u in re.findall(r"https?://\S+", out.stdout) if "#/" in u]
    assert links and all("workflowType=machine_learning" in u for u in links), links
    header, *csv_rows = [line.split(",") for line in
                         next((tmp_path / "vidtune-results").glob("*/trials.csv")).read_text().splitlines()]
    csv_acc = {row[0]: float(row[header.index("best_val_acc")]) for row in csv_rows}
    assert {r.info.run_name: r.data.metrics["best_val_acc"] for r in children} == csv_acc
    _check_speed_is_the_models_own(tmp_path / "vidtune-results", children, c)
    _check_the_mlflow_view_and_names(out.stdout, tmp_path / "vidtune-results", parent, children)
    _check_the_best_trial_trains_again(tmp_path, synthetic_root)


def _check_the_mlflow_view_and_names(stdout: str, storage: Path, parent, children) -> None:
    """One short name per trial (console, table, MLflow run name, checkpoint folder); the parent's
    description holds the trials table and links the one child tagged best; outcomes are tags."""
    import re

    names = {r.info.run_name for r in children}
    assert all(re.fullmatch(r"t\d\d-bs\d+-lr\d(\.\d)?e-\d+", n) for n in names), names
    experiment = next(storage.iterdir())
    table = stdout.split("\ntrials:\n", 1)[1]
    for name in names:
        assert name in table and f"{name} started" in stdout
        assert (experiment / "ray" / "train_runs" / name).is_dir()
    # the user's files at the top of the search's folder, Ray's state in its subfolder
    top = {p.name for p in experiment.iterdir()}
    assert {"trials.csv", "best_config.json", "search.log", "objective_history.png", "ray"} <= top, top
    assert not [n for n in top if n.startswith(("experiment_state", "tuner.pkl", "searcher-state")) or
                n.startswith(tuple(names))], top
    note = parent.data.tags["mlflow.note.content"]
    pad = CELL_PAD   # the cells keep a space on each side in MLflow's rendering (spaced_table)
    assert f"| {pad}trial{pad} | {pad}batch{pad} | {pad}lr{pad} |" in note
    assert all(name in note for name in names)
    best = [r for r in children if r.data.tags.get("vidtune.best") == "true"]
    # a relative link to the best child, opening the model-training UI
    assert len(best) == 1 and f"(#/experiments/{best[0].info.experiment_id}/runs/{best[0].info.run_id}?" \
        "workflowType=machine_learning)" in note, note
    assert f"\nBest: {best[0].info.run_name} (" in stdout
    assert {r.data.tags["vidtune.outcome"] for r in children} == {"done"}
    compare = next(ln for ln in stdout.splitlines() if ln.startswith("compare the trials in MLflow:"))
    assert f"/#/experiments/{parent.info.experiment_id}/runs" in compare
    # vidtune's console: no Ray box tables, raylet warnings or Tune status blocks
    assert not any(mark in stdout for mark in ("╭", "│", "raylet", "Trial status:", "TensorBoard"))
    assert (experiment / "search.log").stat().st_size > 0          # they went to the log file


def _check_the_best_trial_trains_again(tmp_path: Path, data: Path) -> None:
    """`vidtune train --config best_config.json` (the file the search wrote) gives the
    best trial's training config, valid as the CLI checks it before Ray; a flag overrides the file.
    (Training from a config is `test_train_cli`'s; here only the file the search wrote is new.)"""
    best_config = next((tmp_path / "vidtune-results").glob("*/best_config.json"))
    csv_lines = best_config.with_name("trials.csv").read_text().splitlines()
    header, best, *_ = [line.split(",") for line in csv_lines]          # trials.csv: best first
    cfg = train.config_from_args(train.parse_args(["--config", str(best_config), "--epochs", "1"]))
    validate_config(cfg)
    assert cfg.epochs == 1 and cfg.data.root == str(data) and cfg.model == "tiny"
    assert str(cfg.batch_size) == best[header.index("batch_size")]
    assert f"{cfg.lr:.3g}" == best[header.index("lr")]


def _tune_epochs(storage: Path) -> dict[str, list[dict]]:
    """trial id -> its per-epoch results as Tune recorded them (result.json of each trial)."""
    import json

    epochs: dict[str, list[dict]] = {}
    for file in storage.glob("*/ray/*/result.json"):     # Tune's trial folders, in the search's ray/
        rows = [json.loads(line) for line in file.read_text().splitlines() if line.strip()]
        if rows:
            epochs[rows[0]["trial_id"]] = sorted(rows, key=lambda r: r["epoch"])
    return epochs


def _check_speed_is_the_models_own(storage: Path, children: list, client) -> None:
    """Two trials ran at a time (2 cores, 2 trials), yet no two trainings overlapped; every read
    came from the clip cache the search filled; the trials' speed is its steady state."""
    epochs = _tune_epochs(storage)
    assert len(epochs) == 2, sorted(storage.rglob("result.json"))
    spans = sorted((e["epoch_start_ts"], e["epoch_end_ts"], trial)
                   for trial, rows in epochs.items() for e in rows)
    for (_, e1, t1), (s2, _, t2) in zip(spans, spans[1:], strict=False):
        assert t1 == t2 or e1 <= s2, f"trials {t1} and {t2} trained at the same time: {spans}"
    for rows in epochs.values():
        assert [r["concurrent_trainings"] for r in rows] == [1.0, 1.0]
        assert [r["cache_hit_frac"] for r in rows] == [1.0, 1.0]
        assert all(r["compute_clips_per_s"] >= r["clips_per_s"] > 0 for r in rows)
    # trials.csv (the summary) holds the steady speed: with 2 epochs, epoch 2's
    import csv
    import tempfile

    parent_id = children[0].data.tags[PARENT_TAG]
    with tempfile.TemporaryDirectory() as tmp:
        table = Path(client.download_artifacts(parent_id, "trials.csv", tmp)).read_text()
    for row in csv.DictReader(table.splitlines()):     # rounded to 2 decimals
        assert float(row["speed_clips_per_s"]) == pytest.approx(epochs[row["trial_id"]][1]["clips_per_s"],
                                                                abs=0.006)
    for run in children:
        history = client.get_metric_history(run.info.run_id, "concurrent_trainings")
        assert [m.value for m in history] == [1.0, 1.0]
        assert "epoch_start_ts" not in run.data.metrics      # times, kept in Tune's results only


@pytest.mark.slow
def test_smoke_test_console_is_short_and_ends_with_the_summary(smoke_search, shared_ray, synthetic_root,
                                                               tmp_path):
    out = smoke_search     # `vidtune search --smoke-test`, run once for the session (conftest)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lines = (out.stdout + out.stderr).splitlines()
    # the last block opens with the answer (up to 4 lines) and says once what each column means;
    # the legend of a speed measured beside other work shows only on a busy machine; 3 lines say
    # where the registered model is, how to load and serve it and where its alias `best` is; 1 line
    # opens the Optuna study in optuna-dashboard. Not counted: the clip cache's "Disk per video"
    # line, printed only when this run wrote entries (so alone, not after a test that cached the
    # same videos: the count depended on the order of the tests), nor the note that no Ray token is
    # here, printed when a search joins a cluster by address with none (the tests' HOME has one
    # only after a test has started a local Ray).
    # Nor the fill's "decoding N videos before the first trial", printed only when it decodes any.
    optional = ("~ other processes", "Disk per video ", "note: no Ray token here")
    counted = [ln for ln in lines
               if not ln.startswith(optional) and not ln.endswith("before the first trial")]
    assert len(counted) <= 51, "\n".join(lines)     # 50, and the resume line printed before the trials
    answer = max(i for i, ln in enumerate(lines) if ln.startswith("Best: "))   # the last block, answer first
    assert any(ln.startswith("compare the trials in MLflow:") for ln in lines[answer:answer + 6])
    assert any(ln.startswith("the Optuna study ") for ln in lines[answer:answer + 8])
    assert lines[-1].startswith("results: ")
    assert sum(" epoch 1/1 " in ln for ln in lines) == 2 and \
        any("2/2 trials done" in ln or "1/2 trials done" in ln for ln in lines)
    # The line that continues the search, printed once before the first trial's (after kill -9 it
    # is all there is), and in the search's log; not again at its end, which finished.
    starts = [i for i, ln in enumerate(lines) if ln.startswith(AT_START)]
    assert len(starts) == 1 and starts[0] < min(i for i, ln in enumerate(lines) if " epoch 1/1 " in ln), lines
    command = shlex.split(lines[starts[0]].removeprefix(AT_START))
    assert command[1:3] == ["search", "--resume"] and command[command.index("--storage") + 1] == \
        str(out.results.parent), command
    assert lines[starts[0]] in (out.results / "search.log").read_text().splitlines()
    assert sum("--resume" in ln for ln in lines) == 1, lines
    # The second search is quiet, one trial, and warm-started from the first: its study holds the
    # first's two trials (as trials.csv has them) before its own.
    first = out.results / "trials.csv"
    seeded = list(csv.DictReader(first.open()))
    storage = f"sqlite:///{tmp_path / 'optuna.db'}"
    quiet = subprocess.run(SEARCH + ["--smoke-test", "--data", str(synthetic_root), "--quiet", "--name", "q",
                                     "--no-log-model",
                                     "--address", shared_ray,
                                     "--num-samples", "1",
                                     "--warm-start", str(first.parent), "--optuna-storage", storage],
                           cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=600)
    assert quiet.returncode == 0 and quiet.stdout.lstrip().startswith("Best: "), quiet.stdout[:2000]
    study = optuna.load_study(study_name="q", storage=storage)
    assert len(study.trials) == 3 and all(t.state.name == "COMPLETE" for t in study.trials)
    assert sorted(round(t.value, 4) for t in study.trials[:2]) == \
        sorted(float(r["best_val_acc"]) for r in seeded)


# -- ASHA: stopped trials release their resources ----------------------------------------------

def scripted_worker(config: dict, *, oom_marker: str) -> None:
    """A Train worker loop with scripted metrics: the later a trial starts, the worse it scores,
    so ASHA (grace 1 epoch) surely stops the late ones. The first trial to claim `oom_marker`
    (an exclusive file create, so exactly one trial whatever the sampler picks) runs out of memory.
    Epochs after the first take 2.5 s (room for Tune to act on ASHA's stop on a loaded machine
    before the next starts), and each epoch's start is written to `<oom_marker>.epochs`
    (`<run name> <epoch>`), so a test sees how far a stopped trial's Train run went on."""
    import ray.train

    try:
        with open(oom_marker, "x"):
            oom = 1
    except FileExistsError:
        oom = 0
    started = time.time()
    for epoch in range(1, config["epochs"] + 1):
        with open(f"{oom_marker}.epochs", "a") as log:
            log.write(f"{ray.train.get_context().get_experiment_name()} {epoch}\n")
        time.sleep(0.5 if epoch == 1 else 2.5)
        ray.train.report({"epoch": epoch, "val_acc": 0.0 if oom else 1e9 / started, "val_f1": 0.5,
                          "clips_per_s": 0.0 if oom else 10.0, "epoch_time_s": 0.5, "oom": oom,
                          "batch_size": config["batch_size"],
                          "node_id": ray.get_runtime_context().get_node_id()})
        if oom:
            return


def scripted_trainer_factory(oom_marker: Path):
    """A trainer factory with the signature of trainer.cluster.build_trainer.build_torch_trainer, around
    `scripted_worker`."""
    def scripted_trainer(cfg, *, num_workers, use_gpu, resources_per_worker, name, storage_path, callbacks,
                         device_lease=None, index=None, node_setup=None):
        import ray.train
        from ray.train.torch import TorchTrainer

        return TorchTrainer(functools.partial(scripted_worker, oom_marker=str(oom_marker)),
                            train_loop_config=cfg.to_dict(),
                            scaling_config=ray.train.ScalingConfig(num_workers=num_workers, use_gpu=use_gpu,
                                                                   resources_per_worker=resources_per_worker),
                            run_config=ray.train.RunConfig(
                                name=name, storage_path=storage_path, callbacks=callbacks,
                                failure_config=ray.train.FailureConfig(max_failures=cfg.max_failures)))
    return scripted_trainer


@pytest.mark.slow
def test_asha_stops_trials_and_their_resources_are_released(ray_session, synthetic_root, tmp_path, capsys):
    import ray
    import ray.cloudpickle
    from ray.util.placement_group import placement_group_table

    from vidtune.tune import preflight, runner
    from vidtune.tune.config.options import parse_options

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])   # workers cannot import tests/
    uri = f"sqlite:///{tmp_path / 'mlruns.db'}"
    opts = parse_options(["--data", str(synthetic_root), "--num-samples", "5", "--epochs", "4",
                          "--batch-sizes", "4,8", "--storage", str(tmp_path / "results"), "--mlflow-uri", uri,
                          "--seed", "3", "--grace-period", "1"])     # rungs at epochs 1 and 2
    plan = preflight.prepare(opts)
    pgs_before = set(placement_group_table())
    started = time.monotonic()
    code = runner.run_search(plan, trainer_factory=scripted_trainer_factory(tmp_path / "oom-claimed"))
    wall = time.monotonic() - started
    print(f"ASHA search of 5 trials: {wall:.0f} s")
    assert code == 0

    parent, children = _runs(uri)
    statuses = [r.info.status for r in children]
    assert len(children) == 5 and "RUNNING" not in statuses
    # ASHA really stopped trials: FINISHED with the outcome "stopped early" (KILLED is interrupted)
    stopped = [r for r in children if r.data.tags.get("vidtune.outcome") == "stopped early"]
    assert stopped, statuses
    assert all(r.info.status == "FINISHED" and "stopped early by ASHA" in r.data.tags[STOP_TAG]
               for r in stopped)
    failed = [r for r in children if r.info.status == "FAILED"]     # OOM: FAILED with reason, run once
    assert len(failed) == 1 and "out of memory" in failed[0].data.tags[FAILURE_TAG], statuses
    # The study beside mlruns.db (the default) records ASHA's stops as PRUNED, the others not, and
    # names each trial and its MLflow run as MLflow does (tune.study.dashboard)
    study = optuna.load_study(study_name=plan.name, storage=f"sqlite:///{tmp_path / 'optuna.db'}")
    by_run = {t.user_attrs["mlflow_run_id"]: t for t in study.trials}
    assert set(by_run) == {r.info.run_id for r in children}
    for run in children:
        trial = by_run[run.info.run_id]
        assert trial.user_attrs["vidtune_trial"] == run.info.run_name
        assert trial.user_attrs["status"] == run.data.tags["vidtune.outcome"]
        assert (trial.state.name == "PRUNED") == (run in stopped), (run.info.run_name, trial.state)
    # Every placement group this search created is gone: nothing left reserved for the next trial
    # or the next search (leaked groups used to make the search sit idle for 60 s per retry).
    new = {pg: info["state"] for pg, info in placement_group_table().items() if pg not in pgs_before}
    assert new and all(state == "REMOVED" for state in new.values()), new
    deadline = time.monotonic() + 30                                 # trial actors exit asynchronously
    while ray.available_resources().get("CPU", 0) < ray.cluster_resources()["CPU"] and \
            time.monotonic() < deadline:
        time.sleep(0.5)
    assert ray.available_resources().get("CPU", 0) == ray.cluster_resources()["CPU"]

    # A stopped trial's Train run ends when ASHA stops it (tune.running.cleanup ends its controller): it
    # starts at most the epoch after its last reported one, never the rest of its 4 epochs.
    started_epochs: dict[str, int] = {}
    for line in (tmp_path / "oom-claimed.epochs").read_text().splitlines():
        name, epoch = line.split()
        started_epochs[name] = max(started_epochs.get(name, 0), int(epoch))
    for run in stopped:
        reported = len(MlflowClient(uri).get_metric_history(run.info.run_id, "val_acc"))
        assert started_epochs[run.info.run_name] <= reported + 1, \
            (run.info.run_name, reported, started_epochs)
    # ... and its process then serves a later trial (Tune's reuse_actors), which ends normally.
    started_at = {r.info.run_name: r.info.start_time for r in children}     # ms, when Tune started it
    trials_by_pid: dict[int, list[tuple[int, str]]] = {}
    for folder in Path(plan.experiment_path).iterdir():
        result = folder / "result.json"
        lines = result.read_text().splitlines() if result.is_file() else []
        if lines and folder.name in started_at:
            pid = json.loads(lines[0])["pid"]                                 # the trial driver's process
            trials_by_pid.setdefault(pid, []).append((started_at[folder.name], folder.name))
    stopped_names = {r.info.run_name for r in stopped}
    reused_after_a_stop = [trials for trials in trials_by_pid.values()
                           if any(name in stopped_names for _, name in sorted(trials)[:-1])]
    assert reused_after_a_stop, trials_by_pid
    # On a local Ray (never drained), Train's per-run PreemptionWatcher actor is off
    # (trainer.ray_setup.launch).
    from ray.util.state import list_actors

    actors = list_actors(address=ray.get_runtime_context().gcs_address, limit=10_000)   # this Ray's
    assert not [a for a in actors if a.class_name == "PreemptionWatcher"]


@pytest.mark.slow
def test_the_smoke_searchs_store_opens_its_charts_and_reads_right(smoke_search):
    """The session's real smoke search (conftest): its saved view holds the three comparison
    charts and a folded section of operational metrics; each trial's run opens with its one-line
    description; the accuracies are logged unrounded."""
    from vidtune.tune.tracking.schema import NOTE_TAG
    from vidtune.tune.tracking.view import COMPARE_SECTION, VIEW_TAG_PREFIX, read_view

    assert smoke_search.returncode == 0, smoke_search.stdout[-3000:] + smoke_search.stderr[-3000:]
    parent, children = _runs(smoke_search.uri)
    c = MlflowClient(smoke_search.uri)
    tags = c.get_experiment(parent.info.experiment_id).tags
    (view_tag,) = [k for k in tags if k.startswith(VIEW_TAG_PREFIX)]
    state = read_view(tags[view_tag])
    sections = {s["name"]: s for s in state["compareRunSections"]}
    compare = [card["type"] for card in state["compareRunCharts"]
               if card["metricSectionId"] == sections[COMPARE_SECTION]["uuid"]]
    assert compare == ["SCATTER", "PARALLEL", "LINE"]
    assert [s["display"] for name, s in sections.items() if name.startswith("Operations")] == [False]
    logged = set().union(*(r.data.metrics for r in children))
    charted = {card.get("metricKey") for card in state["compareRunCharts"]}
    assert logged <= charted, logged - charted          # the UI adds no chart of its own
    note = r"best val_acc [01]\.\d{3} \[[01]\.\d\d, [01]\.\d\d\] at epoch 1 of 1; done; [\d.]+ clips/s"
    for run in children:
        assert re.fullmatch(note, run.data.tags[NOTE_TAG]), run.data.tags[NOTE_TAG]
        low = run.data.metrics["best_val_acc_low"]             # Wilson's bound: not k / n
        assert round(low, 4) != low                            # as computed, not trials.csv's 4 decimals
        assert "speed_clips_per_s" in run.data.metrics and "steady_clips_per_s" not in run.data.metrics
    assert "speed_clips_per_s" in parent.data.metrics and "best_clips_per_s" not in parent.data.metrics
