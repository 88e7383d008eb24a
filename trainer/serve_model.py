"""`vidtune serve models:/...`'s second step, once `trainer.serve_cli` has checked the flags:
look the model up in the store's registry (a name, version or alias that is not there is named,
with what there is, instead of MLflow's traceback), then serve it (`serve_cli.serve`).

    python -m vidtune.trainer.serve_model MODEL STORE HOST PORT     # run by `vidtune serve`
"""
from __future__ import annotations

import sys
from collections.abc import Sequence

from vidtune.trainer import mlflow_model
from vidtune.trainer.serve_cli import serve


def main(argv: Sequence[str] | None = None) -> int:
    model, store, host, port = list(sys.argv[1:] if argv is None else argv)
    try:
        mlflow_model.check_model_uri(model, store)
    except mlflow_model.ModelURIError as e:
        print(f"error: MODEL: {e}", file=sys.stderr)
        return 2
    return serve(model, store, host, int(port))


if __name__ == "__main__":
    sys.exit(main())
