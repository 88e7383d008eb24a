"""cluster.yaml: valid for Ray's cluster launcher, pinned installs, MLflow server on the README's port.

All offline: Ray's own schema and config preparation (the steps `ray up` runs before it calls
AWS), and the pinned `ray start` / `mlflow server` command-line parsers. No AWS, no network.
"""
from __future__ import annotations

import copy
import os
import re
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import torch
import yaml
from mlflow.cli import server

# Private: Ray has no public offline prepare/validate of a cluster config (its sdk's
# bootstrap_config calls AWS); these are the steps `ray up` runs before it does.
from ray.autoscaler._private.util import prepare_config, validate_config
from ray.scripts.scripts import start

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
    validate_config(prepared)
    assert prepared["provider"]["type"] == "aws"


def test_schema_check_really_rejects_a_broken_config(raw_config):
    """Guards the test above: the same route fails on a misspelt node-type field."""
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
    spot = [t for t in gpu.values()
            if t["node_config"].get("InstanceMarketOptions", {}).get("MarketType") == "spot"]
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
        assert pins.get(name.lower()) == version, \
            f"cluster.yaml pins {name}=={version}, constraints.txt {pins.get(name.lower())}"


def test_head_starts_ray_then_mlflow_server_on_the_readme_port(prepared):
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



# -- the GPU nodes' own check of their driver and torch's CUDA -----------------------------------

VENV_PYTHON = "/home/ubuntu/venv/bin/python"
TORCH_CUDA_CHECK = 'python -c "import torch; assert torch.cuda.is_available()"'


def _gpu_checks(commands: list[str]) -> list[str]:
    return [c for c in commands if "nvidia-smi" in c or "torch.cuda.is_available" in c]


def test_gpu_nodes_check_the_driver_and_torch_cuda_and_the_head_does_not(prepared):
    worker_checks = _gpu_checks(prepared["worker_setup_commands"])
    assert any(c.startswith("nvidia-smi ") for c in worker_checks), worker_checks
    assert any(TORCH_CUDA_CHECK in c for c in worker_checks), worker_checks
    # After the install (the venv's torch must exist), before Ray starts on the node.
    install_at = next(i for i, c in enumerate(prepared["worker_setup_commands"])
                      if "pip install" in c and "-e ." in c)
    assert all(prepared["worker_setup_commands"].index(c) > install_at for c in worker_checks)
    # The head has no GPU: the same check there would fail every `ray up`.
    assert not _gpu_checks(prepared["head_setup_commands"] + prepared["head_start_ray_commands"])
    # No node type overrides the global list (that would drop the check for that type).
    assert not any("worker_setup_commands" in t for t in prepared["available_node_types"].values())


def _run_gpu_checks(raw_config: dict, tmp_path: Path, nvidia_smi: str,
                    python: str) -> list[subprocess.CompletedProcess]:
    """Run the worker's check commands here, as bash on the node would, with stub `nvidia-smi`
    (a shell body) and `python` standing in for the venv's."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    stub = bin_dir / "nvidia-smi"
    stub.write_text(f"#!/bin/sh\n{nvidia_smi}\n")
    stub.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    return [subprocess.run(["bash", "-c", cmd.replace(VENV_PYTHON, python)], capture_output=True, text=True,
                           env=env, timeout=120)
            for cmd in _gpu_checks(raw_config["worker_setup_commands"])]


FAKE_SMI = ('case "$1" in --query-gpu=*) echo 580.95.05;; *) echo "| NVIDIA-SMI 580.95.05  '
            'Driver Version: 580.95.05  CUDA Version: 13.0 |";; esac')


def test_gpu_check_fails_loudly_without_a_driver(raw_config, tmp_path):
    no_driver = "echo 'NVIDIA-SMI has failed: no driver' >&2; exit 9"
    smi, _ = _run_gpu_checks(raw_config, tmp_path, no_driver, "true")
    assert smi.returncode != 0
    assert f"GPU node {socket.gethostname()} FAILED" in smi.stderr and "nvidia-smi does not run" in smi.stderr
    assert "NVIDIA-SMI has failed: no driver" in smi.stderr     # what nvidia-smi said, passed on


def test_gpu_check_fails_loudly_when_torch_cannot_use_cuda(raw_config, tmp_path):
    """This machine's torch has no GPU: exactly the node whose driver is too old for torch's CUDA."""
    smi, torch_check = _run_gpu_checks(raw_config, tmp_path, FAKE_SMI, sys.executable)
    assert smi.returncode == 0, smi.stderr
    assert torch_check.returncode != 0
    message = " ".join(torch_check.stderr.split())
    assert f"GPU node {socket.gethostname()} FAILED: torch.cuda.is_available() is False" in message
    assert f"torch {torch.__version__} reports CUDA {torch.version.cuda or 'none'}" in message
    assert "the NVIDIA driver here is 580.95.05 (CUDA Version: 13.0)" in message
    assert "must support the CUDA version torch reports" in message


def test_gpu_check_passes_on_a_working_gpu_node(raw_config, tmp_path):
    checks = _run_gpu_checks(raw_config, tmp_path, FAKE_SMI, "true")   # `true`: torch sees its GPU
    assert [c.returncode for c in checks] == [0, 0], [c.stderr for c in checks]
    assert not any(c.stderr for c in checks)


# Memory (GiB) of the AWS instance types a head may be; a head of another type must be added here.
HEAD_MEMORY_GIB = {"m5.xlarge": 16, "m5.2xlarge": 32, "m5.4xlarge": 64, "r5.xlarge": 32, "r5.2xlarge": 64}
# Ray's `memory` on a fresh node: ~95% of it free at start, 30% of that its object store
RAY_TASK_MEMORY_SHARE = 0.95 * 0.7


def test_the_head_holds_every_trial_the_gpu_nodes_run_at_once(raw_config):
    """The search caps the trials at once by what the head's memory holds (each keeps its Tune
    driver and Train controller there: `tune.running.cluster.trials_the_head_holds`); cluster.yaml's head
    holds as many as its GPU nodes run, so the cap never bites on the README's cluster."""
    from vidtune.tune.config.options import parse_options
    from vidtune.tune.running.cluster import ClusterCapacity, NodeType, fit_to_cluster, trials_the_head_holds

    head_config = raw_config["available_node_types"][raw_config["head_node_type"]]["node_config"]
    head_memory = HEAD_MEMORY_GIB[head_config["InstanceType"]] * RAY_TASK_MEMORY_SHARE
    # at most max_workers GPU nodes, each a g5.2xlarge (8 vCPU, 1 A10G), as `ray up` fills them in
    gpu_nodes = (NodeType("gpu", 8.0, 1.0, raw_config["max_workers"]),)
    head = (8.0, 0.0)
    opts = parse_options(["--smoke-test", "--num-samples", "40", "--gpus-per-trial", "1"])
    unlimited = fit_to_cluster(opts, ClusterCapacity((head,), head, gpu_nodes))
    fit = fit_to_cluster(opts, ClusterCapacity((head,), head, gpu_nodes, head_memory_gb=head_memory))
    assert unlimited.concurrency == 2 * raw_config["max_workers"] == 12     # a lead and a follower a GPU
    assert fit.concurrency == unlimited.concurrency and fit.note is None
    assert trials_the_head_holds(HEAD_MEMORY_GIB["m5.xlarge"] * RAY_TASK_MEMORY_SHARE) < 12   # the old head
