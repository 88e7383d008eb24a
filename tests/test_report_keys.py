"""Every key of a trial's reports is declared once (trainer/training/report_keys.py) with its role in MLflow:
the real report builders of the worker report exactly the declared keys, MLflow gets exactly the
declared metrics (the same set the hand list of non-metrics gave before), each tag key names a
tag the tracker writes, and docs/mlflow.md's table is the module's. No other library file spells
a key (a structure test over every module's string constants, with its few collisions named and
justified), and one helper, `report_keys.number`, reads a report's value as a float or NaN."""
from __future__ import annotations

import ast
import math
import numbers
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import ray
import ray.train
import ray.util
import torch
from ray.tune.result import AUTO_RESULT_KEYS

from vidtune.datasets.config import DataConfig
from vidtune.datasets.index import build_index
from vidtune.trainer.cluster import worker
from vidtune.trainer.cluster.lease import TrainingSlot
from vidtune.trainer.training import report_keys
from vidtune.trainer.training.config import TrainConfig
from vidtune.trainer.training.metrics import reduce_epoch
from vidtune.trainer.training.report_keys import EPOCH_METRICS, REPORT_KEYS, SUMMARY_KEYS, Cadence, Key, Role
from vidtune.trainer.training.run import TRAINED, build_run, place_model, run_epoch
from vidtune.trainer.training.settings import merge_settings, worker_settings
from vidtune.tune.outputs import results
from vidtune.tune.tracking import schema
from vidtune.tune.tracking.runs import placement_tags, setting_tags

# MLflow's metrics as `schema.numeric_metrics` chose them before the declaration: every number but
# this hand list (as of commit 73e8125); kept here to prove that no chart a user had disappears.
_SETTINGS = ("precision_used", "tf32", "cudnn_benchmark", "device_name", "compute_capability",
             "cuda_version", "driver_version", "torch_version")
_OLD_NOT_METRICS = set(AUTO_RESULT_KEYS) | {
    "done", "trial_id", "experiment_tag", "checkpoint_path", "should_checkpoint", "node_id", "epoch_start_ts",
    "epoch_end_ts", "resumed_from_epoch", "epoch", "batch_size", "oom", "diverged", "steady_clips_per_s",
    "reader_failures", "node_ip", "gpu_ids", "damaged_checkpoints", *_SETTINGS}


def _old_metrics(result: dict) -> dict[str, float]:
    return {{"lr": "lr_current"}.get(k, k): float(v) for k, v in result.items()
            if k not in _OLD_NOT_METRICS and not k.startswith("config/") and not isinstance(v, bool)
            and isinstance(v, numbers.Real)}


@pytest.fixture(scope="module")
def reports(synthetic_root):
    """The three reports a worker makes, by its own builders, after a real epoch of the tiny model
    on the generated dataset (one process, on the CPU; Ray's node and GPU lookups answered as a
    CPU worker's would be): a trained epoch (`_epoch_metrics`), a diverged one
    (`_report_no_result`) and an out of memory before the model was built (`_report_setup_oom`)."""
    cfg = TrainConfig(data=DataConfig(root=str(synthetic_root), loader_workers=0), model="tiny",
                      precision="fp32", lr=1e-3, epochs=1, batch_size=8)
    run = build_run(cfg, build_index(cfg.data), device=torch.device("cpu"))
    place_model(run)
    sent: list[dict] = []
    context = SimpleNamespace(get_node_id=lambda: "node-1", get_accelerator_ids=lambda: {})
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ray, "get_runtime_context", lambda: context)
        mp.setattr(ray.util, "get_node_ip_address", lambda: "10.0.0.1")
        mp.setattr(ray.train, "report", lambda metrics, **kw: sent.append(metrics))
        w = worker._Worker(run=run, slot=TrainingSlot(None))
        w.where = worker._where_it_runs()
        w.settings = merge_settings([worker_settings(run.device, run.policy)])
        start = time.time()
        result = run_epoch(run, 1)
        assert result.outcome == TRAINED
        window = (start, time.time())
        trained = worker._epoch_metrics(w, 1, reduce_epoch(result.stats, result.eval_out), window=window,
                                        first=True)
        worker._report_no_result(w, 2, 1.0, window, diverged=True, stats=result.stats)
        worker._report_setup_oom(cfg, 1.0, window)
    diverged, oom = sent
    return {"trained": trained, "diverged": diverged, "oom": oom}


