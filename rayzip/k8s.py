"""KubeRay manifests for a job spec: ``rayzip k8s render SPEC``.

From a job spec it fills:

* a ConfigMap holding the spec, mounted at ``/etc/rayzip/job.yaml``;
* a RayJob (``ray.io/v1``) whose entrypoint is ``rayzip run`` on that spec, on a cluster with
  token auth, in-tree autoscaling, and one worker group of ``min_workers`` to ``max_workers``
  pods (one training worker each, ``nvidia.com/gpu`` limits, ``restartPolicy: Never``),
  deleted ``ttl`` seconds after the job finishes;
* a RayCluster with the same head and workers, long-lived, for ``rayzip submit`` and
  ``ray job submit``.

The head exposes Ray's metrics export port as ``metrics`` (8080) for the PodMonitor in
``k8s/podmonitor.yaml``. :func:`operator_problems` checks the rules KubeRay's operator enforces
beyond its CRD schema.

Usage::

    manifests = render(load_spec("jobs/synthetic-gpu.yaml"), spec_text, image="rayzip:0.1.0")
    for name, manifest in manifests.items(): ...
"""

from __future__ import annotations

import re
import shlex
from typing import Any

from .spec import JobSpec

__all__ = ["DEFAULT_IMAGE", "operator_problems", "render"]

DEFAULT_IMAGE = "rayzip:0.1.0"
RAY_VERSION = "2.60.0"
SPEC_DIR = "/etc/rayzip"
METRICS_PORT = 8080


def _container(name: str, image: str, cpus: float, memory: str, gpus: int, ports: list[dict]) -> dict:
    limits: dict[str, Any] = {"cpu": _quantity(cpus), "memory": memory}
    if gpus:
        limits["nvidia.com/gpu"] = gpus
    return {
        "name": name,
        "image": image,
        "resources": {"limits": limits, "requests": {"cpu": _quantity(cpus), "memory": memory}},
        "ports": ports,
        # Metrics reach Prometheus every 2 s (Ray's default is 10 s), as the controller wants.
        "env": [{"name": "RAY_metrics_report_interval_ms", "value": "2000"}],
        "volumeMounts": [{"name": "job-spec", "mountPath": SPEC_DIR, "readOnly": True}],
    }


def _quantity(cpus: float) -> str:
    return str(int(cpus)) if float(cpus).is_integer() else f"{int(cpus * 1000)}m"


def _cluster_spec(spec: JobSpec, image: str, gpus: int, memory: str, configmap: str) -> dict:
    s = spec.scaling

    def volumes() -> list[dict]:  # a fresh list each time: YAML would otherwise write anchors
        return [{"name": "job-spec", "configMap": {"name": configmap}}]
    head_ports = [{"name": "gcs-server", "containerPort": 6379}, {"name": "dashboard", "containerPort": 8265},
                  {"name": "client", "containerPort": 10001}, {"name": "metrics", "containerPort": METRICS_PORT}]
    return {
        "rayVersion": RAY_VERSION,
        "enableInTreeAutoscaling": True,
        "authOptions": {"mode": "token"},
        "headGroupSpec": {
            # The head schedules no training: it runs the driver, the controller and Ray's services.
            "rayStartParams": {"num-cpus": "0", "dashboard-host": "0.0.0.0",
                               "metrics-export-port": str(METRICS_PORT)},
            "template": {"spec": {
                "containers": [_container("ray-head", image, 2, "8Gi", 0, head_ports)],
                "volumes": volumes(),
            }},
        },
        "workerGroupSpecs": [{
            "groupName": "gpu-workers" if gpus else "workers",
            "replicas": s.min_workers,
            "minReplicas": s.min_workers,
            "maxReplicas": s.max_workers,
            "rayStartParams": {"metrics-export-port": str(METRICS_PORT)},
            "template": {"spec": {
                # The autoscaler replaces failed workers; Kubernetes must not restart them in place.
                "restartPolicy": "Never",
                "containers": [_container("ray-worker", image, max(1.0, s.cpus_per_worker), memory, gpus,
                                          [{"name": "metrics", "containerPort": METRICS_PORT}])],
                "volumes": volumes(),
            }},
        }],
    }


