"""A registered model version that explains itself (`tune.tracking.registry`): its description
names the search (linked), the trial (linked) and epoch, the accuracy with its 95% interval, the
speed, input, output and scoring rule; its tags say objective, model and data; the alias `best`
moves to a version that scores at least as well on the same data and objective. The slow test
reads all of it from the MLflow store the session's real smoke search wrote."""
from __future__ import annotations

import csv
import json
import math
from dataclasses import replace

import pytest
from conftest import SMOKE_MODEL
from mlflow.tracking import MlflowClient

from vidtune.trainer.serving.scoring_rule import SCORING_RULE
from vidtune.tune.tracking import registry, view
from vidtune.tune.tracking.schema import PARENT_TAG

FACTS = registry.VersionFacts(
    search="/r/vidtune-results/rwf-mvit", experiment_id="1", search_run_id="parent0", trial_run_id="child3",
    trial="t03-bs8-lr2.5e-4", epoch=3, epochs=4, val_acc=0.78125, val_clips=32, speed=45.12,
    objective="val_acc", score=0.78125, model="mvit_v2_s", data="/data/rwf-2000")


@pytest.fixture
def registered(tmp_path):
    """A SQLite store with registered model "rwf" and `add()` making its next version."""
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlruns.db'}")
    client.create_registered_model("rwf")

    def add() -> int:
        return int(client.create_model_version("rwf", source=(tmp_path / "m").as_uri()).version)
    return client, add


def test_the_description_says_what_the_version_is_and_links_its_runs():
    text = registry.version_description(FACTS, "rwf", scoring_rule="The rule.")
    assert "vidtune search `rwf-mvit`" in text
    assert f"({view.run_link('1', 'parent0')})" in text
    assert f"[t03-bs8-lr2.5e-4]({view.run_link('1', 'child3')})" in text
    assert "epoch 3 of 4" in text
    assert "0.781 [0.61, 0.89] (95% interval, 32 validation clips)" in text
    assert "45.1 clips/s" in text and "mvit_v2_s" in text and "/data/rwf-2000" in text
    assert f"**Input**: {registry.INPUT}" in text and f"**Output**: {registry.OUTPUT}" in text
    assert "**Scoring rule**: The rule." in text
    assert "workflowType=machine_learning" in view.run_link("1", "parent0")   # the model-training UI
    f1 = registry.version_description(replace(FACTS, objective="val_f1", score=0.7), "rwf")
    assert "val_f1 0.700" in f1 and "by val_f1" in f1


def test_best_moves_to_each_new_best_on_the_same_data_and_objective(registered):
    client, add = registered

    def register(score: float, **kw) -> str:
        version = add()
        return registry.describe_version(client, "rwf", version, replace(FACTS, score=score, **kw))

    assert register(0.75).endswith("models:/rwf@best is now version 1")
    said = register(0.70)    # worse: best stays
    assert "stays on version 1" in said and "0.75 > this version's 0.7" in said
    assert int(client.get_model_version_by_alias("rwf", "best").version) == 1
    assert register(0.80).endswith("is now version 3 (was version 1)")
    assert register(0.80).endswith("is now version 4 (was version 3)")    # a tie: the newer
    assert register(0.10, data="/data/other").endswith("is now version 5 (was version 4)")   # not comparable
    assert int(client.get_model_version_by_alias("rwf", "best").version) == 5
    v2 = client.get_model_version("rwf", "2")
    assert {k: v2.tags[k] for k in ("objective", "model", "data", "score", "trial", "epoch")} == {
        "objective": "val_acc", "model": "mvit_v2_s", "data": "/data/rwf-2000", "score": "0.7",
        "trial": "t03-bs8-lr2.5e-4", "epoch": "3"}
    assert "vidtune search `rwf-mvit`" in v2.description
    assert "alias `best`" in client.get_registered_model("rwf").description


def test_a_version_without_a_score_takes_best_from_none_and_leaves_it_to_any(registered):
    client, add = registered
    registry.describe_version(client, "rwf", add(), replace(FACTS, score=math.nan, val_acc=math.nan))
    assert "score" not in client.get_model_version("rwf", "1").tags
    assert "Validation accuracy**: -" in client.get_model_version("rwf", "1").description
    said = registry.describe_version(client, "rwf", add(), replace(FACTS, score=0.1))
    assert said.endswith("now version 2 (was version 1)")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_smoke_searchs_registered_version_explains_itself(smoke_search, synthetic_root):
    """The session's smoke search registered its best model: the version's description names
    the search, its best trial and epoch with the accuracy and interval trials.csv gives it, and
    links the search's run; its tags say objective, model and data; `best` is on it; the search
    printed where `best` is."""
    out = smoke_search
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    client = MlflowClient(out.uri)
    version = client.get_model_version_by_alias(SMOKE_MODEL, "best")
    assert f"alias: models:/{SMOKE_MODEL}@best is now version {version.version}" in out.stdout
    best = json.loads((out.results / "best_config.json").read_text())
    with open(out.results / "trials.csv", newline="") as f:
        row = next(r for r in csv.DictReader(f) if r["name"] == best["checkpoint_trial"])
    run = client.get_run(version.run_id)
    assert run.info.run_name == row["name"]
    text = version.description
    low, high = float(row["best_val_acc_low"]), float(row["best_val_acc_high"])
    assert f"{float(row['best_val_acc']):.3f} [{low:.2f}, {high:.2f}]" in text
    assert f"[{row['name']}]({view.run_link(run.info.experiment_id, run.info.run_id)})" in text
    assert view.run_link(run.info.experiment_id, run.data.tags[PARENT_TAG]) in text
    assert f"vidtune search `{out.results.name}`" in text
    assert "**Input**" in text and "**Output**" in text and f"**Scoring rule**: {SCORING_RULE}" in text
    assert version.tags["objective"] == "val_acc" and version.tags["model"] == "tiny"
    assert version.tags["data"] == str(synthetic_root)
