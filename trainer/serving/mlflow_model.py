"""A trained checkpoint as an MLflow model: logged in a run, registered, loaded by `models:/` URI.

One MLflow model, two flavours:

- `python_function`: video file paths in (a list, or a DataFrame's one column), P(violent) in
  [0, 1] per video out, by the one scoring rule (`trainer.serving.scoring_rule`): the centred clip that
  validation scored, what `vidtune predict` prints (`trainer.serving.scoring.video_score`, the same
  code); `params={"aggregation": "max" | "mean"}` asks for another. Its signature comes from
  `VideoModel.predict`'s type hints (list[str] -> list[float]) and its input example (a
  validation video's path, with the default params). A batch with a path that cannot be scored
  is refused as a whole, before any video is scored: MlflowException INVALID_PARAMETER_VALUE
  (HTTP 400 from `mlflow models serve`, no stack trace), one line per bad path (`bad_paths`).
  Saved as MLflow's "models from code" (no pickled Python object) with the checkpoint (its
  weights and settings, not the optimizer's state) as its artifact, read back with
  `torch.load(weights_only=True)`. An `hf:` model also carries its config and image processor
  (`scoring.HF_CONFIG_FOLDER`, beside the checkpoint) and builds from them: it loads without its
  hub id in the cache or the folder it was trained from. An own model (`--model module:function`,
  `trainer.models.own_models`) carries its module's file or package folder (MLflow's `code_paths`, put
  on `sys.path` as the model loads): it loads where that module is not importable.
- `pytorch`: the bare network, exported with `torch.export` (MLflow's `pt2` format, no pickle):
  `mlflow.pytorch.load_model(uri)` gives a module from float32 clips `B x 3 x T x H x W`,
  normalised as `trainer.serving.scoring.Predictor.transform` does, to logits `B x 2`. A network that
  `torch.export` cannot trace is left out, the reason in the model's metadata (`NO_TORCH_KEY`).

The model imports the installed vidtune package when it loads (its requirements name it): serve
it from an environment where vidtune is installed (`mlflow models serve --env-manager local`).
Nothing is downloaded or inferred over the network: the pip requirements are listed here.
"""
from __future__ import annotations

import io
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager, redirect_stderr
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import mlflow
import mlflow.artifacts
import mlflow.pyfunc
import mlflow.pytorch
import torch
from mlflow.exceptions import MlflowException
from mlflow.models import Model, infer_signature
from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE
from mlflow.tracking import MlflowClient

from vidtune import servers
from vidtune.trainer.models import own_models
from vidtune.trainer.models.registry import is_hf_model, is_own_model
from vidtune.trainer.serving import scoring
from vidtune.trainer.serving.scoring_rule import AGGREGATIONS, CENTRE
from vidtune.trainer.training.checkpointing import FILE_NAME, checkpoint_file, load_checkpoint

MODEL_NAME = "model"               # the logged model's name in its run
TORCH_DATA = "pytorch"             # the exported network's folder inside the model
NO_TORCH_KEY = "vidtune_no_pytorch_flavour"   # the model's metadata: why its network was not exported
# The code MLflow keeps with the model and runs to build it ("models from code").
MODEL_CODE = ("from mlflow.models import set_model\n\n"
              "from vidtune.trainer.serving.mlflow_model import VideoModel\n\n"
              "set_model(VideoModel())\n")
# What the python_function model is told at load time (`model_config`); `vidtune predict`'s defaults.
SCORING = {"window_stride_s": 1.0, "batch_size": 8, "device": "auto", "precision": "auto"}
PARAMS = {"aggregation": CENTRE}   # what a request may change (`params`), with its default
# Kept in the model's checkpoint: what scoring needs, not the optimizer's state (2x the weights).
KEPT = ("format", "version", "epoch", "model", "config", "spec", "class_names", "metrics")
EXPERIMENT_ENV = "MLFLOW_EXPERIMENT_ID"   # read by MLflow's fluent API when no experiment is set
REQUIREMENTS = ("vidtune", "mlflow", "torch", "torchvision", "decord", "numpy", "pandas")


class ModelURIError(ValueError):
    """A `models:/` URI that names nothing usable; the message names what is missing."""