@pytest.mark.parametrize("kind", ["trained", "diverged", "oom"])
def test_every_key_a_worker_reports_is_declared_in_order(reports, kind):
    report = reports[kind]
    assert list(report) == list(REPORT_KEYS)
    assert all(report_keys.declared(key) is not None for key in report)
    # MLflow gets exactly the declared metrics, under their MLflow names
    assert set(schema.numeric_metrics(report)) == set(EPOCH_METRICS.values())
    assert report[Key.OOM] == (kind == "oom") and report[Key.DIVERGED] == (kind == "diverged")


@pytest.mark.parametrize("kind", ["trained", "diverged", "oom"])
def test_mlflow_gets_the_metrics_the_hand_list_gave(reports, kind):
    new, old = schema.numeric_metrics(reports[kind]), _old_metrics(reports[kind])
    assert new.keys() == old.keys()
    # the speeds are logged as trials.csv shows them (2 decimals), the rest as reported
    old = {k: round(v, 2) if k in schema.SPEED_KEYS and math.isfinite(v) else v for k, v in old.items()}
    assert all(new[k] == old[k] or (math.isnan(new[k]) and math.isnan(old[k])) for k in new)
    assert new["lr_current"] == reports[kind]["lr"] and "lr" not in new


def test_a_row_of_tunes_dataframe_gives_the_reports_metrics(reports):
    """What Tune adds (its own keys, the config's columns, the tracker's run id, NaN in a row
    without one) is no metric, and where it ran stays a tag when the dataframe reads the GPU id "0"
    back as the number 0."""
    report = reports["trained"]
    row = {**report, "gpu_ids": 0, "timestamp": 1_700_000_000, "checkpoint_dir_name": "epoch_0001",
           "done": False, "training_iteration": 1, "trial_id": "x", "date": "2026-12-05",
           "time_this_iter_s": 2.0, "time_total_s": 2.0, "pid": 123, "hostname": "h",
           "time_since_restore": 2.0, "iterations_since_restore": 1, "mlflow_run_id": math.nan,
           "checkpoint_path": "/c", "experiment_tag": "1", "config/lr": 1e-3, "config/batch_size": 8}
    assert schema.numeric_metrics(row) == schema.numeric_metrics(report)


def test_an_undeclared_number_is_logged_and_said_once(reports, capsys):
    """A key a report holds but nobody declared (from an older vidtune's epochs.json, say) neither
    vanishes from MLflow nor passes unnoticed."""
    row = {**reports["trained"], "warmup_share": 0.25}
    assert schema.numeric_metrics(row)["warmup_share"] == 0.25
    said = capsys.readouterr().out
    assert "'warmup_share' is not declared in trainer/training/report_keys.py" in said
    schema.numeric_metrics(row)
    assert "warmup_share" not in capsys.readouterr().out


def test_a_worker_report_with_an_undeclared_key_is_refused(reports):
    report = dict(reports["trained"])
    refused = r"trainer/training/report_keys.py: undeclared \['warmup_share'\], missing \[\]"
    with pytest.raises(ValueError, match=refused):
        report_keys.in_report_order({**report, "warmup_share": 0.25})
    del report["cache_repairs"]
    with pytest.raises(ValueError, match=r"undeclared \[\], missing \['cache_repairs'\]"):
        report_keys.in_report_order(report)


def test_the_summary_keys_are_the_child_runs_summary():
    """The summary declared here is what `tune.outputs.results.summary_metrics` and the tracker's
    `best_val_f1` write into a child run."""
    assert set(SUMMARY_KEYS) == {*results.SUMMARY_KEYS, "best_val_f1"}
    assert results.SPEED_METRIC == Key.SPEED_CLIPS_PER_S
    assert all(k.role is Role.METRIC and k.cadence is Cadence.SUMMARY and k.mlflow == k for k in SUMMARY_KEYS)


