"""The chart's Grafana dashboard (charts/tpufinetune-operator/dashboards/tpufinetune.json) and its
PodMonitor: valid JSON that a JSON Schema of the Grafana dashboard model's parts we use accepts,
a panel with a unit per workload gauge (tpuft.api.constants.TrainMetric, as Ray exports it), panels
that do not overlap, and a PodMonitor template that selects by the labels and port the operator
and KubeRay give Ray pods (one source: the constants). Rendering is tests/chart's (helm)."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest

from tests.paths import REPO
from tpuft.api import constants as c
from tpuft.api import kuberay
from tpuft_workload import metrics_log

CHART = REPO / "charts" / "tpufinetune-operator"
DASHBOARD = CHART / "dashboards" / "tpufinetune.json"

_DATASOURCE = {"type": "object", "required": ["type", "uid"],
               "properties": {"type": {"const": "prometheus"}, "uid": {"const": "${datasource}"}}}
# The parts of Grafana's dashboard model (schemaVersion 39) this dashboard uses, strictly.
SCHEMA = {
    "type": "object",
    "required": ["title", "uid", "schemaVersion", "panels", "templating", "time"],
    "properties": {
        "title": {"type": "string", "minLength": 1},
        "uid": {"type": "string", "pattern": "^[a-zA-Z0-9_-]{1,40}$"},
        "schemaVersion": {"type": "integer", "minimum": 36},
        "time": {"type": "object", "required": ["from", "to"]},
        "templating": {"type": "object", "required": ["list"], "properties": {"list": {"type": "array", "items": {
            "type": "object", "required": ["name", "type"],
            "properties": {"type": {"enum": ["datasource", "query"]}}}}}},
        "panels": {"type": "array", "minItems": 1, "items": {
            "type": "object",
            "required": ["id", "type", "title", "gridPos", "targets", "datasource", "fieldConfig"],
            "properties": {
                "id": {"type": "integer", "minimum": 1},
                "type": {"enum": ["timeseries", "stat"]},
                "title": {"type": "string", "minLength": 1},
                "datasource": _DATASOURCE,
                "gridPos": {"type": "object", "required": ["h", "w", "x", "y"], "additionalProperties": False,
                            "properties": {"h": {"type": "integer", "minimum": 1},
                                           "w": {"type": "integer", "minimum": 1, "maximum": 24},
                                           "x": {"type": "integer", "minimum": 0, "maximum": 23},
                                           "y": {"type": "integer", "minimum": 0}}},
                "fieldConfig": {"type": "object", "required": ["defaults"], "properties": {"defaults": {
                    "type": "object", "required": ["unit"], "properties": {"unit": {"type": "string"}}}}},
                "targets": {"type": "array", "minItems": 1, "items": {
                    "type": "object", "required": ["refId", "expr", "datasource"],
                    "properties": {"expr": {"type": "string", "minLength": 1}, "datasource": _DATASOURCE}}},
            }}},
    },
}


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def test_the_dashboard_is_valid_json_in_grafanas_model(dashboard):
    jsonschema.validate(dashboard, SCHEMA)
    assert {v["name"] for v in dashboard["templating"]["list"]} == {"datasource", "namespace", "tpufinetune"}


def test_ids_are_unique_and_panels_do_not_overlap(dashboard):
    panels = dashboard["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    cells = [(p["gridPos"]["x"] + dx, p["gridPos"]["y"] + dy) for p in panels
             for dx in range(p["gridPos"]["w"]) for dy in range(p["gridPos"]["h"])]
    assert len(cells) == len(set(cells)) and all(x < 24 for x, _ in cells)


@pytest.mark.parametrize("metric,unit", [
    (c.TrainMetric.TOKENS_PER_SECOND, "short"),
    (c.TrainMetric.STEP_TIME_SECONDS, "s"),
    (c.TrainMetric.LOSS, "none"),
    (c.TrainMetric.MFU, "percentunit"),   # 0 to 1, as status.training.mfu
    (c.TrainMetric.STEP, "none"),
])
def test_each_gauge_has_a_panel_with_its_unit(dashboard, metric, unit):
    pattern = re.compile(rf"\b{metric.exported}\{{[^}}]*{c.TRAIN_METRIC_TAG}=~\"\$tpufinetune\"")
    (panel,) = [p for p in dashboard["panels"] if any(pattern.search(t["expr"]) for t in p["targets"])]
    assert panel["fieldConfig"]["defaults"]["unit"] == unit


def test_every_gauge_the_workload_sets_is_on_the_dashboard(dashboard):
    exprs = " ".join(t["expr"] for p in dashboard["panels"] for t in p["targets"])
    assert set(metrics_log.GAUGES) == set(c.TrainMetric) and set(metrics_log.DESCRIPTIONS) == set(c.TrainMetric)
    assert all(m.exported in exprs for m in c.TrainMetric)
    assert set(re.findall(r"\bray_tpuft_\w+", exprs)) <= {m.exported for m in c.TrainMetric}   # no stray names


def test_the_pod_monitor_selects_ray_pods_of_a_tpufinetune_on_kuberays_metrics_port():
    text = (CHART / "templates" / "workload-metrics.yaml").read_text()
    assert f"- key: {c.LABEL_NAME}\n        operator: Exists" in text
    assert f"- key: {kuberay.RAY_NODE_TYPE_LABEL}\n        operator: Exists" in text
    assert f"- port: {kuberay.RAY_METRICS_PORT_NAME}\n" in text
    assert '.Files.Get "dashboards/tpufinetune.json"' in text