class VideoModel(mlflow.pyfunc.PythonModel):
    """The python_function flavour: video file paths -> P(violent) per video."""

    def load_context(self, context: Any) -> None:
        config = {**SCORING, **(context.model_config or {})}
        device = scoring.device_named(str(config["device"]))
        self.predictor = scoring.Predictor.from_checkpoint(context.artifacts["checkpoint"], device,
                                                           str(config["precision"]))
        self.window_stride_s = float(config["window_stride_s"])
        self.batch_size = int(config["batch_size"])

    def predict(self, context, model_input: list[str], params: dict[str, Any] | None = None) -> list[float]:
        """`model_input`: video file paths (MLflow turns a DataFrame's one column, or a
        `{"inputs": [...]}` request, into that list; its type hint is the model's signature).
        `params`: {"aggregation": centre | max | mean}. Raises MlflowException
        (INVALID_PARAMETER_VALUE) naming every path that cannot be scored, or a bad aggregation."""
        aggregation = str((params or {}).get("aggregation") or CENTRE)
        if aggregation not in AGGREGATIONS:
            raise MlflowException(f"params: aggregation {aggregation!r} is not one of "
                                  f"{', '.join(AGGREGATIONS)}", error_code=INVALID_PARAMETER_VALUE)
        probes, bad = bad_paths(model_input)
        if not bad:
            try:
                return [video_probability(self.predictor, Path(path), self.window_stride_s,
                                          self.batch_size, aggregation, info=info)
                        for path, info in zip(model_input, probes, strict=True)]
            except scoring.VideoReadError as e:   # probed fine, then a frame did not decode
                bad = [str(e)]
        raise MlflowException(refusal(bad, len(model_input)), error_code=INVALID_PARAMETER_VALUE)


def bad_paths(paths: list[str]) -> tuple[list[dict[str, Any] | None], list[str]]:
    """Each path's probe (None for a bad one) and one line per path that cannot be scored
    (`scoring.open_video`: empty, missing, a folder, not a regular file, does not decode)."""
    probes: list[dict[str, Any] | None] = []
    bad: list[str] = []
    for path in paths:
        try:
            probes.append(scoring.open_video(path))
        except scoring.VideoReadError as e:
            probes.append(None)
            bad.append(str(e))
    return probes, bad


def refusal(bad: list[str], total: int) -> str:
    """The error of a refused batch: what was refused, then one line per bad path."""
    return (f"{len(bad)} of {total} video path(s) cannot be scored (paths are read on the serving "
            "machine); nothing was scored, send the batch again without them:\n" + "\n".join(bad))


def video_probability(p: scoring.Predictor, path: Path, window_stride_s: float, batch_size: int,
                      aggregation: str = CENTRE, info: dict[str, Any] | None = None) -> float:
    """A video's P(violent) by the scoring rule (`scoring.video_score`): by default the centred
    clip validation scored, so the model's accuracy on the validation videos is the reported one."""
    return scoring.video_score(p, path, aggregation, window_stride_s, batch_size, info=info)


# -- saving and logging ------------------------------------------------------------------------

def requirements() -> list[str]:
    """The model's pip requirements, pinned to what is installed here (never inferred: MLflow's
    inference loads the model in a subprocess and may ask the network)."""
    out = []
    for name in REQUIREMENTS:
        try:
            out.append(f"{name}=={metadata.version(name)}")
        except metadata.PackageNotFoundError:
            out.append(name)
    return out


def slim_checkpoint(source: str | Path, target: Path) -> dict[str, Any]:
    """Copy the checkpoint `source` (file or folder) to `target`, keeping what scoring reads
    (`KEPT`), not the optimizer's, scaler's and scheduler's state; returns what it kept.
    Raises CheckpointError."""
    state = load_checkpoint(source)
    kept = {k: state[k] for k in KEPT if k in state}
    torch.save(kept, target)
    return kept


