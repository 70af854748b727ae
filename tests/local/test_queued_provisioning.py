"""tpuft_local.queued_provisioning, pure: the local stand-in for GKE's queued provisioning decides
from a ProvisioningRequest's own status and the real API's condition types, spelled here as the
cluster-autoscaler APIs spell them (k8s.io/autoscaler/cluster-autoscaler/apis, provisioningrequest v1)."""
from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from tpuft.api.catalog import resolve_slice
from tpuft_local import pools
from tpuft_local import queued_provisioning as qp

T0 = datetime(2026, 12, 7, 1, 0, 0, tzinfo=timezone.utc)
FAST = qp.Settings(provision_after=5, booking_seconds=600)


def at(s: float) -> datetime:
    return T0 + timedelta(seconds=s)


def request(conditions=(), parameters=None, annotations=None) -> dict:
    return {"metadata": {"name": "wl-flex-start-1", "namespace": "tpuft-demo", "uid": "abcdef-123", "generation": 1,
                         "annotations": annotations or {}},
            "spec": {"provisioningClassName": "queued-provisioning.gke.io", "parameters": parameters or {},
                     "podSets": [{"podTemplateRef": {"name": "ppt-wl-flex-start-1-workers"}, "count": 4}]},
            "status": {"conditions": list(conditions)}}


def apply(pr: dict, step: qp.Step) -> dict:
    pr = {**pr, "status": {"conditions": qp._merge(pr["status"]["conditions"], step.conditions)}}
    return pr


def types(step: qp.Step) -> dict[str, str]:
    return {c["type"]: c["status"] for c in step.conditions}


def test_accepted_then_waiting_for_capacity_then_provisioned_after_the_delay():
    pr = request()
    first = qp.step(pr, at(0), FAST, consumed=False)
    assert types(first) == {"Accepted": "True", "Provisioned": "False"} and not first.make_nodes
    waiting = next(c for c in first.conditions if c["type"] == "Provisioned")
    assert waiting["message"].startswith("Waiting for capacity") and "stand-in" in waiting["message"]
    pr = apply(pr, first)
    assert qp.step(pr, at(4), FAST, consumed=False) == qp.Step()
    done = qp.step(pr, at(5), FAST, consumed=False)
    assert done.make_nodes and types(done) == {"Provisioned": "True"}
    assert qp.step(apply(pr, done), at(6), FAST, consumed=True) == qp.Step()


def test_never_waits_for_capacity_for_good():
    never = qp.Settings.of({"provisionAfterSeconds": "never"})
    pr = apply(request(), qp.step(request(), at(0), never, consumed=False))
    assert "never" in pr["status"]["conditions"][1]["message"]
    assert qp.step(pr, at(10**6), never, consumed=False) == qp.Step()


def _provisioned(**kw) -> dict:
    pr = request(**kw)
    pr = apply(pr, qp.step(pr, at(0), FAST, consumed=False))
    return apply(pr, qp.step(pr, at(5), FAST, consumed=False))


def test_max_run_duration_revokes_the_capacity_and_removes_the_nodes():
    pr = _provisioned(parameters={"maxRunDurationSeconds": "3600"})
    assert qp.step(pr, at(5 + 3599), FAST, consumed=True) == qp.Step()
    revoked = qp.step(pr, at(5 + 3600), FAST, consumed=True)
    assert types(revoked) == {"CapacityRevoked": "True"} and not revoked.remove_nodes
    pr = apply(pr, revoked)
    notice = qp.REMOVAL_NOTICE_SECONDS
    assert qp.step(pr, at(5 + 3600 + notice - 1), FAST, consumed=True) == qp.Step()   # Kueue suspends meanwhile
    after = qp.step(pr, at(5 + 3600 + notice), FAST, consumed=True)
    assert after == qp.Step(remove_nodes=True)   # ended: the conditions stay, the nodes go


def test_the_stand_ins_annotation_revokes_at_once_in_its_words():
    pr = _provisioned(annotations={qp.REVOKE_ANNOTATION: "revoked by tests/cluster/test_kueue.py"})
    revoked = qp.step(pr, at(6), FAST, consumed=True)
    assert types(revoked) == {"CapacityRevoked": "True"} and "test_kueue" in revoked.conditions[0]["message"]


def test_an_unconsumed_booking_expires():
    pr = _provisioned()
    assert qp.step(pr, at(5 + 599), FAST, consumed=False) == qp.Step()
    expired = qp.step(pr, at(5 + 600), FAST, consumed=False)
    assert types(expired) == {"BookingExpired": "True"}
    assert qp.step(apply(pr, expired), at(5 + 600 + qp.REMOVAL_NOTICE_SECONDS), FAST, consumed=False).remove_nodes
    assert qp.step(pr, at(5 + 600), FAST, consumed=True) == qp.Step()   # pods on it: held


def _template(accelerator: str, topology: str) -> dict:
    return {"metadata": {"name": "ppt"}, "template": {"spec": {"nodeSelector": {
        "cloud.google.com/gke-tpu-accelerator": accelerator, "cloud.google.com/gke-tpu-topology": topology}}}}


@pytest.mark.parametrize("accelerator,topology,count,slices", [
    ("tpu-v6e-slice", "4x4", 4, 1), ("tpu-v6e-slice", "4x4", 8, 2), ("tpu7x", "2x2x2", 2, 1)])
def test_the_pod_templates_say_which_slices(accelerator, topology, count, slices):
    got = qp.slices_of([({"metadata": {"name": "head"}, "template": {"spec": {}}}, 1),
                        (_template(accelerator, topology), count)])
    assert isinstance(got, qp.Slices) and got.slices == slices and got.shape.topology == topology


def test_a_partial_slice_is_refused():
    assert "not whole" in qp.slices_of([(_template("tpu-v6e-slice", "4x4"), 6)])


def test_a_worker_group_per_slice_is_one_request_for_all_of_them_of_one_shape():
    """Kueue TAS with slices > 1: the operator renders one pod set per slice."""
    got = qp.slices_of([(_template("tpu-v6e-slice", "4x4"), 4), (_template("tpu-v6e-slice", "4x4"), 4)])
    assert isinstance(got, qp.Slices) and got.slices == 2
    mixed = qp.slices_of([(_template("tpu-v6e-slice", "4x4"), 4), (_template("tpu-v6e-slice", "2x4"), 2)])
    assert isinstance(mixed, str) and "one slice shape" in mixed


def test_the_flex_start_pool_has_gkes_labels_and_taints_one_node_pool_per_slice():
    shape = resolve_slice("v6e", "4x4")
    nodes = pools.flex_start_nodes(shape, "v6e-4x4-flex-abcde", 2, {qp.OWNER_LABEL: "abcdef-123"})
    assert len(nodes) == 8
    labels = nodes[0]["metadata"]["labels"]
    assert labels["cloud.google.com/gke-flex-start"] == "true" and labels["cloud.google.com/gke-queued"] == "true"
    assert labels["cloud.google.com/gke-tpu-accelerator"] == "tpu-v6e-slice" and labels[qp.OWNER_LABEL] == "abcdef-123"
    assert {n["metadata"]["labels"]["cloud.google.com/gke-nodepool"] for n in nodes} == {
        "v6e-4x4-flex-abcde-0", "v6e-4x4-flex-abcde-1"}
    assert {"key": "cloud.google.com/gke-queued", "value": "true", "effect": "NoSchedule"} in nodes[0]["spec"]["taints"]
    assert nodes[0]["metadata"]["annotations"][pools.KWOK_ANNOTATION] == "fake"   # KWOK keeps it Ready
