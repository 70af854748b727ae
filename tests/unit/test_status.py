"""tpuft.api.status: the typed status reads and writes the JSON the API server stores (every field
round-trips), its methods make the edits tpuft.controller.phases makes, the merge patch between two of them
is what the status write sends, and the CRD's status schema is generated from the same types."""
from __future__ import annotations

import copy
import dataclasses
import typing

import pytest

from tests.factories import merge_patch
from tpuft.api import constants as c
from tpuft.api import crd
from tpuft.controller import phases
from tpuft.api import status as run_status
from tpuft.api.constants import ConditionStatus, GoodputCause, Phase
from tpuft.api.fields import declared, to_json
from tpuft.api.status import (Goodput, IgnoredSpecChange, LostSlice, LostSubmission, Preemption, Recovery, Resubmit,
                          RunStatus, Serving)

T = "2026-01-01T12:00:00Z"

# A status with every field the schema declares, as the API server would return it.
FULL = {
    "phase": "Training", "reason": "Training", "message": "training (RayJob ft-train-1, attempt 2 of 3)",
    "observedGeneration": 2, "appliedGeneration": 1,
    "appliedSpec": {"accelerator": "v6e", "topology": "4x4", "training": {"epochs": 3}},
    "phaseTransitionTime": T, "startTime": T, "completionTime": T, "trainingAttempts": 2,
    "recovery": {
        "sliceReplacements": 1, "preemptions": 1,
        "lastPreemption": {"time": T, "phase": "Training", "cause": "Preempted: by a higher priority", "step": 30},
        "history": [{"time": T, "phase": "Training", "cause": "3/4 worker hosts ready", "hostsReady": 3, "hosts": 4,
                     "step": 40}],
        "lostSubmissions": [{"time": T, "phase": "Training", "rayJob": "ft-train", "resubmittedAs": "ft-train-1"}],
        "resubmit": {"rayJob": "ft-train-1", "seen": T, "at": T},
        "slicePods": ["uid-head", "uid-w0"], "checkpointRequestedAt": T,
        "lastMaintenance": {"time": T, "node": "n-1", "notice": "cloud.google.com/active-node-maintenance=true",
                            "step": 41, "checkpointStep": 42},
        "elastic": {"slices": 1, "gradientAccumulationSteps": 2, "since": T},
    },
    "ignoredSpecChange": {"observedGeneration": 2, "fields": ["spec.training.epochs"], "valid": True,
                          "message": "spec change ignored: spec.training.epochs"},
    "conditions": [{"type": "Ready", "status": "False", "reason": "Training", "message": "", "lastTransitionTime": T,
                    "observedGeneration": 2}],
    "children": {"rayCluster": "ft-ray", "verifyJob": "ft-verify", "trainJob": "ft-train-1",
                 "publishJob": "ft-publish", "unpublishJob": "ft-unpublish-0123456789",
                 "serviceAccount": "ft-workload", "rayService": "ft-serve"},
    "serving": {"service": "ft-serve-serve-svc", "port": 8000, "model": "ft", "base": "base", "adapter": "ft",
                "published": {"evalLoss": 1.25, "evalSet": "heldout:0.1:seed42:d[train]", "publishedAt": T},
                "reason": "Published", "message": "served by base as model base:ft", "rayCluster": "ft-serve-raycluster-x",
                "adaptersRoot": "gs://b/ft/adapters", "url": "http://ft-serve-serve-svc:8000",
                "engine": "vllm", "modelSource": "gs://b/ft/export", "notReadySince": T},
    "adapters": {"count": 1, "served": [{"name": "ft", "model": "base:ft", "source": "ns/ft", "uid": "u-1",
                                         "evalLoss": 1.25, "publishedAt": T, "unpublishing": False}]},
    "slice": {"accelerator": "v6e", "topology": "4x4", "slices": 1, "hosts": 4, "chipsPerHost": 4,
              "devicesPerHost": 4, "devices": 16, "rayAcceleratorType": "TPU-V6E"},
    "goodput": {"provisioningSeconds": 30, "queuedSeconds": 0, "verificationSeconds": 20, "trainingSeconds": 150,
                "recoverySeconds": 0, "suspendedSeconds": 0, "totalSeconds": 200, "ratio": 0.75},
    "verification": {"passed": True, "ranks": 16, "hosts": 4, "allReduceSum": 136.0, "expectedSum": 136.0,
                     "maxAbsDiff": 2.5e-7, "seconds": 4.25, "message": "ok",
                     "storageError": "gs://b/ft is not writable"},
    "training": {"checkpointRequestSaved": T, "storageError": "gs://b/ft is not writable", "epoch": 2, "epochs": 3, "step": 40, "totalSteps": 60, "loss": 1.5, "tokensPerSecond": 100.5,
                 "paddedTokensPerSecond": 120.5, "stepTimeSeconds": 0.25, "padFraction": 0.125,
                 "lastCheckpoint": "gs://b/ft/checkpoint_step_0000040", "resumedFrom": "gs://b/ft/checkpoint_step_0000020",
                 "resumedFromStep": 20, "message": "resumed", "exportedModel": "gs://b/ft/export",
                 "trainableParameters": 524288, "totalParameters": 10174976, "mfu": 0.375,
                 "history": [{"step": 20, "loss": 2.5, "tokensPerSecond": 90.5, "evalLoss": 2.75}], "updatedAt": T,
                 "learningRate": 1.5e-5, "globalBatchSize": 64, "epochLoss": 1.75, "evalLoss": 2.5,
                 "evalPerplexity": 12.25, "bestEvalLoss": 2.25, "bestStep": 30},
}


