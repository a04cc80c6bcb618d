"""Kubernetes manifests (issue 8): strictly valid against the KubeRay CRDs (vendored in
tests/schemas), the operator's own rules checked in code, and in step with
`rayzip k8s render` of the shipped example spec."""

from __future__ import annotations

import copy
import json
from functools import lru_cache
from pathlib import Path

import jsonschema
import pytest
import yaml
from typer.testing import CliRunner

from rayzip.cli import app
from rayzip.k8s import operator_problems, render
from rayzip.spec import load_spec

ROOT = Path(__file__).resolve().parents[2]
CRDS = ROOT / "tests" / "schemas" / "kuberay"
EXAMPLE = ROOT / "jobs" / "synthetic-gpu.yaml"


def strict(node):
    """The CRD schema with unknown keys made errors, except where it preserves them."""
    if isinstance(node, dict):
        node = {k: strict(v) for k, v in node.items()}
        if "properties" in node and not node.get("x-kubernetes-preserve-unknown-fields"):
            node.setdefault("additionalProperties", False)
        return node
    if isinstance(node, list):
        return [strict(v) for v in node]
    return node


@lru_cache(maxsize=None)
def crd_validator(kind: str):
    crd = json.loads((CRDS / f"{kind.lower()}s-v1.json").read_text())
    assert crd["kind"] == kind
    return jsonschema.Draft7Validator(strict(crd["openAPIV3Schema"]))


def shipped(name: str) -> dict:
    return yaml.safe_load((ROOT / "k8s" / name).read_text())


@pytest.mark.parametrize("name", ["rayjob.yaml", "raycluster.yaml"])
def test_shipped_kuberay_manifests_validate_strictly_against_the_crds(name):
    manifest = shipped(name)
    errors = [f"{list(e.absolute_path)}: {e.message[:300]}" for e in crd_validator(manifest["kind"]).iter_errors(manifest)]
    assert not errors, errors
    assert operator_problems(manifest) == []


def test_the_strict_check_catches_an_unknown_key():
    manifest = copy.deepcopy(shipped("rayjob.yaml"))
    manifest["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["minReplica"] = 1  # misspelt
    assert any("minReplica" in e.message for e in crd_validator("RayJob").iter_errors(manifest))


def test_rayjob_has_autoscaled_gpu_workers_token_auth_and_a_ttl():
    job = shipped("rayjob.yaml")["spec"]
    cluster = job["rayClusterSpec"]
    (group,) = cluster["workerGroupSpecs"]
    spec = load_spec(EXAMPLE)
    assert (group["minReplicas"], group["maxReplicas"]) == (spec.scaling.min_workers, spec.scaling.max_workers)
    assert group["template"]["spec"]["restartPolicy"] == "Never" and cluster["enableInTreeAutoscaling"] is True
    assert group["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert cluster["authOptions"] == {"mode": "token"}
    assert job["shutdownAfterJobFinishes"] is True and job["ttlSecondsAfterFinished"] > 0
    assert job["entrypoint"] == "rayzip run /etc/rayzip/job.yaml"
    configmap = shipped("configmap.yaml")
    assert configmap["data"]["job.yaml"] == EXAMPLE.read_text()


def test_shipped_manifests_are_what_render_makes_of_the_example_spec():
    made = render(load_spec(EXAMPLE), EXAMPLE.read_text())
    for name, manifest in made.items():
        assert shipped(name) == manifest, f"k8s/{name} is stale: rayzip k8s render {EXAMPLE.name} -o k8s"


def test_operator_rules_are_checked_in_code():
    manifest = copy.deepcopy(shipped("raycluster.yaml"))
    group = manifest["spec"]["workerGroupSpecs"][0]
    group["replicas"] = group["maxReplicas"] + 1
    group["template"]["spec"]["restartPolicy"] = "Always"
    manifest["metadata"]["name"] = "Bad_Name"
    problems = " | ".join(operator_problems(manifest))
    assert "minReplicas <= replicas <= maxReplicas" in problems and "restartPolicy: Never" in problems
    assert "DNS-1035" in problems


def test_render_cli_fills_name_workers_and_gpus_from_the_spec(tmp_path):
    spec_file = tmp_path / "job.yaml"
    spec_file.write_text("name: my-job\nscaling: {min_workers: 2, max_workers: 6}\n")
    result = CliRunner().invoke(app, ["k8s", "render", str(spec_file), "--gpus-per-worker", "2", "-o", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    job = yaml.safe_load((tmp_path / "out" / "rayjob.yaml").read_text())
    (group,) = job["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    assert job["metadata"]["name"] == "my-job" and (group["minReplicas"], group["maxReplicas"]) == (2, 6)
    assert group["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert not list(crd_validator("RayJob").iter_errors(job))
    bad = CliRunner().invoke(app, ["k8s", "render", str(tmp_path / "missing.yaml")])
    assert bad.exit_code == 2


def test_kustomization_lists_files_that_exist():
    kustomization = shipped("kustomization.yaml")
    for resource in kustomization["resources"]:
        assert (ROOT / "k8s" / resource).exists(), resource


def test_podmonitor_scrapes_every_ray_pods_metrics_port_keeping_rayzips_job_label():
    monitor = shipped("podmonitor.yaml")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1" and monitor["kind"] == "PodMonitor"
    spec = monitor["spec"]
    (match,) = spec["selector"]["matchExpressions"]
    assert match == {"key": "ray.io/node-type", "operator": "In", "values": ["head", "worker"]}
    (endpoint,) = spec["podMetricsEndpoints"]
    # The head and workers name Ray's metrics export port `metrics`; rayzip's series carry their own `job`.
    assert endpoint["port"] == "metrics" and endpoint["honorLabels"] is True
    ports = [p["name"] for c in (shipped("rayjob.yaml")["spec"]["rayClusterSpec"]["headGroupSpec"],
                                 shipped("rayjob.yaml")["spec"]["rayClusterSpec"]["workerGroupSpecs"][0])
             for p in c["template"]["spec"]["containers"][0]["ports"]]
    assert ports.count("metrics") == 2


def test_storage_path_is_shell_quoted_in_the_entrypoint():
    import shlex

    spec_text = EXAMPLE.read_text()
    hostile = "s3://bucket/my runs; touch /tmp/pwned #"
    entrypoint = render(load_spec(EXAMPLE), spec_text, storage_path=hostile)["rayjob.yaml"]["spec"]["entrypoint"]
    assert shlex.split(entrypoint) == ["rayzip", "run", "/etc/rayzip/job.yaml", "--storage-path", hostile]
