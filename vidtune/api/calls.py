"""vidtune from Python: the commands' twins (`search`, `train`, `predict`), for scripts and notebooks.

    import vidtune
    result = vidtune.search(data="/data/rwf2000", model="mvit_v2_s", num_samples=12, epochs=5)
    result.best, result.trials          # the best TrialResult; every trial as a pandas DataFrame
    vidtune.predict(result, ["a.mp4"])  # P(violent) per video, with the search's best model

Every option is a keyword named as its flag with underscores (`--lr-min` is `lr_min`,
`--no-early-stop` is `early_stop=False`), read through the same declaration, presets, checks and
messages as the command (`tune.config.options.resolve`). Bad input raises `vidtune.errors.ConfigError`
(or `DataError`) naming the keyword and saying what to do; nothing here calls `sys.exit`. A
search interrupted by Ctrl-C or a notebook kernel's interrupt stops as the command does and
raises `vidtune.errors.SearchInterrupted` (`resume=True` continues it).
"""
from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pandas as pd

from vidtune.api.keywords import keyword_values, model_reference, python_terms
from vidtune.api.result import SearchResult, TrainResult, load
from vidtune.errors import ConfigError, DataError, SearchInterrupted
from vidtune.trainer.commands import train as train_cli
from vidtune.trainer.commands.train_run import fit
from vidtune.trainer.serving import scoring
from vidtune.trainer.serving.predict import DEFAULT_STORE, PredictOptions, registered_checkpoint
from vidtune.trainer.training import checkpointing
from vidtune.tune.config.options import SPECS, load_config_file, resolve
from vidtune.tune.search import run_search
from vidtune.tune.summary import results_folder


def search(data: str | os.PathLike[str] | None = None, model: str | Callable[..., Any] | None = None, *,
           config: str | os.PathLike[str] | None = None, **options: Any) -> SearchResult | None:
    """Run a search, as `vidtune search` does, and return it as a `SearchResult`.

    `data`: the folder of videos (or a CSV manifest); None runs the demo on generated videos.
    `model`: a built-in name (`tiny`, `mvit_v2_s`, `swin3d_t`, `hf:ID`), `"package.module:function"`,
    or that function itself (a factory defined in an importable module, docs/own-model.md).
    `config`: a TOML or YAML file of options, which keywords override. `options`: any other flag of
    `vidtune search` as a keyword (`num_samples=8, epochs=3, batch_sizes=[8, 16], lr_min=1e-4,
    storage="results", name="rwf-mvit", mlflow_uri="sqlite:///mlruns.db", resume=True`).
    Returns None for `dry_run=True` (checked and printed, nothing run). Raises ConfigError /
    DataError for unusable input (before Ray starts), RayStartError, DiskFullError, and
    SearchInterrupted (a KeyboardInterrupt carrying `.result`) when interrupted."""
    keywords = dict(options)
    if data is not None:
        keywords["data"] = data
    if model is not None:
        keywords["model"] = model_reference(model)
    call = "vidtune.search"
    with python_terms(SPECS):
        given = keyword_values(call, SPECS, keywords)
        loaded = None
        if config is not None:
            given["config"] = os.fspath(config)
            loaded = load_config_file(given["config"])
        opts = resolve(given, loaded)
        # a resume checks what this call set against the search's saved options
        resumed = {**(loaded.values if loaded else {}), **given} if opts.resume else None
        try:
            code, plan = run_search(opts, given=resumed)
        except SearchInterrupted as e:   # before the first trial: says what was kept and what to run
            raise SearchInterrupted(f"vidtune.search was {e}") from None
        except KeyboardInterrupt:   # a second interrupt during the graceful stop: Tune's last saved state
            raise SearchInterrupted("vidtune.search was stopped at once by a second interrupt; continue it "
                                    "with resume=True") from None
    if plan is None:
        return None
    try:    # the search's folder, or on remote storage the local copy of its results
        result = load(results_folder(plan) or plan.search_path)
    except ConfigError:
        if code != 130:
            raise
        result = None   # interrupted before its first summary: nothing to read back yet
    if code == 130:
        raise SearchInterrupted(
            f"vidtune.search was interrupted; every MLflow run was closed and the trials' checkpoints "
            f"kept: continue with vidtune.search(..., name={plan.name!r}, storage={str(plan.storage)!r}, "
            f"resume=True). The search as it stood is this exception's .result", result)
    return result