def _paths(cls: type, prefix: str = "") -> set[str]:
    """Every declared JSON path of a section, into objects and arrays of objects."""
    out = set()
    for d in declared(cls):
        path = f"{prefix}{d.name}"
        out.add(path)
        inner = typing.get_args(d.type)[0] if typing.get_origin(d.type) else d.type
        if typing.get_origin(inner) is tuple:
            inner = typing.get_args(inner)[0]
        if dataclasses.is_dataclass(inner):
            out |= _paths(inner, f"{path}.")
    return out


def _json_paths(value: object, prefix: str = "") -> set[str]:
    out = set()
    items = value if isinstance(value, list) else [value]
    for item in items:
        if isinstance(item, dict):
            for k, v in item.items():
                out.add(f"{prefix}{k}")
                if k != "appliedSpec":   # preserved as written, not declared field by field
                    out |= _json_paths(v, f"{prefix}{k}.")
    return out


def test_the_sample_sets_every_declared_field():
    assert _json_paths(FULL) == _paths(RunStatus)


def test_every_field_round_trips_through_the_typed_status():
    typed = RunStatus.of(copy.deepcopy(FULL))
    assert to_json(typed) == FULL
    assert typed.phase is Phase.TRAINING and typed.conditions[0].status is ConditionStatus.FALSE
    assert typed.recovery.history[0].hosts_ready == 3 and typed.training.history[0].tokens_per_second == 90.5
    assert RunStatus.of(to_json(typed)) == typed


def test_whole_numbers_the_api_server_returns_as_integers_read_as_floats():
    stored = copy.deepcopy(FULL)
    stored["goodput"]["ratio"], stored["training"]["loss"] = 1, 2
    typed = RunStatus.of(stored)
    assert typed.goodput.ratio == 1.0 and isinstance(typed.goodput.ratio, float)
    assert to_json(typed) == stored   # 1 == 1.0: no status write for it


def test_owned_json_leaves_the_workloads_blocks_out():
    owned = RunStatus.of(FULL).owned_json()
    assert set(owned) == set(FULL) - {"verification", "training"} == set(run_status.OWNED_KEYS)
    assert owned == run_status.owned(FULL)


def test_a_phase_this_version_does_not_know_reads_as_none():
    assert RunStatus.of({"phase": "Exploding", "message": "m"}) == RunStatus(message="m")
    assert RunStatus.of(None) == RunStatus() and to_json(RunStatus()) == {}


def test_the_crds_status_schema_is_generated_from_the_types():
    schema = crd.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]
    assert schema == run_status.schema()
    props = schema["properties"]
    assert props["phase"]["enum"] == [p.value for p in Phase]
    assert props["recovery"]["properties"]["history"]["maxItems"] == c.RECOVERY_HISTORY_MAX
    assert props["recovery"]["properties"]["lostSubmissions"]["maxItems"] == c.LOST_SUBMISSION_RETRIES
    assert props["conditions"]["x-kubernetes-list-map-keys"] == ["type"]
    assert props["conditions"]["items"]["required"] == ["type", "status"]
    assert props["appliedSpec"]["x-kubernetes-preserve-unknown-fields"] is True
    assert list(props["training"]["properties"]) == [k.value for k in c.TrainingStatus]
    assert list(props["verification"]["properties"]) == [k.value for k in c.VerificationStatus]


def test_a_block_keyed_by_constants_must_declare_exactly_them():
    with pytest.raises(TypeError, match="maxAbsDiff"):
        run_status._names_follow(run_status.Verification, [k.value for k in c.VerificationStatus][:-3] + ["x", "y"])


# --- the edits ---------------------------------------------------------------------------------------
def _loss(step: int) -> LostSlice:
    return LostSlice(time=T, phase=Phase.TRAINING.value, cause="3/4 worker hosts ready", hosts_ready=3, hosts=4,
                     step=step)


