"""The Grafana dashboard (issue 8): valid against Grafana's schema, with the variables and
data-source references Grafana needs. tests/system/test_adaptive.py evaluates every panel's
PromQL against a real Prometheus scraping a real run."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = ROOT / "tests" / "schemas" / "grafana" / "dashboard.jsonschema.json"  # vendored: tests/schemas/README.md
DASHBOARD = json.loads((ROOT / "dashboards" / "rayzip.json").read_text())


def test_dashboard_validates_against_grafanas_schema():
    errors = [f"{list(e.absolute_path)}: {e.message[:200]}"
              for e in jsonschema.Draft7Validator(json.loads(SCHEMA.read_text())).iter_errors(DASHBOARD)]
    assert not errors, errors
    assert DASHBOARD["schemaVersion"] == 42


def test_dashboard_has_datasource_run_and_rank_variables_and_object_datasource_refs():
    variables = {v["name"]: v for v in DASHBOARD["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert {"run", "rank"} <= set(variables)
    ref = {"type": "prometheus", "uid": "${datasource}"}
    for panel in DASHBOARD["panels"]:
        assert panel["datasource"] == ref, panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == ref and "$run" in target["expr"], (panel["title"], target["expr"])
    titles = " | ".join(p["title"] for p in DASHBOARD["panels"])
    for needed in ("Wire reduction per worker", "Wire bytes/s", "Communication against compute",
                   "Step time p50 and p95", "Batch loss", "Controller decisions", "Checkpoint",
                   "Recoveries and steps lost", "Time spent recovering"):
        assert needed in titles, titles


def test_the_configmap_carries_the_same_dashboard_for_grafanas_sidecar():
    import yaml

    configmap = yaml.safe_load((ROOT / "dashboards" / "rayzip-dashboard-configmap.yaml").read_text())
    assert configmap["kind"] == "ConfigMap" and configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(configmap["data"]["rayzip.json"]) == DASHBOARD