def test_each_tag_key_names_the_tag_the_tracker_writes(reports):
    report = reports["trained"]
    tags = {k: k.mlflow for k in REPORT_KEYS if k.role is Role.TAG}
    assert set(tags.values()) == {schema.NODE_ID_TAG, schema.NODE_TAG, schema.GPU_IDS_TAG, schema.RESUMED_TAG,
                                  schema.READER_TAG, schema.OUTCOME_TAG, *schema.SETTING_TAGS.values()}
    assert tags[Key.OOM] == tags[Key.DIVERGED] == schema.OUTCOME_TAG
    written = {**placement_tags(report), **setting_tags(report)}
    placed = (Key.NODE_ID, Key.NODE_IP, Key.GPU_IDS, *report_keys.SETTING_KEYS)
    assert written == {k.mlflow: report[k] for k in placed if report[k] or k is Key.GPU_IDS}
    assert written[schema.GPU_IDS_TAG] == "" and written[schema.NODE_TAG] == "10.0.0.1"   # the CPU's


def test_docs_mlflow_table_is_the_modules():
    page = report_keys.DOC.read_text(encoding="utf-8")
    assert page == report_keys.with_table(page), (
        "docs/mlflow.md's table of report keys is stale: run "
        "`.venv/bin/python -m vidtune.trainer.training.report_keys`")
    table = page.split(report_keys.TABLE_START)[1].split(report_keys.TABLE_END)[0]
    assert "| `lr` | metric | per-epoch | `lr_current` |" in table
    assert all(f"| `{k.value}` |" in table for k in Key)


def test_a_page_without_the_table_lines_is_refused():
    with pytest.raises(ValueError, match="mlflow.md lacks the lines"):
        report_keys.with_table("# no table here\n")


# -- one reader of a report's numbers --------------------------------------------------------------

@pytest.mark.parametrize(("value", "expected"), [
    (0.75, 0.75), (3, 3.0), (math.inf, math.inf),
    ("0.75", 0.75),                     # a trials.csv cell, read back as text
    (True, 1.0), (False, 0.0),          # a report's oom / diverged flag
    (np.float32(0.5), 0.5), (np.int64(7), 7.0), (torch.tensor(2.5), 2.5),
])
def test_number_reads_a_reports_value_as_a_float(value, expected):
    got = report_keys.number(value)
    assert type(got) is float and got == expected


@pytest.mark.parametrize("value", [None, math.nan, "", "n/a", "nan", [0.5], {}, object(), torch.ones(2)])
def test_number_is_nan_where_a_report_holds_no_number(value):
    """Missing (None), not a number (text, a list, a dict, a tensor of several values), or NaN."""
    assert math.isnan(report_keys.number(value))


# -- no library file spells a report key ------------------------------------------------------------
# Every key of a report is read and written as `Key.X` (`Key.X.value` where a plain string is
# stored), so that a key renamed or removed in trainer/training/report_keys.py is renamed everywhere or
# fails at import, and a reader of the code finds every use of a key by its name.

REPO = Path(__file__).resolve().parents[1]
LIBRARY = ("vidtune", "datasets", "trainer", "tune")           # tune/tracking included
DECLARATION = "trainer/training/report_keys.py"
# lr and batch_size are TrainConfig fields and searched parameters (`tune.config.searched.PARAMS`) before
# they are report keys: a config dict, Tune's param space, trials.csv's parameter columns and the
# MLflow params name them so, and a report only echoes them. The rule: a string may name these two
# as config fields anywhere; code that reads them from a report uses Key.LR / Key.BATCH_SIZE.
CONFIG_FIELDS = frozenset({"lr", "batch_size"})
# (file, string): why that string in that file is not the report key it equals
NOT_REPORT_KEYS = {
    ("trainer/training/checkpointing.py", "epoch"):
        "a checkpoint file's own field (save_checkpoint, saved_epoch)",
    ("trainer/serving/mlflow_model.py", "epoch"): "the checkpoint fields a served model keeps (KEPT)",
    ("trainer/training/run.py", "diverged"): "how an epoch ended (TRAINED, DIVERGED, OUT_OF_MEMORY), a word",
    ("trainer/training/precision.py", "tf32"): "torch's cudnn fp32_precision setting",
    ("tune/outputs/status.py", "diverged"): "Status.DIVERGED's word, for people",
    ("tune/study/space.py", "diverged"):
        "the Optuna constraint's name (DIVERGED_CONSTRAINT), kept in studies",
    ("tune/outputs/tables.py", "epoch"): "the console table's header over the best epoch",
    ("tune/tracking/registry.py", "epoch"): "a registered model version's tag (EPOCH_TAG)",
}