def test_a_loss_is_recorded_with_the_count_stated_and_the_history_bounded():
    waiting = Recovery(resubmit=Resubmit(ray_job="ft-train", seen=T, at=T))
    first = waiting.record_loss(_loss(1))
    assert (first.slice_replacements, first.history, first.resubmit) == (0, (_loss(1),), None)
    assert first.replacing_slice().slice_replacements == 1
    recovery = Recovery()
    for step in range(c.RECOVERY_HISTORY_MAX + 3):
        recovery = recovery.record_loss(_loss(step)).replacing_slice()
    assert [x.step for x in recovery.history] == list(range(3, c.RECOVERY_HISTORY_MAX + 3))   # the latest kept
    assert recovery.slice_replacements == c.RECOVERY_HISTORY_MAX + 3


def test_a_preemption_is_counted_and_the_latest_kept():
    recovery = Recovery().record_preemption(Preemption(time=T, phase="Training", cause="a", step=1))
    recovery = recovery.record_preemption(Preemption(time=T, phase="Verifying", cause="b"))
    assert recovery.preemptions == 2 and recovery.last_preemption == Preemption(time=T, phase="Verifying", cause="b")
    assert recovery.slice_replacements is None   # a preemption is never a replacement


def test_a_lost_submission_is_waited_for_then_recorded():
    wait = Resubmit(ray_job="ft-verify", seen=T, at="2026-01-01T12:00:10Z")
    waiting = Recovery().waiting_to_resubmit(wait)
    assert waiting.resubmit == wait and waiting.lost_count() == 0
    done = waiting.lost_submission(LostSubmission(time=T, phase=Phase.VERIFYING.value, ray_job="ft-verify",
                                                  resubmitted_as="ft-verify-1"))
    done = done.lost_submission(LostSubmission(time=T, phase=Phase.TRAINING.value, ray_job="ft-train",
                                               resubmitted_as="ft-train-1"))
    assert done.resubmit is None
    assert (done.lost_count(), done.lost_count(Phase.VERIFYING), done.lost_count(Phase.TRAINING)) == (2, 1, 1)


def test_dropping_a_resubmission_drops_a_recovery_block_left_empty():
    wait = Resubmit(ray_job="ft-train", seen=T, at=T)
    only = RunStatus(recovery=Recovery(resubmit=wait))
    assert only.without_resubmission() == RunStatus()
    counted = RunStatus(recovery=Recovery(preemptions=1, resubmit=wait))
    assert counted.without_resubmission() == RunStatus(recovery=Recovery(preemptions=1))
    assert RunStatus().without_resubmission() == RunStatus()


def test_a_restart_forgets_what_the_failed_run_recorded_about_itself():
    restarted = RunStatus.of(FULL).restarted()
    gone = {"phase", "reason", "message", "completionTime", "phaseTransitionTime", "conditions", "startTime", "goodput"}
    assert set(to_json(restarted)) == set(FULL) - gone


def test_serving_ready_and_not_ready():
    serving = Serving(model="ft", not_ready_since=T)
    assert serving.ready() == Serving(model="ft")
    assert Serving(model="ft").not_ready(T) == serving


def test_goodput_has_every_cause_the_total_and_the_ratio():
    spent = Goodput.of({GoodputCause.PROVISIONING: 30, GoodputCause.TRAINING: 90})
    assert (spent.total, spent.ratio, spent.seconds(GoodputCause.QUEUED)) == (120, 0.75, 0)
    more = spent.add(GoodputCause.TRAINING, 80)
    assert (more.seconds(GoodputCause.TRAINING), more.total, more.ratio) == (170, 200, 0.85)
    assert Goodput().ratio is None and "ratio" not in to_json(Goodput())


# --- the merge patch between two statuses ------------------------------------------------------------
def _patch(before: RunStatus, after: RunStatus) -> dict | None:
    return phases.draft._merge_patch(before.owned_json(), after.owned_json())


def test_no_change_is_no_patch():
    typed = RunStatus.of(FULL)
    assert _patch(typed, dataclasses.replace(typed)) is None


def test_the_patch_nulls_what_went_at_every_depth_and_leaves_the_workloads_blocks_alone():
    before = RunStatus.of(FULL)
    after = dataclasses.replace(before, ignored_spec_change=None, serving=before.serving.ready(),
                                recovery=before.recovery.record_loss(_loss(50)), message="replacing")
    patch = _patch(before, after)
    assert patch["ignoredSpecChange"] is None
    assert patch["serving"] == {**FULL["serving"], "notReadySince": None}
    assert patch["recovery"]["resubmit"] is None and len(patch["recovery"]["history"]) == 2   # arrays go whole
    assert patch["message"] == "replacing" and "training" not in patch and "verification" not in patch
    stored = merge_patch(copy.deepcopy(FULL), patch)
    assert RunStatus.of(stored) == after


def test_an_ignored_change_that_appears_is_written_whole():
    before = RunStatus.of({"phase": "Training"})
    change = IgnoredSpecChange(observed_generation=2, fields=(), valid=False, message="new spec is invalid")
    patch = _patch(before, dataclasses.replace(before, ignored_spec_change=change))
    assert patch == {"ignoredSpecChange": {"observedGeneration": 2, "fields": [], "valid": False,
                                           "message": "new spec is invalid"}}
