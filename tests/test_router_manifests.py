"""deploy/router: vllm-router in front of the InferenceService's predictor pods, validated offline
against Kubernetes' own OpenAPI schemas (kubernetes-validate's bundled copies, strict: a field the
schema does not declare is an error), its arguments parsed by vllm-router's own parser, and checked
against deploy/kserve (labels, port) and against the flags tests/test_router_replicas.py runs with."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from tests.harness.router_launch import ROUTER_ARGS

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy" / "router"
K8S_VERSIONS = ("1.30.0", kubernetes_validate.latest_version())
"""The oldest Kubernetes release still commonly run and the newest whose schemas the package has."""


def documents() -> dict[str, dict]:
    """kind -> document of deploy/router/router.yaml."""
    docs = [d for d in yaml.safe_load_all((DEPLOY / "router.yaml").read_text()) if d]
    return {d["kind"]: d for d in docs}


def invalid(doc: dict, version: str) -> str | None:
    try:
        kubernetes_validate.validate(doc, version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        return f"{'.'.join(map(str, exc.path))}: {exc.message}"
    return None


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_manifest_validates_strictly(version):
    docs = documents()
    assert set(docs) == {"ServiceAccount", "Role", "RoleBinding", "Deployment", "Service"}
    assert {kind: invalid(doc, version) for kind, doc in docs.items()} == dict.fromkeys(docs)


@pytest.mark.parametrize("break_it, needle", [
    (lambda d: d["spec"]["template"]["spec"]["containers"][0].update(readinessprobe={}), "readinessprobe"),  # typo
    (lambda d: d["spec"].update(replicas="one"), "'one' is not of type 'integer'"),
    (lambda d: d["spec"]["template"]["spec"]["containers"][0]["ports"][0].update(containerPort="http"), "'http'"),
])
def test_a_broken_manifest_fails_validation(break_it, needle):
    doc = copy.deepcopy(documents()["Deployment"])
    break_it(doc)
    found = invalid(doc, K8S_VERSIONS[-1])
    assert found and needle in found, found


def router_args():
    """The Deployment's args as vllm-router's own launcher parses them."""
    from vllm_router.launch_router import parse_router_args

    (container,) = documents()["Deployment"]["spec"]["template"]["spec"]["containers"]
    return container, parse_router_args(container["args"])


def test_the_router_finds_the_inferenceservices_predictor_pods():
    container, args = router_args()
    isvc = yaml.safe_load((ROOT / "deploy" / "kserve" / "inferenceservice.yaml").read_text())
    runtime = yaml.safe_load((ROOT / "deploy" / "kserve" / "servingruntime.yaml").read_text())
    assert args.service_discovery and args.worker_urls == []
    # the labels KServe gives the predictor pods of this InferenceService
    assert args.selector == {"serving.kserve.io/inferenceservice": isvc["metadata"]["name"], "component": "predictor"}
    (kserve_container,) = runtime["spec"]["containers"]
    http = next(p["containerPort"] for p in kserve_container["ports"] if p["name"] == "http1")
    assert args.service_discovery_port == http
    # its own namespace, from the downward API (the Role grants pods there and nowhere else)
    assert args.service_discovery_namespace == "$(POD_NAMESPACE)"
    env = {e["name"]: e for e in container["env"]}
    assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"


def test_the_router_runs_with_the_flags_the_replica_test_proves():
    container, args = router_args()
    flags = dict(zip(ROUTER_ARGS[::2], ROUTER_ARGS[1::2]))
    assert all(f"{flag}={value}" in container["args"] for flag, value in flags.items()), (flags, container["args"])
    assert args.policy == "cache_aware"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert (args.port, args.prometheus_port) == (ports["http"], ports["metrics"]) and args.host == "0.0.0.0"
    assert container["readinessProbe"]["httpGet"] == {"path": "/readiness", "port": "http"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/liveness", "port": "http"}


def test_service_rbac_and_image_fit_together():
    docs = documents()
    deployment, service = docs["Deployment"], docs["Service"]
    pod = deployment["spec"]["template"]
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    (container,) = pod["spec"]["containers"]
    assert service["spec"]["ports"][0]["targetPort"] in {p["name"] for p in container["ports"]}
    account = pod["spec"]["serviceAccountName"]
    assert docs["ServiceAccount"]["metadata"]["name"] == account
    binding = docs["RoleBinding"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account}]
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": docs["Role"]["metadata"]["name"]}
    assert docs["Role"]["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
    # the image installs the vllm-router release the tests run, and is tagged with it
    pin = re.search(r"vllm-router==([\d.]+)", (ROOT / "pyproject.toml").read_text()).group(1)
    assert f"pip install --no-cache-dir vllm-router=={pin}" in (DEPLOY / "Dockerfile").read_text()
    assert container["image"].endswith(f":{pin}")