def train(data: str | os.PathLike[str] | None = None, model: str | Callable[..., Any] | None = None, *,
          config: str | os.PathLike[str] | SearchResult | None = None, **options: Any) -> TrainResult:
    """Train one configuration, as `vidtune train` does, and return its best checkpoint and
    per-epoch history as a `TrainResult`.

    `config`: a search's result (its best_config.json: the best trial's whole configuration) or a
    best_config.json / TOML / YAML file; keywords override it. `options`: any flag of `vidtune train`
    as a keyword (`batch_size=8, lr=3e-4, epochs=10, storage="runs", name="rwf-best"`). Raises
    ConfigError / DataError for unusable input (before Ray starts) and `TrainingError` when the
    run leaves no result (out of memory, diverged, failed)."""
    keywords = dict(options)
    if data is not None:
        keywords["data"] = data
    if model is not None:
        keywords["model"] = model_reference(model)
    if isinstance(config, SearchResult):
        if config.best_config_file is None:
            raise ConfigError("config", f"search {config.name} has no best trial to train again "
                              f"({config.path} holds no best_config.json); pass batch_size and lr instead")
        config = config.best_config_file
    specs = train_cli.ALL_FLAGS
    with python_terms(specs):
        given = keyword_values("vidtune.train", specs, keywords)
        loaded = train_cli.load_config_file(os.fspath(config)) if config is not None else None
        if loaded:
            print(train_cli.describe(loaded), flush=True)
        cfg = train_cli.build(train_cli.TrainConfig, train_cli.merged(train_cli.TRAIN_FLAGS, given, loaded))
        where = train_cli.build(train_cli.RunOptions, train_cli.merged(train_cli.RUN_FLAGS, given, loaded))
        try:
            index = train_cli.check_inputs(cfg, where)
        except ConfigError as e:
            raise (loaded.blame(e, specs, given) if loaded else e) from None
        outcome = fit(cfg, where, index)
    return TrainResult(name=outcome.name, path=outcome.path, checkpoint=outcome.checkpoint,
                       epoch=outcome.epoch, val_acc=outcome.val_acc,
                       history=pd.DataFrame(outcome.reports))


def predict(model: SearchResult | TrainResult | str | os.PathLike[str],
            videos: Iterable[str | os.PathLike[str]], *, mlflow_uri: str | None = None,
            precision: str = "auto", device: str = "auto", on_error: str = "raise") -> pd.Series:
    """P(violent) of each video: the centred clip validation scored (as `vidtune predict` and the
    registered MLflow model score it), with `model`: a search's result (its best checkpoint, else
    its registered model), a training run's result, a checkpoint folder or file, or a registered
    model `models:/NAME/VERSION` (looked up in `mlflow_uri`, default the search's store or
    $MLFLOW_TRACKING_URI). Returns a float Series indexed by the videos as given, named
    `P(<violent class>)`. A video that cannot be read raises DataError naming it (after the others
    were scored); `on_error="nan"` scores it NaN instead."""
    if on_error not in ("raise", "nan"):
        raise ConfigError("on_error", f"got {on_error!r}; give 'raise' or 'nan'")
    source, store = _checkpoint_of(model, mlflow_uri)
    paths = [os.fspath(v) for v in ([videos] if isinstance(videos, (str, os.PathLike)) else videos)]
    with tempfile.TemporaryDirectory(prefix="vidtune-predict-") as tmp:
        try:
            device_ = scoring.device_named(device)
            if source.startswith("models:/"):
                opts = PredictOptions(checkpoint=source, mlflow_uri=store or DEFAULT_STORE)
                with python_terms({"--checkpoint": "model", "--mlflow-uri": "mlflow_uri"}):
                    source = str(registered_checkpoint(opts, tmp))
            predictor = scoring.Predictor.from_checkpoint(source, device_, precision)
        except (checkpointing.CheckpointError, ValueError) as e:
            raise ConfigError("model", f"{source}: {e}") from None
        scores, failed = {}, []
        for video in paths:
            try:
                scores[video] = scoring.video_score(predictor, Path(video))
            except scoring.VideoReadError as e:
                scores[video] = float("nan")
                failed.append(str(e))
    if failed and on_error == "raise":
        raise DataError(f"{len(failed)} of {len(paths)} video(s) could not be scored: {'; '.join(failed)}; "
                        "fix or leave them out, or pass on_error='nan' to score the others")
    return pd.Series(scores, name=f"P({predictor.positive_name})", dtype=float)


def _checkpoint_of(model: Any, mlflow_uri: str | None) -> tuple[str, str | None]:
    """(checkpoint path or models:/ URI, MLflow store) of what `predict` was given."""
    if isinstance(model, SearchResult):
        if model.best_checkpoint and Path(model.best_checkpoint).exists():
            return model.best_checkpoint, mlflow_uri
        if model.model_uri:
            return model.model_uri, mlflow_uri or model.mlflow_uri
        raise ConfigError("model", f"search {model.name} has no best checkpoint left ({model.path}) and no "
                          "registered model; pass a checkpoint folder or a models:/ URI")
    if isinstance(model, TrainResult):
        return model.checkpoint, mlflow_uri
    if isinstance(model, (str, os.PathLike)):
        return os.fspath(model), mlflow_uri or os.environ.get("MLFLOW_TRACKING_URI")
    raise ConfigError("model", f"got {type(model).__name__}; give a SearchResult, a TrainResult, a "
                      "checkpoint path or a models:/NAME/VERSION URI")