def render(spec: JobSpec, spec_text: str, image: str = DEFAULT_IMAGE, namespace: str | None = None,
           gpus_per_worker: int | None = None, worker_memory: str = "16Gi", storage_path: str | None = None,
           ttl_seconds: int = 3600) -> dict[str, dict]:
    """``{file name: manifest}`` for ``spec`` (whose YAML text goes into the ConfigMap)."""
    gpus = (1 if spec.scaling.use_gpu else 0) if gpus_per_worker is None else gpus_per_worker
    name = spec.name
    configmap = f"{name}-spec"
    meta = {"labels": {"app.kubernetes.io/name": "rayzip", "rayzip/job": name}}
    if namespace:
        meta["namespace"] = namespace
    # KubeRay runs the entrypoint through a shell: every argument is quoted.
    command = ["rayzip", "run", f"{SPEC_DIR}/job.yaml"]
    if storage_path:
        command += ["--storage-path", storage_path]
    entrypoint = shlex.join(command)
    manifests = {
        "configmap.yaml": {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": configmap, **meta},
                           "data": {"job.yaml": spec_text}},
        "rayjob.yaml": {
            "apiVersion": "ray.io/v1", "kind": "RayJob", "metadata": {"name": name, **meta},
            "spec": {
                "entrypoint": entrypoint,
                "shutdownAfterJobFinishes": True,
                "ttlSecondsAfterFinished": ttl_seconds,
                "rayClusterSpec": _cluster_spec(spec, image, gpus, worker_memory, configmap),
            },
        },
        "raycluster.yaml": {
            "apiVersion": "ray.io/v1", "kind": "RayCluster", "metadata": {"name": f"{name}-cluster", **meta},
            "spec": _cluster_spec(spec, image, gpus, worker_memory, configmap),
        },
    }
    problems = [p for m in manifests.values() for p in operator_problems(m)]
    if problems:
        raise ValueError("; ".join(problems))
    return manifests


_DNS_1035 = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")


def operator_problems(manifest: dict) -> list[str]:
    """Rules KubeRay's operator enforces that its CRD schema does not express."""
    kind, name = manifest.get("kind"), manifest.get("metadata", {}).get("name", "")
    problems = []
    if not _DNS_1035.fullmatch(name) or len(name) > 63:
        problems.append(f"{kind} name {name!r} is not a DNS-1035 label of at most 63 characters")
    if kind not in ("RayJob", "RayCluster"):
        return problems
    cluster = manifest["spec"]["rayClusterSpec"] if kind == "RayJob" else manifest["spec"]
    if kind == "RayJob":
        job = manifest["spec"]
        if job.get("shutdownAfterJobFinishes") is not True and "ttlSecondsAfterFinished" in job:
            problems.append("ttlSecondsAfterFinished needs shutdownAfterJobFinishes: true")
        if not job.get("entrypoint"):
            problems.append("a RayJob needs an entrypoint")
    autoscaled = cluster.get("enableInTreeAutoscaling", False)
    groups = cluster.get("workerGroupSpecs", [])
    if len({g["groupName"] for g in groups}) != len(groups):
        problems.append("worker group names repeat")
    for group in groups:
        low, high = group.get("minReplicas", 0), group.get("maxReplicas", 2 ** 31 - 1)
        replicas = group.get("replicas", low)
        if not low <= replicas <= high:
            problems.append(f"group {group['groupName']}: needs minReplicas <= replicas <= maxReplicas "
                            f"(got {low}, {replicas}, {high})")
        if autoscaled and group["template"]["spec"].get("restartPolicy") != "Never":
            problems.append(f"group {group['groupName']}: autoscaled workers need restartPolicy: Never")
    for container in cluster["headGroupSpec"]["template"]["spec"]["containers"][:1]:
        if not any(p.get("name") == "metrics" for p in container.get("ports", [])):
            problems.append("the head container exposes no port named metrics (for the PodMonitor)")
    if cluster.get("authOptions", {}).get("mode") != "token":
        problems.append("token auth is off (authOptions.mode: token)")
    return problems
