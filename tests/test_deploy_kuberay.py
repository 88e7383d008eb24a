"""deploy/kuberay/: what a Kubernetes API server with KubeRay would accept, and what vidtune needs.

Offline: the RayJob and RayCluster are checked against KubeRay's own CRD schemas
(tests/data/kuberay/, the `openAPIV3Schema` its API server checks), made strict as the server is
(an unknown field is an error, not silently pruned); the core objects (Secrets, volumes, the
MLflow Deployment and Service, the ConfigMap) against Kubernetes' own schemas with
`kubernetes-validate`. Then what ties them to vidtune: one image built by deploy/Dockerfile at the
package's version, the pinned Ray, a search entrypoint vidtune's own option parser accepts, GPU
and CPU requests that fit the worker pods, token authentication on every Ray container, and
every Secret, volume and ConfigMap named where it is used. No cluster, no network.
"""
from __future__ import annotations

import copy
import shlex
import tomllib
from pathlib import Path
from urllib.parse import urlparse

import jsonschema
import kubernetes_validate
import pytest
import yaml
from mlflow.cli import server
from mlflow.server.security_utils import is_allowed_host_header

from vidtune.trainer.cluster.capacity import NodeType, read_node_types
from vidtune.tune.config.options import parse_options
from vidtune.tune.running.cluster import ClusterCapacity, fit_to_cluster

REPO = Path(__file__).resolve().parents[1]
KUBERAY = REPO / "deploy" / "kuberay"
CRDS = Path(__file__).parent / "data" / "kuberay"
CRD_FILES = {"RayJob": "ray.io_rayjobs.yaml", "RayCluster": "ray.io_rayclusters.yaml"}
KUBERNETES_VERSION = "1.33.0"     # a release the cloud providers still run; kept schemas in the package
IMAGE_NAME = "vidtune"
TOKEN_SECRET, TOKEN_KEY = "vidtune-ray-token", "auth_token"


def _docs() -> list[tuple[str, dict]]:
    found = []
    for path in sorted(KUBERAY.glob("*.yaml")):
        found += [(path.name, d) for d in yaml.safe_load_all(path.read_text()) if d]
    return found


DOCS = _docs()


