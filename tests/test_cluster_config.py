"""cluster.yaml: valid for Ray's cluster launcher, pinned installs, MLflow server on the README's port.

All offline: Ray's own schema and config preparation (the steps `ray up` runs before it calls
AWS), and the pinned `ray start` / `mlflow server` command-line parsers. No AWS, no network.
"""
from __future__ import annotations

import copy
import re
import shlex
from pathlib import Path

import pytest
import yaml

REPO_ROOT = Path(__file__).resolve().parents[1]
CLUSTER_YAML = REPO_ROOT / "cluster.yaml"
README = REPO_ROOT / "README.md"
CONSTRAINTS = REPO_ROOT / "constraints.txt"
# The libraries whose versions decide whether a trial on the cluster behaves like one in CI.
PINNED_LIBS = ("torch", "torchvision", "ray", "decord", "optuna", "mlflow", "av")


@pytest.fixture(scope="module")
def raw_config() -> dict:
    return yaml.safe_load(CLUSTER_YAML.read_text())


@pytest.fixture(scope="module")
def prepared(raw_config) -> dict:
    """The config as `ray up` sees it after merging the AWS defaults (no cloud calls)."""
    # Private: Ray has no public offline prepare/validate (its sdk's bootstrap_config calls AWS).
    from ray.autoscaler._private.util import prepare_config

    return prepare_config(copy.deepcopy(raw_config))


def _constraints() -> dict[str, str]:
    pins = {}
    for line in CONSTRAINTS.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if "==" in line:
            name, version = line.split("==", 1)
            pins[name.strip().lower()] = version.strip()
    return pins


def _readme_section(name: str) -> str:
    text = README.read_text()
    match = re.search(rf"<!-- section:{name} -->(.*?)<!-- /section:{name} -->", text, re.S)
    assert match, f"README.md has no section:{name} markers"
    return match.group(1)


def _mlflow_server_args(commands: list[str]) -> list[str]:
    launches = [c for c in commands if "mlflow server" in c]
    assert len(launches) == 1, f"expected one `mlflow server` launch, found {launches}"
    tokens = shlex.split(launches[0])
    start = tokens.index("server") + 1
    # The arguments end where the shell redirections / background operator begin.
    end = next(i for i, t in enumerate(tokens) if i >= start and t.startswith((">", "<", "&", "2>")))
    return tokens[start:end]


def test_cluster_yaml_passes_rays_own_schema(prepared):
    # Private: the schema check `ray up` runs; Ray has no public offline equivalent.
    from ray.autoscaler._private.util import validate_config

    validate_config(prepared)
    assert prepared["provider"]["type"] == "aws"


def test_schema_check_really_rejects_a_broken_config(raw_config):
    """Guards the test above: the same route fails on a misspelt node-type field."""
    import jsonschema
    from ray.autoscaler._private.util import prepare_config, validate_config  # private: as above

    broken = copy.deepcopy(raw_config)
    broken["available_node_types"]["gpu_spot"]["min_worker"] = 1
    with pytest.raises(jsonschema.ValidationError, match="min_worker"):
        validate_config(prepare_config(broken))


def test_cpu_head_and_gpu_workers_with_a_spot_option(prepared):
    types = prepared["available_node_types"]
    head = types[prepared["head_node_type"]]
    assert head["max_workers"] == 0
    # AWS GPU instance families are g* and p*; the head must not be one (trials belong on workers).
    assert not re.match(r"^[gp]\d", head["node_config"]["InstanceType"])

    workers = {name: t for name, t in types.items() if name != prepared["head_node_type"]}
    gpu = {n: t for n, t in workers.items() if re.match(r"^[gp]\d", t["node_config"]["InstanceType"])}
    assert gpu, "no GPU worker node type"
    assert all(t["max_workers"] >= t["min_workers"] >= 0 for t in gpu.values())
    assert sum(t["max_workers"] for t in gpu.values()) <= prepared["max_workers"]
    spot = [t for t in gpu.values() if t["node_config"].get("InstanceMarketOptions", {}).get("MarketType") == "spot"]
    on_demand = [t for t in gpu.values() if "InstanceMarketOptions" not in t["node_config"]]
    assert spot and on_demand
    # Workers write checkpoints to s3:// storage and sync the dataset: they need an instance profile.
    assert all("IamInstanceProfile" in t["node_config"] for t in gpu.values())


def test_setup_installs_the_repository_at_the_pinned_versions(prepared):
    # file_mounts copy the repository root (which holds constraints.txt) to one remote path...
    mounts = {remote: local for remote, local in prepared["file_mounts"].items()}
    remote_repo = next((r for r, local in mounts.items() if Path(local) == Path(".")), None)
    assert remote_repo, f"cluster.yaml must mount the repository root ('.'), got {mounts}"
    assert (REPO_ROOT / "constraints.txt").is_file()

    # ...and every node (head and workers, after Ray merges the lists) installs from it with them.
    for key in ("head_setup_commands", "worker_setup_commands"):
        installs = [c for c in prepared[key] if re.search(r"pip install .*-e \.", c)]
        assert len(installs) == 1, f"{key}: expected one editable install, got {installs}"
        assert f"cd {remote_repo}" in installs[0] and "-c constraints.txt" in installs[0]

    # Any version written into the file itself must agree with constraints.txt.
    pins = _constraints()
    assert set(PINNED_LIBS) <= set(pins), f"constraints.txt lacks pins for {set(PINNED_LIBS) - set(pins)}"
    text = "\n".join(prepared["head_setup_commands"] + prepared["worker_setup_commands"])
    for name, version in re.findall(r"([A-Za-z0-9_.\-]+)==([0-9][^\s'\"]*)", text):
        assert pins.get(name.lower()) == version, f"cluster.yaml pins {name}=={version}, constraints.txt {pins.get(name.lower())}"


def test_head_starts_ray_then_mlflow_server_on_the_readme_port(prepared):
    from mlflow.cli import server
    from ray.scripts.scripts import start

    commands = prepared["head_start_ray_commands"]
    ray_at = next(i for i, c in enumerate(commands) if "ray start" in c)
    mlflow_at = next(i for i, c in enumerate(commands) if "mlflow server" in c)
    assert ray_at < mlflow_at

    # Both command lines parse with the pinned CLIs (a renamed flag would fail here, not on AWS).
    ray_args = shlex.split(commands[ray_at].split("ray start", 1)[1])
    ray_params = start.make_context("start", ray_args).params
    assert ray_params["head"] and ray_params["autoscaling_config"] == "~/ray_bootstrap_config.yaml"
    # Loopback only: reached through SSH forwarding, not an open port (the driver runs on the head).
    assert ray_params["dashboard_host"] == "127.0.0.1"

    mlflow_cmd = commands[mlflow_at]
    params = server.make_context("server", _mlflow_server_args(commands)).params
    assert params["host"] == "127.0.0.1"
    assert params["backend_store_uri"].startswith("sqlite:////")
    assert params["artifacts_destination"] or params["default_artifact_root"]
    # In the background with its output in a file: a foreground server would hang `ray up`.
    assert re.match(r"^\s*(\w+=\S+\s+)*nohup mlflow server", mlflow_cmd) and re.search(r"[^&]&\s", mlflow_cmd)

    port = params["port"]
    modes = _readme_section("modes")
    assert f"ray attach cluster.yaml -p {port}" in modes
    assert f":{port}" in _readme_section("mlflow")

