"""`vidtune serve`'s second step, once `trainer.serving.serve_cli` has checked the flags: look a
`models:/` model up in the store's registry (a name, version or alias that is not there is named,
with what there is, instead of MLflow's traceback), load the model as the server will, then serve
it (`serve_cli.serve`). A model whose files are gone (its checkpoint removed from a saved model's
folder, a registered version's artifact folder deleted) is one line naming it and what to do,
exit 2, before anything says it serves: the server would otherwise start, print its address, then
fail while loading with two tracebacks.

    python -m vidtune.trainer.serving.serve_model MODEL STORE HOST PORT     # run by `vidtune serve`
"""
from __future__ import annotations

import contextlib
import io
import logging
import sys
from collections.abc import Sequence

import mlflow
import mlflow.pyfunc
from mlflow.tracking import MlflowClient

from vidtune.trainer.serving import mlflow_model
from vidtune.trainer.serving.serve_cli import serve

REASON_CHARS = 200     # of the loader's own message, in the one line


def main(argv: Sequence[str] | None = None) -> int:
    model, store, host, port = list(sys.argv[1:] if argv is None else argv)
    try:
        version = mlflow_model.check_model_uri(model, store) if model.startswith("models:/") else None
    except mlflow_model.ModelURIError as e:
        print(f"error: MODEL: {e}", file=sys.stderr)
        return 2
    if problem := load_problem(model, store, version):
        print(f"error: MODEL: {problem}", file=sys.stderr)
        return 2
    return serve(model, store, host, int(port))


def load_problem(model: str, store: str, version: tuple[str, str] | None = None) -> str | None:
    """Load `model` (a `models:/` URI, resolved in `store`'s registry, or a saved model's folder)
    as `mlflow models serve` will; None when it loads, else one line: what cannot be loaded, where
    its files should be, and what to do. `version`: (name, version) of a registered model. What
    MLflow and torch print while loading is kept off the console (the server prints it again)."""
    try:
        with mlflow_model.tracking_at(store), _quiet():
            mlflow.set_registry_uri(store)
            mlflow.pyfunc.load_model(model)
        return None
    except Exception as e:     # any failure to load is the same answer: the server could not start
        reason = str(e).split("; ")[0].strip() or type(e).__name__
        reason = reason if len(reason) <= REASON_CHARS else reason[:REASON_CHARS - 3] + "..."
    if version is None:
        return (f"{model} cannot be loaded ({reason}): the saved model's files are gone or incomplete; "
                "copy the whole model folder again, or serve a registered model (models:/NAME/VERSION)")
    name, number = version
    return (f"{model} cannot be loaded ({reason}): the files of {name} version {number}"
            f"{registered_files(name, number, store)}")


def registered_files(name: str, version: str, store: str) -> str:
    """The rest of the line: where the version's files belong (when the registry says) and what
    to do: put them back, or serve another version (named)."""
    client = MlflowClient(tracking_uri=store, registry_uri=store)
    where, numbers = "", []
    try:
        found = client.get_model_version(name, version)
        location = found.source
        if location.startswith("models:/"):    # MLflow 3: a logged model's id; its files are elsewhere
            location = client.get_logged_model(location.removeprefix("models:/")).artifact_location
        where = f" in {location.removeprefix('file://')}" if location else ""
        numbers = sorted(int(v.version) for v in client.search_model_versions(f"name = '{name}'"))
    except Exception:   # the registry answered check_model_uri a moment ago; a detail is not worth failing
        pass
    others = [str(n) for n in numbers if str(n) != str(version)]
    then = (f"or serve another version (models:/{name}/{others[-1]}; its versions: {', '.join(others)})"
            if others else "or run the search again (it registers its best checkpoint when it ends)")
    return f"{where} are gone or incomplete; put them back, {then}"


@contextlib.contextmanager
def _quiet():
    """MLflow's and torch's log lines and warnings off the console while the model loads."""
    logger = logging.getLogger("mlflow")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        logger.setLevel(level)


if __name__ == "__main__":
    sys.exit(main())
