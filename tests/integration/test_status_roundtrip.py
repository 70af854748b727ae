"""The API server prunes unknown status fields silently: every key the workload writes (through
tpuft_workload.report, as the RayJobs do) and every key the operator writes survives a status
subresource patch and comes back from a GET."""
from __future__ import annotations

from datetime import datetime, timezone

from kubernetes import client

from tests.factories import MINIMUM, with_
from tpuft.controller import observed, phases
from tpuft.api.constants import GROUP, PLURAL, VERSION, TrainingStatus, VerificationStatus
from tpuft.api.status import owned
from tpuft_workload.report import TRAINING_KEYS, VERIFICATION_KEYS, StatusReporter

# One value of the schema's type for each key.
TRAINING = {
    TrainingStatus.EPOCH: 2, TrainingStatus.EPOCHS: 3, TrainingStatus.STEP: 20, TrainingStatus.TOTAL_STEPS: 30,
    TrainingStatus.LOSS: 1.5, TrainingStatus.TOKENS_PER_SECOND: 100.5, TrainingStatus.PADDED_TOKENS_PER_SECOND: 120.5,
    TrainingStatus.STEP_TIME_SECONDS: 0.25, TrainingStatus.PAD_FRACTION: 0.125,
    TrainingStatus.LAST_CHECKPOINT: "/ckpt/run/checkpoint_step_0000020",
    TrainingStatus.RESUMED_FROM: "/ckpt/run/checkpoint_step_0000010", TrainingStatus.RESUMED_FROM_STEP: 10,
    TrainingStatus.MESSAGE: "resumed", TrainingStatus.EXPORTED_MODEL: "/ckpt/run/export",
    TrainingStatus.TRAINABLE_PARAMETERS: 524288, TrainingStatus.TOTAL_PARAMETERS: 10174976,
    TrainingStatus.MFU: 0.375,
    TrainingStatus.HISTORY: [{"step": 10, "loss": 2.5, "tokensPerSecond": 90.5},
                             {"step": 20, "loss": 1.5, "tokensPerSecond": 100.5, "evalLoss": 1.75}],
    TrainingStatus.UPDATED_AT: "2026-01-01T12:00:00Z",
    TrainingStatus.LEARNING_RATE: 1.5e-5, TrainingStatus.GLOBAL_BATCH_SIZE: 64, TrainingStatus.EPOCH_LOSS: 1.625,
    TrainingStatus.EVAL_LOSS: 1.75, TrainingStatus.EVAL_PERPLEXITY: 5.75, TrainingStatus.BEST_EVAL_LOSS: 1.5,
    TrainingStatus.BEST_STEP: 10, TrainingStatus.CHECKPOINT_REQUEST_SAVED: "2026-01-01T12:00:00Z",
    TrainingStatus.STORAGE_ERROR: "gs://bkt/run is not writable",
}
# status.recovery's pod watch, maintenance and elastic keys (a run that has lost a slice and trains on one).
RECOVERY = {"sliceReplacements": 1, "slicePods": ["uid-head", "uid-w0"], "checkpointRequestedAt": "2026-01-01T12:00:00Z",
            "lastMaintenance": {"time": "2026-01-01T11:00:00Z", "node": "n-1", "step": 9, "checkpointStep": 10,
                                "notice": "cloud.google.com/scheduled-maintenance-time=1767268800"},
            "elastic": {"slices": 1, "gradientAccumulationSteps": 2, "since": "2026-01-01T11:30:00Z"}}
VERIFICATION = {
    VerificationStatus.PASSED: True, VerificationStatus.RANKS: 16, VerificationStatus.HOSTS: 4,
    VerificationStatus.ALL_REDUCE_SUM: 136.0, VerificationStatus.EXPECTED_SUM: 136.0,
    VerificationStatus.MAX_ABS_DIFF: 2.5e-7, VerificationStatus.SECONDS: 4.25, VerificationStatus.MESSAGE: "ok",
    VerificationStatus.STORAGE_ERROR: "gs://bkt/run is not writable",
}


def test_every_status_key_survives_a_round_trip(kube_api, kubeconfig, namespace, monkeypatch):
    api = client.CustomObjectsApi(kube_api)
    name = "roundtrip"
    api.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, with_("metadata", {"name": name}))
    assert set(TRAINING) == set(TrainingStatus) and set(VERIFICATION) == set(VerificationStatus)

    # The workload's own client and patch, as in a RayJob.
    monkeypatch.setenv("KUBECONFIG", kubeconfig)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    reporter = StatusReporter(namespace, name)
    assert reporter.verification({k.value: v for k, v in VERIFICATION.items()})
    assert reporter.training(**{k.value: v for k, v in TRAINING.items()}), reporter.last_error

    # The operator's full status, ignoredSpecChange included: a spec edit after the run started.
    now = datetime(2026, 1, 1, 12, tzinfo=timezone.utc)
    obj = {**MINIMUM, "metadata": {"name": name, "namespace": namespace, "uid": "u", "generation": 1}}
    first = phases.decide(obj, observed.Observed(), now)
    obj = {**obj, "spec": {**obj["spec"], "image": "other:2"}, "metadata": {**obj["metadata"], "generation": 2},
           "status": first.status}
    decision = phases.decide(obj, observed.Observed(cluster=observed.ClusterObs(f"{name}-ray")), now)
    assert "ignoredSpecChange" in decision.status
    written = {**decision.status, "recovery": RECOVERY}
    api.patch_namespaced_custom_object_status(GROUP, VERSION, namespace, PLURAL, name, {"status": written},
                                              _content_type="application/merge-patch+json")

    status = api.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)["status"]
    assert status["training"] == {k.value: v for k, v in TRAINING.items()}
    assert set(status["training"]) == set(TRAINING_KEYS)
    assert status["verification"] == {k.value: v for k, v in VERIFICATION.items()}
    assert set(status["verification"]) == set(VERIFICATION_KEYS)
    assert owned(status) == written   # nothing the operator writes is pruned either