def save_model(path: str, mlflow_model: Model | None = None, *, checkpoint: str | Path,
               example_video: str | Path, **_: Any) -> None:
    """Write the two-flavour model of `checkpoint` to the new folder `path` (the `flavor` hook
    of `mlflow.models.Model.log`). `example_video`: a video file's path, the input example."""
    mlflow_model = mlflow_model or Model()
    with tempfile.TemporaryDirectory(prefix="vidtune-model-") as tmp:
        slim = Path(tmp) / FILE_NAME
        kept = slim_checkpoint(checkpoint, slim)
        code = Path(tmp) / "vidtune_video_model.py"
        code.write_text(MODEL_CODE)
        predictor = scoring.Predictor.from_checkpoint(slim, torch.device("cpu"), "fp32")
        artifacts, name = {"checkpoint": str(slim)}, kept["spec"]["name"]
        if is_hf_model(name):   # its config and processor: it loads without its source
            artifacts[scoring.HF_CONFIG_FOLDER] = str(predictor.model.save_pretrained(
                Path(tmp) / scoring.HF_CONFIG_FOLDER, weights=False))
        mlflow.pyfunc.save_model(
            path, mlflow_model=mlflow_model, python_model=str(code), artifacts=artifacts,
            model_config=SCORING, input_example=([str(example_video)], PARAMS),
            pip_requirements=requirements(),
            code_paths=(own_models.code_paths(name) or None) if is_own_model(name) else None)
        try:
            add_torch_flavour(mlflow_model, Path(path), predictor, Path(tmp) / "torch")
        except Exception as e:   # a network torch.export cannot trace: the video model still serves
            mlflow_model.metadata = {**(mlflow_model.metadata or {}),
                                     NO_TORCH_KEY: f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"}
    mlflow_model.save(str(Path(path) / "MLmodel"))


def add_torch_flavour(mlflow_model: Model, path: Path, p: scoring.Predictor, scratch: Path) -> None:
    """Export `p.model` (pt2: a graph, no pickle; batch size free) with `mlflow.pytorch` into
    `scratch`, move its data into `path/TORCH_DATA` and add its `pytorch` flavour to
    `mlflow_model` (whose `python_function` flavour stays `VideoModel`)."""
    clips = torch.zeros(2, 3, p.num_frames, p.height, p.width)   # batch 2: a batch of 1 exports as fixed
    with torch.inference_mode():
        logits = p.model(clips)
    mlflow.pytorch.save_model(p.model, str(scratch), serialization_format="pt2",
                              input_example=(clips.numpy(),),
                              signature=infer_signature(clips.numpy(), logits.numpy()),
                              pip_requirements=requirements())
    conf = dict(Model.load(str(scratch)).flavors["pytorch"])
    shutil.move(str(scratch / conf["model_data"]), str(path / TORCH_DATA))
    mlflow_model.add_flavor("pytorch", **{**conf, "model_data": TORCH_DATA})


@contextmanager
def tracking_at(uri: str, experiment_id: str | None = None) -> Iterator[None]:
    """MLflow's fluent API (which `Model.log`, registration and `models:/` downloads use) pointed
    at store `uri` and experiment `experiment_id` for the block, without progress bars, then
    back: the search's own writes name their store on every call. (Without an experiment,
    `Model.log` files the model under the store's Default experiment, whatever its run's.)"""
    env = {"MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false",
           **({EXPERIMENT_ENV: experiment_id} if experiment_id is not None else {})}
    before, env_before = mlflow.get_tracking_uri(), {k: os.environ.get(k) for k in env}
    mlflow.set_tracking_uri(uri)
    os.environ.update(env)
    try:
        yield
    finally:
        mlflow.set_tracking_uri(before)
        for k, v in env_before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@dataclass(frozen=True)
class Logged:
    """A logged (and perhaps registered) model: `uri` loads it (`models:/NAME/VERSION` when
    registered, else `models:/<model id>`)."""

    uri: str
    model_id: str
    name: str | None = None
    version: int | None = None


def log_model(tracking_uri: str, run_id: str, checkpoint: str | Path, *, example_video: str | Path,
              registered_name: str | None = None) -> Logged:
    """Log `checkpoint` as run `run_id`'s model `MODEL_NAME` (with the run's params) and, when
    `registered_name` is given, register it as that model's next version. Raises on failure."""
    experiment_id = MlflowClient(tracking_uri).get_run(run_id).info.experiment_id
    # MLflow prints "Successfully registered model ..." on stderr: the caller says it its own way
    with tracking_at(tracking_uri, experiment_id), redirect_stderr(io.StringIO()):
        info = Model.log(None, name=MODEL_NAME, flavor=sys.modules[__name__], run_id=run_id,
                         registered_model_name=registered_name, checkpoint=checkpoint,
                         example_video=example_video,
                         # MLflow would score the example (seconds) only to log a warning if it failed
                         validate_serving_input=False)
    version = info.registered_model_version
    if registered_name and version is not None:
        return Logged(f"models:/{registered_name}/{version}", info.model_id, registered_name, int(version))
    return Logged(f"models:/{info.model_id}", info.model_id)


def usage_lines(logged: Logged, tracking_uri: str, trial: str = "") -> list[str]:
    """The search summary's lines: where the model is, how to load it, score videos with it
    and serve it; each command runs as printed in any shell (`vidtune.servers`)."""
    where = f"MLflow's registry: {logged.name} version {logged.version}" if logged.name else \
        "logged in MLflow, not registered"
    store = absolute(tracking_uri)
    return [f"best model: {logged.uri} ({where}{', ' + trial if trial else ''}); load it with "
            "mlflow.pyfunc.load_model (video paths in, P(violent) of the centred clip out, as validation "
            "scored it)",
            "  score videos: " + servers.vidtune_line("predict", "--checkpoint", logged.uri, "--mlflow-uri",
                                                      store, "VIDEO", "..."),
            f"  serve it: {servers.serve_line(store, logged.uri)}   (http://{servers.HOST}:"
            f"{servers.SERVE_PORT}/invocations)"]


# -- reading one back (`vidtune predict --checkpoint models:/NAME/VERSION`) ---------------------

sqlite_file = servers.sqlite_file       # the store's SQLite file, else None
absolute = servers.absolute_store       # a SQLite store's path made absolute
missing_store = servers.missing_store   # why a SQLite store is not there, else None


def check_model_uri(uri: str, tracking_uri: str) -> tuple[str, str]:
    """(name, version) of the registered model `uri` (models:/NAME/VERSION or models:/NAME@ALIAS)
    in the store `tracking_uri`; ModelURIError saying what is missing and what there is."""
    return _version_of(MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri), uri, tracking_uri)


