"""deploy/kserve manifests, validated offline against KServe's CRD schemas (strict: a field the
schema does not declare is an error), and checked against what the server really serves."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import jsonschema
import pytest
import yaml

from pagedserve.adapters.engine_metrics import VLLM_METRICS
from pagedserve.adapters.kserve.metrics import VLLM_LABELS
from pagedserve.adapters.kserve.server import build_parser

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy" / "kserve"
CRD_DIR = ROOT / "tests" / "data" / "kserve-crds"  # KServe's CRDs, copied verbatim (see its README.md)


def strict(schema):
    """Close every object schema that lists properties, unless it preserves unknown fields."""
    if isinstance(schema, dict):
        schema = {k: strict(v) for k, v in schema.items()}
        if ("properties" in schema and "additionalProperties" not in schema
                and not schema.get("x-kubernetes-preserve-unknown-fields")):
            schema["additionalProperties"] = False
        return schema
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    return schema


@pytest.fixture(scope="module")
def validators():
    """kind -> (apiVersion, validator) for every CRD in the folder."""
    out = {}
    assert sorted(CRD_DIR.glob("*.yaml")), f"no KServe CRD schemas in {CRD_DIR}"
    for path in sorted(CRD_DIR.glob("*.yaml")):
        crd = yaml.safe_load(path.read_text())
        for version in crd["spec"]["versions"]:
            api = f"{crd['spec']['group']}/{version['name']}"
            out[(crd["spec"]["names"]["kind"], api)] = jsonschema.Draft7Validator(
                strict(version["schema"]["openAPIV3Schema"]))
    return out


def manifests() -> dict[str, dict]:
    return {p.name: yaml.safe_load(p.read_text()) for p in sorted(DEPLOY.glob("*.yaml"))}


def errors(validators, doc) -> list[str]:
    key = (doc["kind"], doc["apiVersion"])
    assert key in validators, f"no CRD for {key}"
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validators[key].iter_errors(doc)]


def test_every_manifest_validates_strictly(validators):
    docs = manifests()
    assert {d["kind"] for d in docs.values()} == {"ServingRuntime", "ClusterServingRuntime", "InferenceService"}
    for name, doc in docs.items():
        assert errors(validators, doc) == [], name


@pytest.mark.parametrize("break_it,needle", [
    (lambda d: d["spec"]["predictor"]["model"].update(readinessprobe={}), "readinessprobe"),  # typo
    (lambda d: d["spec"]["predictor"].update(minReplicas="one"), "'one' is not of type 'integer'"),
    (lambda d: d["spec"]["predictor"]["autoScaling"]["metrics"][0].update(type="Queue"), "'Queue' is not one of"),
])
def test_a_broken_manifest_fails_validation(validators, break_it, needle):
    doc = copy.deepcopy(manifests()["inferenceservice.yaml"])
    break_it(doc)
    found = errors(validators, doc)
    assert any(needle in e for e in found), found


def test_runtime_and_service_agree_with_the_server():
    docs = manifests()
    runtime, cluster, isvc = docs["servingruntime.yaml"], docs["clusterservingruntime.yaml"], docs["inferenceservice.yaml"]
    assert runtime["spec"] == cluster["spec"]
    name = isvc["metadata"]["name"]
    model = isvc["spec"]["predictor"]["model"]
    assert model["runtime"] == runtime["metadata"]["name"]
    assert model["modelFormat"]["name"] in {f["name"] for f in runtime["spec"]["supportedModelFormats"]}
    (container,) = runtime["spec"]["containers"]
    # The runtime's args (with KServe's {{.Name}} filled in) plus the service's are real CLI flags.
    args = build_parser().parse_args([a.replace("{{.Name}}", name) for a in container["args"] + model["args"]])
    assert args.model_name == name
    ports = {p["containerPort"] for p in container["ports"]}
    assert ports == {args.http_port, args.grpc_port} == {p["containerPort"] for p in model["ports"]}
    for probe in ("readinessProbe", "startupProbe"):
        assert model[probe]["httpGet"] == {"path": f"/v2/models/{name}/ready", "port": args.http_port}
    # Autoscaling reads the engine's own gauges, by vLLM's names and label, as /metrics exports them
    # (tests/test_vllm_compat.py scrapes them from a real server).
    query = isvc["spec"]["predictor"]["autoScaling"]["metrics"][0]["external"]["metric"]["query"]
    selectors = re.findall(r"([a-z_]+:[a-z_]+)\{([^}]*)\}", query)
    assert {name for name, _labels in selectors} == {"vllm:num_requests_waiting", "vllm:num_requests_running"}
    assert {name for name, _labels in selectors} <= {m.name for m in VLLM_METRICS}
    assert all(labels == f'{VLLM_LABELS[0]}="{name}"' for _name, labels in selectors), selectors


def test_dockerfile_builds_cpu_and_cuda_variants():
    text = (DEPLOY / "Dockerfile").read_text()
    assert "ARG DEVICE=cpu" in text and "FROM base-${DEVICE}" in text
    assert "AS base-cpu" in text and "AS base-cuda" in text
    assert 'ENTRYPOINT ["pagedserve", "kserve"]' in text
    # The image builds from what it copies: every source exists, and the whole package tree (with
    # its model_repository data) is among them, as pyproject.toml's package-dir names it.
    copied = [src for line in re.findall(r"^COPY (.+)$", text, re.M) for src in line.split()[:-1]]
    assert copied and all((ROOT / src).exists() for src in copied), copied
    assert {"pyproject.toml", "README.md", "src"} <= set(copied)
    assert 'package-dir = { "" = "src" }' in (ROOT / "pyproject.toml").read_text()