def library_files() -> dict[str, Path]:
    """{path from the repository root: file} of every library module, each once (vidtune/trainer
    and the others are links to the top-level folders)."""
    files = {}
    for folder in LIBRARY:
        for path in (REPO / folder).rglob("*.py"):
            real = path.resolve()
            files[real.relative_to(REPO).as_posix()] = real
    return dict(sorted(files.items()))


def spelled_keys(source: str, name: str) -> list[tuple[str, str]]:
    """(`name:line: "key"`, key) for each string constant of `source` (f-string parts too) that
    equals a report key, CONFIG_FIELDS and `name`'s NOT_REPORT_KEYS entries aside."""
    keys = {k.value for k in Key} - CONFIG_FIELDS
    found = []
    for node in ast.walk(ast.parse(source, filename=name)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in keys \
                and (name, node.value) not in NOT_REPORT_KEYS:
            found.append((f"{name}:{node.lineno}: {node.value!r}: write Key.{Key(node.value).name}",
                          node.value))
    return sorted(found)


def test_no_library_file_spells_a_report_key():
    files = library_files()
    assert DECLARATION in files and "tune/tracking/runs.py" in files and "vidtune/cli.py" in files
    spelled = [where for name, path in files.items() if name != DECLARATION
               for where, _ in spelled_keys(path.read_text(encoding="utf-8"), name)]
    assert not spelled, "a report key spelled outside trainer/training/report_keys.py:\n" + "\n".join(spelled)


def test_a_key_spelled_in_the_console_is_found_by_file_and_line():
    """The check above is live: "val_acc" written into tune/outputs/console.py is named, with its line."""
    source = (REPO / "tune" / "outputs" / "console.py").read_text(encoding="utf-8")
    line = source.count("\n") + 2
    found = spelled_keys(source + '\nMETRIC = "val_acc"\n', "tune/outputs/console.py")
    assert found == [(f"tune/outputs/console.py:{line}: 'val_acc': write Key.VAL_ACC", "val_acc")]
    assert spelled_keys('f"{x}" + "epoch"', "tune/outputs/tables.py") == []            # an allowed collision
    assert spelled_keys('cfg["lr"]', "tune/outputs/console.py") == []                   # a config field


def test_every_collision_let_through_is_still_there():
    """NOT_REPORT_KEYS holds no stale entry: each string is still in its file, and still a key."""
    files = library_files()
    for (name, value), why in NOT_REPORT_KEYS.items():
        assert value in {k.value for k in Key}, f"{value!r} is no report key now: drop it ({why})"
        tree = ast.parse(files[name].read_text(encoding="utf-8"))
        strings = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)}
        assert value in strings, f"{name} no longer spells {value!r}: drop its NOT_REPORT_KEYS entry"


def test_one_float_or_nan_helper():
    """`report_keys.number` is the only function that turns a value into a float or NaN (`try:
    return float(x)` / `except: return math.nan`); a copy elsewhere fails, naming its file."""
    def is_copy(fn: ast.FunctionDef) -> bool:
        body = [s for s in fn.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
        if len(body) != 1 or not isinstance(body[0], ast.Try):
            return False
        text = ast.unparse(body[0])
        return "return float(" in text and "return math.nan" in text

    copies = [f"{name}:{fn.lineno}: {fn.name}" for name, path in library_files().items()
              for fn in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
              if isinstance(fn, ast.FunctionDef) and is_copy(fn)]
    assert copies == [f"{DECLARATION}:{report_keys.number.__code__.co_firstlineno}: number"]