def _version_of(client: MlflowClient, uri: str, tracking_uri: str) -> tuple[str, str]:
    """(name, version) a `models:/NAME/VERSION` or `models:/NAME@ALIAS` URI names in the
    registry at `tracking_uri`; ModelURIError saying what is missing and what there is."""
    ref = uri[len("models:/"):].strip("/")
    name, sep, alias = ref.partition("@")
    if not sep:
        name, _, version = ref.rpartition("/")
        if not name or not version.isdigit():
            raise ModelURIError(f"{uri}: write it as models:/NAME/VERSION (a number) or models:/NAME@ALIAS")
    try:
        client.get_registered_model(name)
    except MlflowException:
        known = sorted(m.name for m in client.search_registered_models(max_results=50))
        raise ModelURIError(f"no registered model {name!r} in {tracking_uri} (it has "
                            f"{', '.join(known) if known else 'none'}); pass the store the search "
                            "wrote with --mlflow-uri") from None
    try:
        found = (client.get_model_version_by_alias(name, alias) if sep else
                 client.get_model_version(name, version))
    except MlflowException:
        versions = sorted(int(v.version) for v in client.search_model_versions(f"name = '{name}'"))
        raise ModelURIError(f"model {name!r} has no {'alias ' + repr(alias) if sep else 'version ' + version}"
                            f" in {tracking_uri} (its versions: {', '.join(map(str, versions)) or 'none'})"
                            ) from None
    return name, found.version


def download_checkpoint(uri: str, tracking_uri: str, folder: str | Path) -> Path:
    """The checkpoint file inside the registered model `uri` (models:/NAME/VERSION or
    models:/NAME@ALIAS), downloaded into `folder`. ModelURIError when the registry has no such
    model or version, or it is not a model vidtune logged."""
    client = MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)
    name, version = _version_of(client, uri, tracking_uri)
    with tracking_at(tracking_uri):    # a models:/ URI is resolved in the registry, by default the store
        local = Path(mlflow.artifacts.download_artifacts(artifact_uri=f"models:/{name}/{version}",
                                                         dst_path=str(folder)))
    found = sorted(local.rglob(FILE_NAME))
    if not found:
        raise ModelURIError(f"the registered model {uri} holds no {FILE_NAME}: it was not logged by a "
                            "vidtune search")
    add_model_code(local)
    return checkpoint_file(found[0])


def add_model_code(folder: Path) -> None:
    """The code an own model's MLflow model carries (`code_paths`), first on this process's
    sys.path, as `mlflow.pyfunc.load_model` does: the checkpoint's `module:function` imports from it."""
    for mlmodel in folder.rglob("MLmodel"):
        code = Model.load(str(mlmodel)).flavors.get("python_function", {}).get("code")
        if code and (mlmodel.parent / code).is_dir() and str(mlmodel.parent / code) not in sys.path:
            sys.path.insert(0, str(mlmodel.parent / code))
