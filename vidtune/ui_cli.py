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
    servers.add_server_flags(p, store="the search's MLflow store", port=servers.UI_PORT,
                             port_help="the port to listen on (the search's printed links use 5000)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    store, flag = servers.store_of(args.mlflow_uri)
    if missing := servers.missing_store(store):
        print(f"error: {flag}: {store}: {missing}; pass the --mlflow-uri the search wrote to "
              "(its summary prints this command with it)", file=sys.stderr)
        return 2
    if bad_port := servers.checked_port(args.port):
        print(bad_port, file=sys.stderr)
        return 2
    store = servers.absolute_store(store)
    print(f"MLflow UI of {store} at http://{args.host}:{args.port} (Ctrl-C stops it)", flush=True)
    return servers.exec_mlflow(["ui", "--backend-store-uri", store, "--host", args.host,
                                "--port", str(args.port)], {servers.STORE_ENV: store})


if __name__ == "__main__":
    sys.exit(main())
