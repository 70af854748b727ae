"""charts/tpufinetune-operator/argocd/health.lua, run with Lua 5.1 (Argo CD uses gopher-lua,
a Lua 5.1 implementation) over the TPUFinetune fixtures in fixtures/argocd/."""
from __future__ import annotations

from pathlib import Path

import jsonschema
import pytest
import yaml

from tests.chart.helmlib import CHART, REPO, run_health
from tpuft.constants import Condition


FIXTURES = sorted((Path(__file__).parent / "fixtures" / "argocd").glob("*.yaml"))
ARGO_STATUSES = {"Healthy", "Progressing", "Degraded", "Suspended", "Missing", "Unknown"}


def _status_schema() -> dict:
    crd = yaml.safe_load((REPO / "crds" / "tpufinetune.yaml").read_text())
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1alpha1")
    return version["schema"]["openAPIV3Schema"]["properties"]["status"]


def test_there_is_a_fixture_per_phase_and_edge_case():
    phases = set()
    for f in FIXTURES:
        status = yaml.safe_load(f.read_text())["object"].get("status") or {}
        phases.add(status.get("phase"))
    assert {"Pending", "Provisioning", "VerifyingCollectives", "Training",
            "Succeeded", "Failed", "Suspended", "Serving", None} <= phases
    names = {f.stem.split("-", 1)[1] for f in FIXTURES}
    assert {"generation-lag", "missing-status"} <= names


@pytest.mark.parametrize("fixture", FIXTURES, ids=[f.stem for f in FIXTURES])
def test_health(fixture):
    doc = yaml.safe_load(fixture.read_text())
    hs = run_health(doc["object"])
    assert hs["status"] in ARGO_STATUSES
    assert hs == {"status": doc["expect"]["health"], "message": doc["expect"]["message"]}


@pytest.mark.parametrize("fixture", FIXTURES, ids=[f.stem for f in FIXTURES])
def test_fixture_status_matches_crd_schema(fixture):
    """Fixtures (synthetic now, captured later) must have the CRD's status shape."""
    obj = yaml.safe_load(fixture.read_text())["object"]
    assert obj["apiVersion"] == "tpufinetune.dev/v1alpha1" and obj["kind"] == "TPUFinetune"
    if "status" in obj:
        jsonschema.validate(obj["status"], _status_schema())
        for c in obj["status"].get("conditions", []):
            assert c["type"] in {t.value for t in Condition}


def _obj(phase=None, generation=1, observed=1, conditions=None, **status):
    o = {"apiVersion": "tpufinetune.dev/v1alpha1", "kind": "TPUFinetune",
         "metadata": {"name": "x", "namespace": "ns", "generation": generation}, "spec": {}}
    if phase is not None:
        o["status"] = {"phase": phase, "observedGeneration": observed, "conditions": conditions or [], **status}
    return o


def test_unknown_phase_is_unknown():
    assert run_health(_obj("Exploding"))["status"] == "Unknown"


def test_empty_status_is_progressing():
    o = _obj()
    o["status"] = {}
    assert run_health(o)["status"] == "Progressing"


def test_observed_generation_ahead_or_equal_is_judged_on_phase():
    assert run_health(_obj("Succeeded", generation=3, observed=3))["status"] == "Healthy"


def test_missing_generation_does_not_crash():
    o = _obj("Failed", conditions=[{"type": "Failed", "status": "True", "reason": "X", "message": "boom"}])
    del o["metadata"]["generation"]
    assert run_health(o) == {"status": "Degraded", "message": "boom"}


def test_messages_fall_back_to_status_message_then_default():
    assert run_health(_obj("Failed", message="from status"))["message"] == "from status"
    assert run_health(_obj("Failed"))["message"] == "Fine-tuning failed"
    assert run_health(_obj("Training"))["message"] == "Training"
    assert run_health(_obj("Succeeded"))["message"] == "Fine-tuning succeeded"


def test_argocd_readme_embeds_the_configmap_key():
    readme = (CHART / "argocd" / "README.md").read_text()
    assert "resource.customizations.health.tpufinetune.dev_TPUFinetune: |" in readme
    assert "ServerSideApply=true" in readme
