"""charts/tpufinetune-operator/argocd/health.lua over the TPUFinetune fixtures in fixtures/argocd/:
run with Lua 5.1 (lupa; Argo CD uses gopher-lua, a Lua 5.1 implementation) for the fast cases, and
every fixture also judged by Argo CD's own code (hack/argocd's `health`: argocd-cm read by Argo CD's
SettingsManager, then gitops-engine's health.GetResourceHealth, as its controller calls it)."""
from __future__ import annotations

from pathlib import Path

import json
import subprocess

import jsonschema
import pytest
import yaml

from tests.chart.helmlib import CHART, REPO, run_health
from tpuft.api.constants import Condition


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


def _readme_configmap() -> dict:
    """argocd-cm as the chart's argocd/README.md shows it, health.lua pasted where it says."""
    readme = (CHART / "argocd" / "README.md").read_text()
    block = next(b.split("\n", 1)[1] for b in readme.split("```yaml")[1:] if "kind: ConfigMap" in b.split("```")[0])
    cm = yaml.safe_load(block.split("```")[0])
    (key,) = cm["data"]
    cm["data"][key] = (CHART / "argocd" / "health.lua").read_text()
    return cm


def test_argo_cds_own_health_code_agrees_with_every_fixture(tmp_path):
    from tpuft_local.toolchain import tool_path   # built by `tpuft cluster tools` (the lane's first tier)

    cm = tmp_path / "argocd-cm.yaml"
    cm.write_text(yaml.safe_dump(_readme_configmap()))
    res = subprocess.run([tool_path("argocd-local"), "health", str(cm), *map(str, FIXTURES)],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    got = {Path(v["file"]).stem: v for v in map(json.loads, res.stdout.splitlines())}
    want = {f.stem: yaml.safe_load(f.read_text())["expect"] for f in FIXTURES}
    assert {k: (v.get("status"), v.get("message"), v.get("error")) for k, v in got.items()} == \
        {k: (e["health"], e["message"], None) for k, e in want.items()}


def test_argo_cd_sees_no_health_without_the_readmes_labels(tmp_path):
    """Argo CD finds argocd-cm only by its app.kubernetes.io/part-of label: without it the object
    has no health at all (what a user who drops the README's labels sees)."""
    from tpuft_local.toolchain import tool_path

    doc = _readme_configmap()
    del doc["metadata"]["labels"]["app.kubernetes.io/part-of"]
    cm = tmp_path / "argocd-cm.yaml"
    cm.write_text(yaml.safe_dump(doc))
    res = subprocess.run([tool_path("argocd-local"), "health", str(cm), str(FIXTURES[0])],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 1 and 'configmap "argocd-cm" not found' in res.stderr, (res.stdout, res.stderr)
