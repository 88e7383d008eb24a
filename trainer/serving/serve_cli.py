"""A model a search registered, served over HTTP by MLflow, from any shell (the venv need not be
activated).

    vidtune serve models:/NAME@best --mlflow-uri sqlite:////abs/path/mlruns.db
    curl -s http://127.0.0.1:5001/invocations -H 'Content-Type: application/json' \\
         -d '{"inputs": ["/abs/path/a.mp4", "/abs/path/b.mp4"]}'

Runs `mlflow models serve -m MODEL --env-manager local --host HOST --port PORT` from vidtune's
environment (`vidtune.servers`), with MLFLOW_TRACKING_URI set to the store whose registry holds
MODEL, once the model has loaded here (`trainer.serving.serve_model`: a model whose files are gone is one
line, exit 2). The answer is P(violent) per video by vidtune's scoring rule (`vidtune predict --help`);
a request with a path the server cannot score gets HTTP 400 naming each such path.
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from vidtune import servers


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vidtune serve", description=__doc__.split("\n\n")[0])
    p.add_argument("model", metavar="MODEL",
                   help="models:/NAME/VERSION or models:/NAME@ALIAS (printed by a search), or a saved "
                   "model's folder")
    servers.add_server_flags(p, store="the MLflow store whose registry holds MODEL", port=servers.SERVE_PORT,
                             port_help="the port to listen on")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    store, flag = servers.store_of(args.mlflow_uri)
    if bad_port := servers.checked_port(args.port):
        print(bad_port, file=sys.stderr)
        return 2
    model = args.model
    if model.startswith("models:/"):
        if missing := servers.missing_store(store):
            print(f"error: {flag}: {store}: {missing}; pass the --mlflow-uri the search wrote to, to "
                  f"find {model}", file=sys.stderr)
            return 2
    elif "://" not in model:
        folder = Path(model).expanduser().resolve()
        if not (folder / "MLmodel").is_file():
            print(f"error: MODEL: {model}: no MLflow model there (no {folder / 'MLmodel'}); pass "
                  "models:/NAME/VERSION or a saved model's folder", file=sys.stderr)
            return 2
        model = str(folder)
    # The registry names a version that is not there, and the model is loaded once, before any line
    # says it is served (`trainer.serving.serve_model`, which loads MLflow and torch: this module stays light
    # for --help and bad flags); then it is served.
    return servers.exec_python("vidtune.trainer.serving.serve_model", [model, servers.absolute_store(store),
                                                               args.host, str(args.port)])


def serve(model: str, store: str, host: str, port: int) -> int:
    """Replace this process by `mlflow models serve` of `model` on `host:port`, `store` its
    MLFLOW_TRACKING_URI (returns only if that cannot start)."""
    print(f"serving {model} at http://{host}:{port}/invocations (Ctrl-C stops it)", flush=True)
    return servers.exec_mlflow(["models", "serve", "-m", model, "--env-manager", "local",
                                "--host", host, "--port", str(port)], {servers.STORE_ENV: store})


if __name__ == "__main__":
    sys.exit(main())
