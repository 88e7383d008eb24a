"""The search's best checkpoint into MLflow: logged as a model in its trial's run, registered
under --register-model with its description, tags and the alias `best`, and the summary's
lines saying how to load and serve it."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import ray.train

from vidtune.trainer.serving import mlflow_model
from vidtune.tune.config.options import SearchOptions
from vidtune.tune.outputs.found import Summary
from vidtune.tune.preflight import Plan
from vidtune.tune.running import faults
from vidtune.tune.tracking import registry
from vidtune.tune.tracking.tracker import MLflowTracker


@dataclass(frozen=True)
class BestModel:
    """What `log_best_model` did: `lines` for the summary; `uri` loads the model (`models:/NAME/
    VERSION` when registered), None when it was not logged."""

    lines: list[str] = field(default_factory=list)
    uri: str | None = None


def log_best_model(plan: Plan, opts: SearchOptions, summary: Summary, tracker: MLflowTracker) -> BestModel:
    """Log the search's best whole checkpoint as an MLflow model in its trial's run, registered
    under --register-model (`trainer.serving.mlflow_model`); returns its URI and the summary's lines saying
    how to load and serve it, or the one line saying why it is not in MLflow. Never raises: the
    search's results and exit code stand either way. Not with --no-log-model, nor for an
    interrupted search (its --resume logs the model of the finished search)."""
    row = summary.checkpoint
    if row is None or summary.interrupted or not opts.tracking.log_model:
        return BestModel()
    run_id = tracker.child_runs.get(row.trial_id)
    example = plan.index.val[0].path if plan.index is not None and plan.index.val else None
    why = (f"trial {row.name} has no MLflow run" if run_id is None else
           "no validation video to be its input example" if example is None else None)
    if why is None:
        try:
            uri, registered = opts.tracking.mlflow_uri, opts.tracking.model_name
            trial = f"{row.name}'s epoch {row.checkpoint_epoch}"
            # already registered (a resume of a search that registered it, whose search.json
            # could not say it had finished: tune/state/finished.py): said, not registered again
            known = registered and registered_version(tracker, registered, run_id, row.checkpoint_epoch)
            if known:
                return BestModel(mlflow_model.usage_lines(known, uri, trial=trial) + [
                    f"  already registered as version {known.version} of {registered}: not registered again"],
                    known.uri)
            with local_checkpoint(str(row.checkpoint)) as folder:
                logged = mlflow_model.log_model(uri, run_id, folder, example_video=example,
                                                registered_name=registered)
            lines = mlflow_model.usage_lines(logged, opts.tracking.mlflow_uri, trial=trial)
            return BestModel(lines + describe_registered(plan, opts, summary, tracker, logged, run_id),
                             logged.uri)
        except Exception as e:   # the model is a convenience on top of the results: never their end
            why = faults.one_line(e, 200)
    return BestModel([f"best model: not logged in MLflow ({why}); the results and the best checkpoint above "
                      "stand"])


def registered_version(tracker: MLflowTracker, name: str, run_id: str,
                       epoch: int) -> mlflow_model.Logged | None:
    """The version of registered model `name` that holds this checkpoint already: logged from the
    trial's run `run_id`, tagged with its epoch (`tune.tracking.registry`); None when there is none
    or the registry cannot say (a model is then registered, as before)."""
    client = getattr(tracker, "client", None)
    if client is None:
        return None
    try:
        versions = client.search_model_versions(f"name = '{name}' and run_id = '{run_id}'")
    except Exception:   # an older store or a registry that refuses the filter: register as before
        return None
    same = [v for v in versions if (v.tags or {}).get(registry.EPOCH_TAG) == str(epoch)]
    if not same:
        return None
    found = max(same, key=lambda v: int(v.version))
    return mlflow_model.Logged(f"models:/{name}/{found.version}", str(found.source).removeprefix("models:/"),
                               name, int(found.version))


def describe_registered(plan: Plan, opts: SearchOptions, summary: Summary, tracker: MLflowTracker,
                        logged: mlflow_model.Logged, run_id: str) -> list[str]:
    """The registered version's description, tags and alias `best` (`tune.tracking.registry`);
    returns the line saying where `best` is. Never raises: the version stands without them."""
    row = summary.checkpoint
    if logged.name is None or logged.version is None or row is None:
        return []
    try:
        facts = registry.VersionFacts(
            search=plan.search_path, experiment_id=tracker.experiment_id, search_run_id=tracker.open_parent(),
            trial_run_id=run_id, trial=row.label, epoch=row.checkpoint_epoch, epochs=opts.train.epochs,
            val_acc=row.checkpoint_val_acc, val_clips=summary.val_clips, speed=row.clips_per_s,
            objective=opts.objective, score=row.checkpoint_score, model=opts.train.model,
            data=plan.base.data.root)
        return [registry.describe_version(tracker.client, logged.name, logged.version, facts)]
    except Exception as e:   # the registry refused a write: the version is there, undescribed
        return [f"  the version's description and alias were not written ({faults.one_line(e, 200)})"]


def local_checkpoint(path: str) -> contextlib.AbstractContextManager[str]:
    """The checkpoint folder `path` on this machine for the block: itself, or, on remote storage
    (`--storage s3://...`, gs://, the shared storage of a cluster), a download of it that the
    block's end removes (Ray Train's own `Checkpoint.as_directory`)."""
    if "://" not in path:
        return contextlib.nullcontext(path)
    return ray.train.Checkpoint(path).as_directory()
