"""MLflow's UI on a search's store, from any shell (the venv need not be activated).

    vidtune ui --mlflow-uri sqlite:////abs/path/mlruns.db     # then open http://127.0.0.1:5000

Runs `mlflow ui --backend-store-uri STORE --host HOST --port PORT` from vidtune's environment
(`vidtune.servers`). A `sqlite:///` store that does not exist is refused (MLflow would open an
empty new one, which shows none of the search's runs).
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from vidtune import servers


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vidtune ui", description=__doc__.split("\n\n")[0])
    g = p.add_argument_group("server")
    g.add_argument("--mlflow-uri", metavar="URI", default=None,
                   help="the search's MLflow store (default $MLFLOW_TRACKING_URI, else sqlite:///mlruns.db "
                   "in this folder, a search's default)")
    g.add_argument("--host", metavar="HOST", default=servers.HOST,
                   help="the interface to listen on (0.0.0.0: every one; MLflow's UI has no login)")
    g.add_argument("--port", metavar="PORT", type=int, default=servers.UI_PORT,
                   help="the port to listen on (the search's printed links use 5000)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    store, flag = servers.store_of(args.mlflow_uri)
    if missing := servers.missing_store(store):
        print(f"error: {flag}: {store}: {missing}; pass the --mlflow-uri the search wrote to "
              "(its summary prints this command with it)", file=sys.stderr)
        return 2
    if not 0 < args.port < 65536:
        print(f"error: --port: got {args.port}; a port is 1..65535", file=sys.stderr)
        return 2
    store = servers.absolute_store(store)
    print(f"MLflow UI of {store} at http://{args.host}:{args.port} (Ctrl-C stops it)", flush=True)
    return servers.exec_mlflow(["ui", "--backend-store-uri", store, "--host", args.host,
                                "--port", str(args.port)], {servers.STORE_ENV: store})


if __name__ == "__main__":
    sys.exit(main())
