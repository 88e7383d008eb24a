"""The registered model version as MLflow's registry shows it: a description that explains it
(which search, trial and epoch, the accuracy with its 95% interval, the training speed, what
goes in and comes out, how a video is scored (`trainer.serving.scoring_rule.SCORING_RULE`, the rule
`vidtune predict` and the served model apply), links to the search's run and the trial's run),
tags (objective, model, data, the score that ranks it) and the alias `best`, which moves to a
version that scores at least as well as the one holding it (on the same data and objective).

`tune.best_model.log_best_model` calls `describe_version` right after `trainer.serving.mlflow_model` has
logged and registered the search's best checkpoint.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from vidtune.trainer.serving.scoring_rule import SCORING_RULE
from vidtune.trainer.training.report_keys import Key
from vidtune.tune.outputs.uncertainty import accuracy_interval, format_interval
from vidtune.tune.tracking import view

BEST_ALIAS = "best"
OBJECTIVE_TAG, MODEL_TAG, DATA_TAG = "objective", "model", "data"
SCORE_TAG = "score"              # the objective's metric at the registered epoch: what ranks versions
SEARCH_TAG, TRIAL_TAG, EPOCH_TAG = "search", "trial", "epoch"
INPUT = ("video file paths (a JSON list `{\"inputs\": [...]}`, or a DataFrame's one column), each a "
         "file the serving machine can read")
OUTPUT = "P(violent) in [0, 1] per video, in the order given"


@dataclass(frozen=True)
class VersionFacts:
    """What the description and tags say about one registered version."""

    search: str                 # the search's folder (its name is the last part)
    experiment_id: str
    search_run_id: str          # the search's parent run
    trial_run_id: str           # the trial's child run, which logged the model
    trial: str                  # the trial's name (t03-bs8-lr2.5e-4)
    epoch: int                  # the checkpoint's epoch
    epochs: int                 # the search's --epochs
    val_acc: float              # at that epoch
    val_clips: int              # validation clips (the interval; 0: none)
    speed: float                # the trial's steady-state training clips/s (nan: unknown)
    objective: str              # --objective
    score: float                # the objective's metric at that epoch (pareto: val_acc)
    model: str                  # --model
    data: str                   # the dataset's folder or manifest


def version_tags(f: VersionFacts) -> dict[str, str]:
    """The version's tags: objective, model, data; the score that ranks it for the alias; the
    search, trial and epoch it comes from."""
    tags = {OBJECTIVE_TAG: f.objective, MODEL_TAG: f.model, DATA_TAG: f.data,
            SEARCH_TAG: f.search.rstrip("/").rsplit("/", 1)[-1], TRIAL_TAG: f.trial, EPOCH_TAG: str(f.epoch)}
    if math.isfinite(f.score):
        tags[SCORE_TAG] = f"{f.score:.6g}"
    return tags


def version_description(f: VersionFacts, name: str, scoring_rule: str = SCORING_RULE) -> str:
    """The version's description (markdown; the links are relative to the UI, as the search's run's
    are, and open the pages that show the objective: the search's answer and trials table, the
    trial's run)."""
    search = f.search.rstrip("/").rsplit("/", 1)[-1]
    interval = format_interval(*accuracy_interval(f.val_acc, f.val_clips))
    acc = f"{f.val_acc:.3f}" if math.isfinite(f.val_acc) else "-"
    if interval and math.isfinite(f.val_acc):
        acc += f" {interval} (95% interval, {f.val_clips} validation clips)"
    metric = view.objective_metric(f.objective).removeprefix("best_")
    score = f"; {metric} {f.score:.3f}" if metric != Key.VAL_ACC and math.isfinite(f.score) else ""
    fast = math.isfinite(f.speed) and f.speed > 0
    speed = f"{f.speed:.1f} clips/s (training, steady state)" if fast else "-"
    lines = [
        f"**The best model of vidtune search `{search}`** by {f.objective} "
        f"([the search's run]({view.run_link(f.experiment_id, f.search_run_id)}): its answer, trials table "
        "and plots).", "",
        f"- **Trial**: [{f.trial}]({view.run_link(f.experiment_id, f.trial_run_id)}), its epoch {f.epoch} of "
        f"{f.epochs} (the checkpoint registered here)",
        f"- **Validation accuracy**: {acc}{score}",
        f"- **Speed**: {speed}",
        f"- **Model**: {f.model}, trained on {f.data}",
        f"- **Input**: {INPUT}",
        f"- **Output**: {OUTPUT}",
        f"- **Scoring rule**: {scoring_rule}",
        "",
        f"Load it with `mlflow.pyfunc.load_model(\"models:/{name}@{BEST_ALIAS}\")` (the alias "
        f"`{BEST_ALIAS}` is on the version that scores best on the same data and objective) or "
        f"`models:/{name}/<version>`.",
    ]
    return "\n".join(lines)


def _holder(client: MlflowClient, name: str):
    try:
        return client.get_model_version_by_alias(name, BEST_ALIAS)
    except MlflowException:   # no version holds it yet
        return None


def moves_alias(new: dict[str, str], held: dict[str, str] | None) -> bool:
    """Whether `best` moves to a version tagged `new` from the one tagged `held` (None: no version
    holds it): when it scores at least as well on the same data and objective, or the holder's
    score is not comparable (other data, another objective, no score), the newer wins."""
    if held is None:
        return True
    same = all(held.get(k) == new.get(k) for k in (OBJECTIVE_TAG, DATA_TAG))
    try:
        return not same or float(new[SCORE_TAG]) >= float(held[SCORE_TAG])
    except (KeyError, ValueError):
        return True


def describe_version(client: MlflowClient, name: str, version: int, facts: VersionFacts, *,
                     scoring_rule: str = SCORING_RULE) -> str:
    """Write registered version `version` of `name`'s description and tags and move the alias
    `best` to it when it scores at least as well as the holder (`moves_alias`); the registered
    model gets a description when it has none. Returns the console line saying where `best` is."""
    tags = version_tags(facts)
    text = version_description(facts, name, scoring_rule)
    client.update_model_version(name, str(version), description=text)
    for key, value in tags.items():
        client.set_model_version_tag(name, str(version), key, value)
    if not client.get_registered_model(name).description:
        client.update_registered_model(name, description=(
            f"Video classifiers (P(violent) per video file) from vidtune searches. The alias `{BEST_ALIAS}` "
            "is on the version that scores best on the same data and objective; each version's description "
            "says which search, trial and epoch it is, how accurate and fast."))
    holder = _holder(client, name)
    if holder is not None and str(holder.version) == str(version):
        return f"  alias: models:/{name}@{BEST_ALIAS} is version {version}"
    if moves_alias(tags, dict(holder.tags) if holder is not None else None):
        client.set_registered_model_alias(name, BEST_ALIAS, str(version))
        was = f" (was version {holder.version})" if holder is not None else ""
        return f"  alias: models:/{name}@{BEST_ALIAS} is now version {version}{was}"
    return (f"  alias: models:/{name}@{BEST_ALIAS} stays on version {holder.version} "
            f"(its {facts.objective} {holder.tags.get(SCORE_TAG)} > this version's "
            f"{tags.get(SCORE_TAG, '-')})")