def _one(kind: str, name: str | None = None) -> dict:
    (doc,) = [d for _, d in DOCS if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    return doc


def _pin(name: str) -> str:
    for line in (REPO / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line.lower().startswith(f"{name}=="):
            return line.split("==", 1)[1].strip()
    raise AssertionError(f"constraints.txt pins no {name}")


def _strict(schema: dict) -> dict:
    """The CRD's schema as the API server applies it to a manifest: a field it does not declare is
    an error (kubectl's strict field validation), unless the schema keeps unknown fields."""
    schema = copy.deepcopy(schema)

    def walk(node):
        if isinstance(node, dict):
            if ("properties" in node and "additionalProperties" not in node
                    and not node.get("x-kubernetes-preserve-unknown-fields")):
                node["additionalProperties"] = False
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(schema)
    return schema


_VALIDATORS: dict[tuple[str, str], jsonschema.Validator] = {}


def _crd_validator(kind: str, api_version: str) -> jsonschema.Validator:
    group, version = api_version.split("/")
    if (kind, version) not in _VALIDATORS:
        # libyaml's loader (PyYAML's C binding): the same document as safe_load, 5x faster on these 1 MB files
        crd = yaml.load((CRDS / CRD_FILES[kind]).read_text(), Loader=yaml.CSafeLoader)
        assert crd["spec"]["group"] == group
        (served,) = [v for v in crd["spec"]["versions"] if v["name"] == version and v["served"]]
        # OpenAPI 3.0 schemas are JSON Schema draft 4 with extensions (x-kubernetes-*), which it ignores
        _VALIDATORS[kind, version] = jsonschema.Draft4Validator(_strict(served["schema"]["openAPIV3Schema"]))
    return _VALIDATORS[kind, version]


def _pod_specs() -> list[tuple[str, dict]]:
    """(where, pod spec) of every pod the manifests make."""
    specs = []
    for name, d in DOCS:
        if d["kind"] == "Deployment":
            specs.append((f"{name}: {d['metadata']['name']}", d["spec"]["template"]["spec"]))
        cluster = d["spec"].get("rayClusterSpec") if d["kind"] == "RayJob" else (
            d["spec"] if d["kind"] == "RayCluster" else None)
        if cluster is None:
            continue
        specs.append((f"{name}: head", cluster["headGroupSpec"]["template"]["spec"]))
        specs += [(f"{name}: {g['groupName']}", g["template"]["spec"]) for g in cluster["workerGroupSpecs"]]
        if d["kind"] == "RayJob" and d["spec"].get("submitterPodTemplate"):
            specs.append((f"{name}: submitter", d["spec"]["submitterPodTemplate"]["spec"]))
    return specs


def _ray_containers() -> list[tuple[str, dict]]:
    return [(where, c) for where, spec in _pod_specs() if "mlflow" not in where for c in spec["containers"]]


def _gpu_groups() -> list[dict]:
    job = _one("RayJob")["spec"]["rayClusterSpec"]
    return job["workerGroupSpecs"] + _one("RayCluster")["spec"]["workerGroupSpecs"]


def _entrypoint_options(tmp_path: Path):
    tokens = shlex.split(_one("RayJob")["spec"]["entrypoint"])
    assert tokens[:2] == ["vidtune", "search"], tokens[:2]
    # vidtune's own parser and checks; --data names a folder of the cluster, so a stand-in here
    data = tokens.index("--data") + 1
    cluster_data, tokens[data] = tokens[data], str(tmp_path)
    return parse_options(tokens[2:]), cluster_data


def test_the_folder_holds_a_rayjob_a_raycluster_and_what_they_use():
    kinds = sorted(d["kind"] for _, d in DOCS)
    assert kinds == sorted(["RayJob", "RayCluster", "Secret", "Secret", "PersistentVolumeClaim",
                            "PersistentVolumeClaim", "Deployment", "Service", "ConfigMap"]), kinds


@pytest.mark.parametrize("kind", ["RayJob", "RayCluster"])
def test_custom_resources_pass_kuberays_crd_schema(kind):
    doc = _one(kind)
    errors = sorted(_crd_validator(kind, doc["apiVersion"]).iter_errors(doc), key=str)
    assert not errors, "\n".join(f"{list(e.absolute_path)}: {e.message}" for e in errors[:10])


@pytest.mark.parametrize("path, value", [
    (("spec", "shutdownAfterJobFinish"), True),                              # a misspelt field
    (("spec", "rayClusterSpec", "workerGroupSpecs", 0, "maxReplicas"), "four"),
    (("spec", "rayClusterSpec", "headGroupSpec", "template", "spec", "containers", 0, "env", 0,
      "valueFrom"), {"secretRef": {"name": "x"}}),
])
def test_the_crd_check_really_rejects_a_broken_rayjob(path, value):
    doc = copy.deepcopy(_one("RayJob"))
    node = doc
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    assert list(_crd_validator("RayJob", doc["apiVersion"]).iter_errors(doc))


def test_core_objects_pass_kubernetes_schemas():
    checked = 0
    for name, doc in DOCS:
        if doc["apiVersion"].startswith("ray.io/"):
            continue
        try:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{name}: {doc['kind']} {doc['metadata']['name']}: {e.message} at {list(e.path)}")
        checked += 1
    assert checked == 7


def test_kubernetes_check_really_rejects_a_broken_deployment():
    doc = copy.deepcopy(_one("Deployment"))
    doc["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "five thousand"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_every_container_runs_the_image_deploy_dockerfile_builds_at_the_package_version():
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    images = {c["image"] for _, spec in _pod_specs() for c in spec["containers"]}
    assert len(images) == 1, images
    (image,) = images
    repository, tag = image.rsplit(":", 1)
    assert repository.rsplit("/", 1)[-1] == IMAGE_NAME and tag == version, image
    assert f"{IMAGE_NAME}:$(VERSION)" in (REPO / "Makefile").read_text()   # `make image` tags it so


def test_ray_version_is_the_pinned_one():
    for cluster in (_one("RayJob")["spec"]["rayClusterSpec"], _one("RayCluster")["spec"]):
        assert cluster["rayVersion"] == _pin("ray")


def test_raycluster_is_the_rayjobs_cluster():
    assert _one("RayCluster")["spec"] == _one("RayJob")["spec"]["rayClusterSpec"]


def test_rayjob_ends_its_cluster_and_is_not_retried_blind():
    spec = _one("RayJob")["spec"]
    assert spec["shutdownAfterJobFinishes"] is True and spec["backoffLimit"] == 0


def test_cpu_head_and_an_autoscaling_gpu_group():
    for cluster in (_one("RayJob")["spec"]["rayClusterSpec"], _one("RayCluster")["spec"]):
        assert cluster["enableInTreeAutoscaling"] is True
        head = cluster["headGroupSpec"]["template"]["spec"]["containers"][0]["resources"]
        assert "nvidia.com/gpu" not in head["limits"] and "nvidia.com/gpu" not in head["requests"]
        (group,) = cluster["workerGroupSpecs"]
        assert group["minReplicas"] == 0 < group["maxReplicas"]
        limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
        assert int(limits["nvidia.com/gpu"]) >= 1


def test_the_entrypoint_is_a_search_vidtunes_parser_accepts_and_fits_the_gpu_pods(tmp_path):
    opts, cluster_data = _entrypoint_options(tmp_path)
    res = opts.resources
    assert res.address == "auto"
    assert urlparse(opts.storage).scheme in ("s3", "gs"), "--storage must be shared by every pod"
    (group,) = _one("RayJob")["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
    gpus, cpus = float(limits["nvidia.com/gpu"]), float(limits["cpu"])
    assert res.gpus_per_worker is not None and 0 < res.gpus_per_worker <= gpus
    # --cpus-per-worker as the search fills it in for these pods (the head alone, the group to start)
    gpu_type = NodeType("gpu", cpus, gpus, group["maxReplicas"])
    capacity = ClusterCapacity(((4.0, 0.0),), (4.0, 0.0), (gpu_type,))
    res = fit_to_cluster(opts, capacity).opts.resources
    assert res.cpus_per_worker is not None
    # two trials a pod, one training and one starting behind it; 0.1: each trial's own driver
    assert 2 * (res.cpus_per_worker * res.workers_per_trial + 0.1) <= cpus
    # the data is at the same path on every Ray pod: the shared volume's mount
    for where, c in _ray_containers():
        if "submitter" not in where:
            mounts = [m["mountPath"] for m in c["volumeMounts"]]
            assert any(cluster_data.startswith(m.rstrip("/") + "/") for m in mounts), (where, mounts)


def test_the_search_reads_the_gpu_group_as_the_autoscaler_will_start_it(tmp_path):
    """--cluster-config names the ConfigMap's file in the head; read by vidtune's own reader, it
    says what the `gpu` worker group is: its CPUs and GPUs, and at most maxReplicas pods."""
    opts, _ = _entrypoint_options(tmp_path)
    config_map = _one("ConfigMap", "vidtune-node-types")
    head = _one("RayJob")["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]
    (mount,) = [m for m in head["containers"][0]["volumeMounts"]
                if any(v["name"] == m["name"] and v.get("configMap", {}).get("name") == "vidtune-node-types"
                       for v in head["volumes"])]
    config = Path(opts.resources.cluster_config)
    assert config.parent == Path(mount["mountPath"]) and config.name in config_map["data"]
    copy_here = tmp_path / config.name
    copy_here.write_text(config_map["data"][config.name])
    for group in _gpu_groups():
        limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
        expected = NodeType(group["groupName"], float(limits["cpu"]), float(limits["nvidia.com/gpu"]),
                            group["maxReplicas"])
        assert read_node_types(copy_here) == (expected,)


def test_every_ray_container_uses_token_authentication_from_the_secret():
    containers = _ray_containers()
    assert {w.split(": ")[1] for w, _ in containers} == {"head", "gpu", "submitter"}
    for where, c in containers:
        env = {e["name"]: e for e in c.get("env", [])}
        assert env["RAY_AUTH_MODE"]["value"] == "token", where
        token = env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]
        assert token == {"name": TOKEN_SECRET, "key": TOKEN_KEY}, where


def test_every_secret_volume_and_config_map_used_is_defined():
    secrets = {d["metadata"]["name"]: set(d["stringData"]) for _, d in DOCS if d["kind"] == "Secret"}
    claims = {d["metadata"]["name"] for _, d in DOCS if d["kind"] == "PersistentVolumeClaim"}
    maps = {d["metadata"]["name"]: set(d["data"]) for _, d in DOCS if d["kind"] == "ConfigMap"}
    for where, spec in _pod_specs():
        for c in spec["containers"]:
            for e in c.get("env", []):
                ref = e.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert ref["key"] in secrets.get(ref["name"], ()), (where, ref)
            for source in c.get("envFrom", []):
                assert source["secretRef"]["name"] in secrets, (where, source)
            volumes = {v["name"] for v in spec.get("volumes", [])}
            assert {m["name"] for m in c.get("volumeMounts", [])} <= volumes, where
        for v in spec.get("volumes", []):
            if "persistentVolumeClaim" in v:
                assert v["persistentVolumeClaim"]["claimName"] in claims, (where, v)
            if "configMap" in v:
                assert v["configMap"]["name"] in maps, (where, v)
    data = _one("PersistentVolumeClaim", "vidtune-data")
    assert data["spec"]["accessModes"] == ["ReadWriteMany"]      # every Ray pod mounts it at once


def test_pods_run_as_the_images_non_root_user():
    for where, spec in _pod_specs():
        if "submitter" in where:
            continue
        assert spec["securityContext"]["runAsUser"] == 1000, where


def test_mlflow_server_parses_and_answers_the_host_the_search_uses(tmp_path):
    (container,) = _one("Deployment", "vidtune-mlflow")["spec"]["template"]["spec"]["containers"]
    command = container["command"]
    assert command[:2] == ["mlflow", "server"]
    params = server.make_context("server", list(command[2:])).params
    opts, _ = _entrypoint_options(tmp_path)
    uri = urlparse(opts.tracking.mlflow_uri)
    service = _one("Service", "vidtune-mlflow")
    (port,) = service["spec"]["ports"]
    assert uri.scheme == "http" and uri.hostname == service["metadata"]["name"] and uri.port == port["port"]
    assert params["port"] == port["port"] and params["host"] == "0.0.0.0"
    allowed = [h.strip() for h in params["allowed_hosts"].split(",")]
    assert is_allowed_host_header(allowed, uri.netloc)
    assert is_allowed_host_header(allowed, "localhost:5000")       # kubectl port-forward
    assert not is_allowed_host_header(allowed, "attacker.example:5000")
    assert params["backend_store_uri"].startswith("sqlite:////")
    mount = container["volumeMounts"][0]["mountPath"]
    assert params["backend_store_uri"].removeprefix("sqlite:///").startswith(mount + "/")


_UNITS = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 10**3, "M": 10**6, "G": 10**9}


def _bytes(quantity: str | int) -> int:
    """A Kubernetes memory quantity (`16Gi`, `500M`, `1073741824`) in bytes."""
    text = str(quantity)
    for suffix in sorted(_UNITS, key=len, reverse=True):
        if text.endswith(suffix):
            return int(float(text[: -len(suffix)]) * _UNITS[suffix])
    return int(text)


def _ray_groups() -> list[tuple[str, dict]]:
    """(where, group spec) of every Ray pod group: the head and worker groups, RayJob and RayCluster."""
    groups = []
    for name, d in DOCS:
        cluster = d["spec"].get("rayClusterSpec") if d["kind"] == "RayJob" else (
            d["spec"] if d["kind"] == "RayCluster" else None)
        if cluster is not None:
            groups.append((f"{name}: head", cluster["headGroupSpec"]))
            groups += [(f"{name}: {g['groupName']}", g) for g in cluster["workerGroupSpecs"]]
    return groups


@pytest.mark.parametrize("where, group", _ray_groups(), ids=[w for w, _ in _ray_groups()])
def test_every_ray_pod_has_a_memory_backed_dev_shm_counted_in_its_memory_limit(where, group):
    """Ray's object store lives in /dev/shm (else on disk in /tmp: a container's own /dev/shm is
    64 MB), and a memory-backed volume counts in the pod's memory limit: the limit must hold Ray's
    `memory` (KubeRay passes the whole limit unless rayStartParams sets it) plus /dev/shm, and
    /dev/shm the object store (plus, on a GPU pod, room for the DataLoader batches)."""
    spec = group["template"]["spec"]
    (container,) = spec["containers"]
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    (volume,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
    assert volume["emptyDir"]["medium"] == "Memory", where
    shm = _bytes(volume["emptyDir"]["sizeLimit"])
    resources = container["resources"]
    limit = _bytes(resources["limits"]["memory"])
    assert _bytes(resources["requests"]["memory"]) == limit, where   # Ray reads the limit; ask for it
    params = group["rayStartParams"]
    ray_memory, store = int(params["memory"]), int(params["object-store-memory"])
    assert ray_memory + shm <= limit, (where, "Ray's memory + /dev/shm exceed the pod's memory limit")
    assert store <= shm * 0.95, (where, "Ray would move an object store larger than /dev/shm to /tmp")
    assert ray_memory >= 16 * 2**30, where   # no less room for processes than before /dev/shm counted
    if "nvidia.com/gpu" in resources["limits"]:
        # The batches of the pod's DataLoader processes (two trials of the default loaders, batch 32
        # of mvit_v2_s's 16 x 224 x 224 uint8 clips, 2 prefetched each) beside the object store.
        batch = 32 * 16 * 224 * 224 * 3
        assert store + 2 * 4 * 2 * batch <= shm, where
