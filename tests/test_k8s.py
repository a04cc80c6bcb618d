"""Kubernetes manifests shipped in k8s/ (the KubeRay ones arrive with issue 8)."""

from __future__ import annotations

from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def test_podmonitor_scrapes_every_ray_pods_metrics_port_keeping_rayzips_job_label():
    monitor = yaml.safe_load((ROOT / "k8s" / "podmonitor.yaml").read_text())
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1" and monitor["kind"] == "PodMonitor"
    spec = monitor["spec"]
    (match,) = spec["selector"]["matchExpressions"]
    assert match == {"key": "ray.io/node-type", "operator": "In", "values": ["head", "worker"]}
    (endpoint,) = spec["podMetricsEndpoints"]
    # KubeRay names Ray's metrics export port `metrics`; rayzip's series carry their own `job`.
    assert endpoint["port"] == "metrics" and endpoint["honorLabels"] is True
    assert set(spec) <= {"namespaceSelector", "selector", "podMetricsEndpoints", "jobLabel"}
