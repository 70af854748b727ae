"""The real kube-apiserver enforces our CRD (crds/tpufinetune.yaml), and agrees with the parser.

- The issue's MINIMUM spec, every file in examples/ and a set of edge-but-valid specs (every
  generation x every offered topology, every accelerator spelling, int quantities, env valueFrom, ...)
  are accepted by a server-side create, and tpuft.api.spec.parse accepts what the server stored and
  derives the same Spec as from the local document (the server applies tpuft.api.spec.DEFAULTS exactly).
- INVALID: 273 invalid TPUFinetunes (test_table_counts checks these numbers and prints them).
  271 are rejected at admission (HTTP 422) with an error naming the field, and tpuft.api.spec.parse
  rejects each of them with the same field too (server and parser agree row by row).
  2 rows are PARSER-ONLY, marked PARSER_ONLY in the table: the CRD cannot express them because the
  API server refuses the request before schema validation (HTTP 400: a wrong apiVersion; metadata
  that cannot be decoded as ObjectMeta), so they never reach the operator and only tpuft.api.spec.parse
  (`tpuft validate`, `tpuft render`) names the field. Such a row must get a 400 from the server, so
  the marking stays honest.
- `kubectl get tft` printer columns (and -o wide), `kubectl explain`, the short name.
- Every `tpuft render` output of every example (RayCluster, RayJobs, ServiceAccount, Role,
  RoleBinding, NetworkPolicy) passes a server-side dry run against the installed KubeRay v1.7.0 CRDs, strictly
  (no field pruned or unknown).

Fast: one namespace for the module, table rows use dry_run=All through the Python client
(no kubectl process per row).
"""
from __future__ import annotations

import copy
import json
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import yaml
from kubernetes import client

from tests.factories import DELETE, MINIMUM, with_
from tests.waiting import wait_until
from tpuft.controller import builders
from tpuft.api import catalog, crd
from tpuft.api.constants import GROUP, PLURAL, VERSION
from tpuft.api.spec import DEFAULTS, SpecError, parse

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))
ADMISSION, PARSER_ONLY = "admission", "parser-only"


def doc_with(*updates, base=MINIMUM):
    """MINIMUM with several dotted paths set (DELETE removes)."""
    doc = copy.deepcopy(base)
    for path, value in updates:
        doc = with_(path, value, doc)
    return doc


def row(rid, updates, field, how=ADMISSION):
    if isinstance(updates, tuple) and len(updates) == 2 and isinstance(updates[0], str):
        updates = [updates]
    return pytest.param(doc_with(*updates), field, how, id=rid)


INJECTIONS = ["x; rm -rf /", "$(curl x)", "`id`", "x' || true", 'x" && curl y', "x | sh", "x && y", "x\nrm -rf /",
              "x > /etc/passwd", "x\\y"]

INVALID = [
    # --- accelerator ---
    row("accelerator-unknown-v9", ("spec.accelerator", "v9"), "spec.accelerator"),
    row("accelerator-unknown-v3", ("spec.accelerator", "tpu-v3"), "spec.accelerator"),
    row("accelerator-gpu", ("spec.accelerator", "nvidia-h100"), "spec.accelerator"),
    row("accelerator-empty", ("spec.accelerator", ""), "spec.accelerator"),
    row("accelerator-missing", ("spec.accelerator", DELETE), "spec.accelerator"),
    row("accelerator-int", ("spec.accelerator", 6), "spec.accelerator"),
    row("accelerator-injection", ("spec.accelerator", "v6e; rm -rf /"), "spec.accelerator"),
    # --- topology: every generation's wrong dimensionality and shapes not offered ---
    row("v6e-3d", ("spec.topology", "2x2x2"), "spec.topology"),
    row("v5e-3d", [("spec.accelerator", "v5e"), ("spec.topology", "2x2x1")], "spec.topology"),
    row("v6e-chip-count", ("spec.topology", "16"), "spec.topology"),
    row("v6e-not-offered-3x3", ("spec.topology", "3x3"), "spec.topology"),
    row("v6e-not-offered-32x32", ("spec.topology", "32x32"), "spec.topology"),
    row("v5e-not-offered-4x2", [("spec.accelerator", "v5e"), ("spec.topology", "4x2")], "spec.topology"),
    row("v4-2d", [("spec.accelerator", "v4"), ("spec.topology", "4x4")], "spec.topology"),
    row("v5p-2d", [("spec.accelerator", "v5p"), ("spec.topology", "4x4")], "spec.topology"),
    row("tpu7x-2d", [("spec.accelerator", "tpu7x"), ("spec.topology", "4x4")], "spec.topology"),
    row("v4-not-offered-3x3x3", [("spec.accelerator", "v4"), ("spec.topology", "3x3x3")], "spec.topology"),
    row("v5p-not-offered-2x2x3", [("spec.accelerator", "TPU-V5P"), ("spec.topology", "2x2x3")], "spec.topology"),
    row("tpu7x-v5p-only-shape", [("spec.accelerator", "tpu7x"), ("spec.topology", "16x16x24")], "spec.topology"),
    row("v4-v5p-only-shape", [("spec.accelerator", "v4"), ("spec.topology", "16x16x24")], "spec.topology"),
    row("v5p-v4-only-shape", [("spec.accelerator", "v5p"), ("spec.topology", "8x8x12")], "spec.topology"),
    row("tpu7x-4d", [("spec.accelerator", "ironwood"), ("spec.topology", "2x2x2x2")], "spec.topology"),
    row("topology-trailing-space", ("spec.topology", "4x4 "), "spec.topology"),
    row("topology-injection", ("spec.topology", "4x4;id"), "spec.topology"),
    row("topology-missing", ("spec.topology", DELETE), "spec.topology"),
    row("topology-int", ("spec.topology", 16), "spec.topology"),
    row("topology-empty", ("spec.topology", ""), "spec.topology"),
    row("topology-too-long", ("spec.topology", "9" * 17), "spec.topology"),
    row("cpu-zero-workers", [("spec.accelerator", "cpu"), ("spec.topology", "0")], "spec.topology"),
    row("cpu-65-workers", [("spec.accelerator", "cpu"), ("spec.topology", "65")], "spec.topology"),
    row("cpu-shape", [("spec.accelerator", "cpu"), ("spec.topology", "2x2")], "spec.topology"),
    row("cpu-negative", [("spec.accelerator", "cpu"), ("spec.topology", "-1")], "spec.topology"),
    # --- slices ---
    row("slices-0", ("spec.slices", 0), "spec.slices"),
    row("slices-10000", ("spec.slices", 10000), "spec.slices"),
    row("slices-negative", ("spec.slices", -1), "spec.slices"),
    row("slices-string", ("spec.slices", "2"), "spec.slices"),
    row("slices-bool", ("spec.slices", True), "spec.slices"),
    row("slices-fraction", ("spec.slices", 1.5), "spec.slices"),
    # --- image ---
    row("image-missing", ("spec.image", DELETE), "spec.image"),
    row("image-empty", ("spec.image", ""), "spec.image"),
    row("image-too-long", ("spec.image", "r/" + "x" * 511), "spec.image"),
    row("image-int", ("spec.image", 5), "spec.image"),
    row("pull-policy-unknown", ("spec.imagePullPolicy", "Sometimes"), "spec.imagePullPolicy"),
    # --- model ---
    row("model-missing", ("spec.model", DELETE), "spec.model"),
    row("model-empty", ("spec.model", ""), "spec.model"),
    row("model-int", ("spec.model", 42), "spec.model"),
    row("model-space", ("spec.model", "google/gemma 4"), "spec.model"),
    # --- dataset ---
    row("dataset-missing", ("spec.dataset", DELETE), "spec.dataset"),
    row("dataset-string", ("spec.dataset", "dolly"), "spec.dataset"),
    row("dataset-name-missing", ("spec.dataset.name", DELETE), "spec.dataset.name"),
    row("dataset-name-empty", ("spec.dataset.name", ""), "spec.dataset.name"),
    row("dataset-split-int", ("spec.dataset.split", 7), "spec.dataset.split"),
    # --- training: absurd sizes, wrong types ---
    row("epochs-0", ("spec.training.epochs", 0), "spec.training.epochs"),
    row("epochs-negative", ("spec.training.epochs", -1), "spec.training.epochs"),
    row("epochs-1001", ("spec.training.epochs", 1001), "spec.training.epochs"),
    row("epochs-fraction", ("spec.training.epochs", 1.5), "spec.training.epochs"),
    row("batch-0", ("spec.training.batchSizePerDevice", 0), "spec.training.batchSizePerDevice"),
    row("batch-huge", ("spec.training.batchSizePerDevice", 1_000_000), "spec.training.batchSizePerDevice"),
    row("seq-1e9", ("spec.training.maxSeqLength", 10 ** 9), "spec.training.maxSeqLength"),
    row("seq-8", ("spec.training.maxSeqLength", 8), "spec.training.maxSeqLength"),
    row("lr-0", ("spec.training.learningRate", 0), "spec.training.learningRate"),
    row("lr-1", ("spec.training.learningRate", 1), "spec.training.learningRate"),
    row("lr-negative", ("spec.training.learningRate", -1e-5), "spec.training.learningRate"),
    row("lr-string", ("spec.training.learningRate", "fast"), "spec.training.learningRate"),
    row("packing-string", ("spec.training.packing", "yes"), "spec.training.packing"),
    row("report-every-0", ("spec.training.reportEverySteps", 0), "spec.training.reportEverySteps"),
    row("max-failures-negative", ("spec.training.maxFailures", -1), "spec.training.maxFailures"),
    row("max-job-retries-99", ("spec.training.maxJobRetries", 99), "spec.training.maxJobRetries"),
    row("training-string", ("spec.training", "fast"), "spec.training"),
    # --- the recipe (spec.training) and evaluation (spec.evaluation) ---
    row("seed-negative", ("spec.training.seed", -1), "spec.training.seed"),
    row("schedule-unknown", ("spec.training.learningRateSchedule", "step"), "spec.training.learningRateSchedule"),
    row("warmup-steps-negative", ("spec.training.warmupSteps", -1), "spec.training.warmupSteps"),
    row("warmup-ratio-1", ("spec.training.warmupRatio", 1), "spec.training.warmupRatio"),
    row("warmup-both", ("spec.training", {"warmupSteps": 10, "warmupRatio": 0.1}), "spec.training.warmupRatio"),
    row("min-lr-ratio-2", ("spec.training.minLearningRateRatio", 2), "spec.training.minLearningRateRatio"),
    row("weight-decay-negative", ("spec.training.weightDecay", -0.1), "spec.training.weightDecay"),
    row("max-grad-norm-0", ("spec.training.maxGradNorm", 0), "spec.training.maxGradNorm"),
    row("accumulation-0", ("spec.training.gradientAccumulationSteps", 0), "spec.training.gradientAccumulationSteps"),
    row("max-steps-0", ("spec.training.maxSteps", 0), "spec.training.maxSteps"),
    row("activation-checkpointing-string", ("spec.training.activationCheckpointing", "on"),
        "spec.training.activationCheckpointing"),
    row("eval-empty", ("spec.evaluation", {}), "spec.evaluation.fraction"),
    row("eval-fraction-and-split", ("spec.evaluation", {"fraction": 0.1, "split": "test"}),
        "spec.evaluation.fraction"),
    row("eval-fraction-0", ("spec.evaluation", {"fraction": 0}), "spec.evaluation.fraction"),
    row("eval-fraction-0.6", ("spec.evaluation", {"fraction": 0.6}), "spec.evaluation.fraction"),
    row("eval-split-injection", ("spec.evaluation", {"split": "test;id"}), "spec.evaluation.split"),
    row("eval-every-0", ("spec.evaluation", {"fraction": 0.1, "everySteps": 0}), "spec.evaluation.everySteps"),
    row("eval-patience-0", ("spec.evaluation", {"fraction": 0.1, "earlyStoppingPatience": 0}),
        "spec.evaluation.earlyStoppingPatience"),
    row("eval-keep-best-string", ("spec.evaluation", {"fraction": 0.1, "keepBest": "yes"}),
        "spec.evaluation.keepBest"),
    # --- checkpoint: bad storagePath forms ---
    row("checkpoint-missing", ("spec.checkpoint", DELETE), "spec.checkpoint"),
    row("storage-missing", ("spec.checkpoint.storagePath", DELETE), "spec.checkpoint.storagePath"),
    row("storage-empty", ("spec.checkpoint.storagePath", ""), "spec.checkpoint.storagePath"),
    row("storage-bare-bucket", ("spec.checkpoint.storagePath", "my-bucket/path"), "spec.checkpoint.storagePath"),
    row("storage-gs-no-bucket", ("spec.checkpoint.storagePath", "gs://"), "spec.checkpoint.storagePath"),
    row("storage-gs-uppercase", ("spec.checkpoint.storagePath", "gs://My_Bucket/x"), "spec.checkpoint.storagePath"),
    row("storage-gs-short-bucket", ("spec.checkpoint.storagePath", "gs://b/x"), "spec.checkpoint.storagePath"),
    row("storage-s3-no-bucket", ("spec.checkpoint.storagePath", "s3:///x"), "spec.checkpoint.storagePath"),
    row("storage-s3", ("spec.checkpoint.storagePath", "s3://bucket/run"), "spec.checkpoint.storagePath"),
    row("resume-from-s3", ("spec.checkpoint.resumeFrom", "s3://bucket/run"), "spec.checkpoint.resumeFrom"),
    row("storage-gs-query", ("spec.checkpoint.storagePath", "gs://bucket/p?endpoint_override=http://127.0.0.1:4443"),
        "spec.checkpoint.storagePath"),
    row("storage-gs-fragment", ("spec.checkpoint.storagePath", "gs://bucket/p#2"), "spec.checkpoint.storagePath"),
    row("resume-from-gs-query", ("spec.checkpoint.resumeFrom", "gs://bucket/p?x=1"), "spec.checkpoint.resumeFrom"),
    row("model-gs-query", ("spec.model", "gs://bucket/m?x=1"), "spec.model"),
    row("dataset-gs-query", ("spec.dataset.name", "gs://bucket/d.jsonl?x=1"), "spec.dataset.name"),
    row("eval-gs-fragment", ("spec.evaluation", {"name": "gs://bucket/e.jsonl#a", "split": "train"}),
        "spec.evaluation.name"),
    # --- identity ---
    row("service-account-invalid", ("spec.serviceAccountName", "Team_KSA"), "spec.serviceAccountName"),
    row("service-account-annotation-key", ("spec.serviceAccountAnnotations", {"bad key!": "x"}),
        "spec.serviceAccountAnnotations"),
    row("service-account-and-annotations", [
        ("spec.serviceAccountName", "team-ksa"),
        ("spec.serviceAccountAnnotations", {"iam.gke.io/gcp-service-account": "a@p.iam.gserviceaccount.com"})],
        "spec.serviceAccountAnnotations"),
    row("storage-http", ("spec.checkpoint.storagePath", "https://example.com/ckpt"), "spec.checkpoint.storagePath"),
    row("storage-relative", ("spec.checkpoint.storagePath", "relative/dir"), "spec.checkpoint.storagePath"),
    row("resume-from-relative", ("spec.checkpoint.resumeFrom", "relative/run"), "spec.checkpoint.resumeFrom"),
    row("resume-from-http", ("spec.checkpoint.resumeFrom", "https://example.com/ckpt"), "spec.checkpoint.resumeFrom"),
    row("resume-from-empty", ("spec.checkpoint.resumeFrom", ""), "spec.checkpoint.resumeFrom"),
    row("storage-space", ("spec.checkpoint.storagePath", "/ckpt dir"), "spec.checkpoint.storagePath"),
    row("storage-newline", ("spec.checkpoint.storagePath", "/ckpt\n"), "spec.checkpoint.storagePath"),
    row("storage-injection", ("spec.checkpoint.storagePath", "/ckpt;rm -rf /"), "spec.checkpoint.storagePath"),
    row("every-steps-negative", ("spec.checkpoint.everySteps", -1), "spec.checkpoint.everySteps"),
    row("keep-0", ("spec.checkpoint.keep", 0), "spec.checkpoint.keep"),
    # --- hfTokenSecret ---
    row("hf-no-key", ("spec.hfTokenSecret", {"name": "hf"}), "spec.hfTokenSecret.key"),
    row("hf-no-name", ("spec.hfTokenSecret", {"key": "k"}), "spec.hfTokenSecret.name"),
    row("hf-empty-name", ("spec.hfTokenSecret", {"name": "", "key": "k"}), "spec.hfTokenSecret.name"),
    row("hf-string", ("spec.hfTokenSecret", "hf-secret"), "spec.hfTokenSecret"),
    row("hf-name-invalid", ("spec.hfTokenSecret", {"name": "HF_Secret", "key": "k"}), "spec.hfTokenSecret.name"),
    row("hf-key-invalid", ("spec.hfTokenSecret", {"name": "hf", "key": "hf token"}), "spec.hfTokenSecret.key"),
    # --- verification, timeouts, suspend ---
    row("verify-timeout-1", ("spec.verification.timeoutSeconds", 1), "spec.verification.timeoutSeconds"),
    row("verify-timeout-1e9", ("spec.verification.timeoutSeconds", 10 ** 9), "spec.verification.timeoutSeconds"),
    row("verify-enabled-string", ("spec.verification.enabled", "true"), "spec.verification.enabled"),
    row("provisioning-negative", ("spec.provisioningTimeoutSeconds", -5), "spec.provisioningTimeoutSeconds"),
    row("provisioning-1e8", ("spec.provisioningTimeoutSeconds", 10 ** 8), "spec.provisioningTimeoutSeconds"),
    row("replacements-negative", ("spec.recovery.maxSliceReplacements", -1), "spec.recovery.maxSliceReplacements"),
    row("replacements-21", ("spec.recovery.maxSliceReplacements", 21), "spec.recovery.maxSliceReplacements"),
    row("dataset-format-csv", ("spec.dataset.format", "csv"), "spec.dataset.format"),
    row("dataset-type-chat", ("spec.dataset.type", "chat"), "spec.dataset.type"),
    row("dataset-overlong-cut", ("spec.dataset.overlong", "cut"), "spec.dataset.overlong"),
    row("dataset-columns-unknown-key", ("spec.dataset.columns", {"question": "q"}), "spec.dataset.columns"),
    row("dataset-columns-shell", ("spec.dataset.columns", {"prompt": "q;rm"}), "spec.dataset.columns"),
    row("dataset-columns-list", ("spec.dataset.columns", ["prompt"]), "spec.dataset.columns"),
    row("replacements-string", ("spec.recovery.maxSliceReplacements", "two"), "spec.recovery.maxSliceReplacements"),
    row("ttl-negative", ("spec.ttlSecondsAfterFinished", -1), "spec.ttlSecondsAfterFinished"),
    row("suspend-string", ("spec.suspend", "no"), "spec.suspend"),
    # --- resources: google.com/tpu never overridable, quantities ---
    row("tpu-worker-limits", ("spec.resources", {"worker": {"limits": {"google.com/tpu": "8"}}}),
        "spec.resources.worker.limits"),
    row("tpu-worker-requests-int", ("spec.resources", {"worker": {"requests": {"google.com/tpu": 4}}}),
        "spec.resources.worker.requests"),
    row("tpu-head-limits", ("spec.resources", {"head": {"limits": {"google.com/tpu": "1"}}}),
        "spec.resources.head.limits"),
    row("quantity-word", ("spec.resources", {"head": {"requests": {"cpu": "lots"}}}), "spec.resources.head.requests.cpu"),
    row("quantity-space", ("spec.resources", {"worker": {"limits": {"memory": "16 GiB"}}}),
        "spec.resources.worker.limits.memory"),
    row("quantity-negative-int", ("spec.resources", {"worker": {"limits": {"cpu": -1}}}),
        "spec.resources.worker.limits.cpu"),
    row("resource-name-invalid", ("spec.resources", {"head": {"requests": {"my cpu": "1"}}}),
        "spec.resources.head.requests"),
    row("shm-word", ("spec.resources", {"shmSize": "big"}), "spec.resources.shmSize"),
    row("shm-int", ("spec.resources", {"shmSize": 100}), "spec.resources.shmSize"),
    # --- scheduling ---
    row("spot-and-reservation", ("spec.scheduling", {"spot": True, "reservation": "r1"}), "spec.scheduling"),
    row("spot-and-empty-reservation", ("spec.scheduling", {"spot": True, "reservation": ""}), "spec.scheduling"),
    row("spot-string", ("spec.scheduling", {"spot": "yes"}), "spec.scheduling.spot"),
    row("node-selector-int", ("spec.scheduling", {"nodeSelector": {"a": 1}}), "spec.scheduling.nodeSelector"),
    row("tolerations-string", ("spec.scheduling", {"tolerations": "all"}), "spec.scheduling.tolerations"),
    row("tolerations-items", ("spec.scheduling", {"tolerations": ["all"]}), "spec.scheduling.tolerations"),
    row("reservation-too-long", ("spec.scheduling", {"reservation": "r" * 254}), "spec.scheduling.reservation"),
    row("reservation-64-chars", ("spec.scheduling", {"reservation": "r" * 64}), "spec.scheduling.reservation"),
    row("reservation-space", ("spec.scheduling", {"reservation": "res 1"}), "spec.scheduling.reservation"),
    row("node-selector-value-space", ("spec.scheduling", {"nodeSelector": {"pool": "a b"}}),
        "spec.scheduling.nodeSelector"),
    row("node-selector-key-space", ("spec.scheduling", {"nodeSelector": {"my pool": "a"}}),
        "spec.scheduling.nodeSelector"),
    row("toleration-operator", ("spec.scheduling", {"tolerations": [{"key": "a", "operator": "Bogus"}]}),
        "spec.scheduling.tolerations[0].operator"),
    row("toleration-effect", ("spec.scheduling", {"tolerations": [{"key": "a", "effect": "NoWay"}]}),
        "spec.scheduling.tolerations[0].effect"),
    row("flex-start-and-spot", ("spec.scheduling", {"provisioning": "flexStart", "spot": True}), "spec.scheduling"),
    row("flex-start-and-reservation", ("spec.scheduling", {"provisioning": "flexStart", "reservation": "r1"}),
        "spec.scheduling"),
    row("provisioning-unknown", ("spec.scheduling", {"provisioning": "dws"}), "spec.scheduling.provisioning"),
    row("max-run-without-flex-start", ("spec.scheduling", {"maxRunDurationSeconds": 3600}), "spec.scheduling"),
    row("max-run-too-long", ("spec.scheduling", {"provisioning": "flexStart", "maxRunDurationSeconds": 604801}),
        "spec.scheduling.maxRunDurationSeconds"),
    row("topology-aware-string", ("spec.scheduling", {"topologyAware": "yes"}), "spec.scheduling.topologyAware"),
    row("priority-class-int", ("spec.scheduling", {"priorityClassName": 5}), "spec.scheduling.priorityClassName"),
    row("priority-class-invalid", ("spec.scheduling", {"priorityClassName": "High_Prio"}),
        "spec.scheduling.priorityClassName"),
    # --- labels, annotations, env ---
    row("labels-list", ("spec.labels", ["a"]), "spec.labels"),
    row("labels-int-value", ("spec.labels", {"a": 1}), "spec.labels"),
    row("labels-value-too-long", ("spec.labels", {"team": "x" * 64}), "spec.labels"),
    row("labels-value-space", ("spec.labels", {"team": "ml ops"}), "spec.labels"),
    row("labels-key-space", ("spec.labels", {"my team": "ml"}), "spec.labels"),
    row("labels-key-name-64", ("spec.labels", {"example.com/" + "n" * 64: "ml"}), "spec.labels"),
    row("labels-too-many", ("spec.labels", {f"l{i}": "v" for i in range(65)}), "spec.labels"),
    row("annotations-string", ("spec.annotations", "x"), "spec.annotations"),
    row("annotations-key-two-slashes", ("spec.annotations", {"a/b/c": "x"}), "spec.annotations"),
    row("annotations-key-injection", ("spec.annotations", {"$(curl x)": "x"}), "spec.annotations"),
    # reserved keys (tpuft.api.constants.RESERVED_LABELS / RESERVED_ANNOTATIONS: the CEL rule and the parser)
    row("labels-reserved-ours", ("spec.labels", {"tpufinetune.dev/name": "spoof"}), "spec.labels"),
    row("labels-reserved-ray-prefix", ("spec.labels", {"ray.io/node-type": "head"}), "spec.labels"),
    row("labels-reserved-kuberay-name", ("spec.labels", {"team": "ml", "app.kubernetes.io/name": "x"}), "spec.labels"),
    row("labels-reserved-tpu-webhook", ("spec.labels", {"replicaIndex": "g-0"}), "spec.labels"),
    row("annotations-reserved-ray-prefix", ("spec.annotations", {"ray.io/overwrite-container-cmd": "true"}),
        "spec.annotations"),
    row("annotations-reserved-slice-topology", ("spec.annotations", {"cloud.google.com/gke-tpu-slice-topology": "2x2"}),
        "spec.annotations"),
    row("env-string", ("spec.env", "A=1"), "spec.env"),
    row("env-bad-name", ("spec.env", [{"name": "1BAD"}]), "spec.env[0].name"),
    row("env-injection-name", ("spec.env", [{"name": "A;rm", "value": "1"}]), "spec.env[0].name"),
    row("env-no-name", ("spec.env", [{"value": "1"}]), "spec.env[0].name"),
    row("env-value-and-value-from", ("spec.env", [{"name": "A", "value": "1", "valueFrom": {}}]), "spec.env[0]"),
    row("env-int-value", ("spec.env", [{"name": "A", "value": 1}]), "spec.env[0].value"),
    row("env-value-from-empty", ("spec.env", [{"name": "A", "valueFrom": {}}]), "spec.env[0].valueFrom"),
    row("env-value-from-unknown", ("spec.env", [{"name": "A", "valueFrom": {"shellRef": {"cmd": "id"}}}]),
        "spec.env[0].valueFrom"),
    row("env-value-from-two-sources", ("spec.env", [{"name": "A", "valueFrom": {
        "secretKeyRef": {"name": "s", "key": "k"}, "configMapKeyRef": {"name": "c", "key": "k"}}}]),
        "spec.env[0].valueFrom"),
    # --- serve ---
    row("serve-vllm-no-image", ("spec.serve", {"enabled": True}), "spec.serve.image"),
    row("serve-engine-unknown", ("spec.serve", {"enabled": True, "engine": "tgi"}), "spec.serve.engine"),
    row("serve-topology-not-v6e", ("spec.serve", {"enabled": True, "image": "v:1", "topology": "3x3"}),
        "spec.serve.topology"),
    row("serve-accelerator-3d-on-2d-topology", ("spec.serve", {"enabled": True, "image": "v:1", "accelerator": "tpu7x"}),
        "spec.serve.topology"),
    row("serve-replicas-zero", ("spec.serve", {"enabled": True, "image": "v:1", "replicas": 0}), "spec.serve.replicas"),
    row("serve-replicas-min-zero", ("spec.serve", {"enabled": True, "image": "v:1", "replicas": {"min": 0, "max": 2}}),
        "spec.serve.replicas"),
    row("serve-timeout-short", ("spec.serve", {"timeoutSeconds": 5}), "spec.serve.timeoutSeconds"),
    row("serve-max-len-short", ("spec.serve", {"enabled": True, "image": "v:1", "maxModelLength": 8}),
        "spec.serve.maxModelLength"),
    row("serve-api-key-secret-no-name", ("spec.serve", {"enabled": True, "image": "v:1", "apiKeySecret": {"key": "k"}}),
        "spec.serve.apiKeySecret.name"),
    row("serve-api-key-secret-bad-key", ("spec.serve", {"enabled": True, "image": "v:1",
                                                        "apiKeySecret": {"name": "s", "key": "a/b"}}),
        "spec.serve.apiKeySecret.key"),
    row("serve-tpu-override", ("spec.serve", {"enabled": True, "image": "v:1",
                                              "resources": {"worker": {"limits": {"google.com/tpu": "4"}}}}),
        "spec.serve.resources.worker.limits"),
    # --- metadata: names too long for derived child names ---
    row("name-41-chars", ("metadata.name", "x" * 41), "metadata.name"),
    row("name-63-chars", ("metadata.name", "a" * 63), "metadata.name"),
    row("name-uppercase", ("metadata.name", "Bad_Name"), "metadata.name"),
    row("name-dotted", ("metadata.name", "a.b"), "metadata.name"),
    row("name-missing", ("metadata.name", DELETE), "metadata.name"),
    row("kind-mismatch", ("kind", "RayJob"), "kind"),
    row("spec-missing", ("spec", DELETE), "spec"),
    row("spec-string", ("spec", "x"), "spec"),
    # --- LoRA (spec.training.method, spec.training.lora, spec.export.merge) ---
    row("method-unknown", ("spec.training.method", "qlora"), "spec.training.method"),
    row("lora-with-method-full", ("spec.training.lora", {"rank": 8}), "spec.training.lora"),
    row("lora-rank-not-power-of-two", ("spec.training", {"method": "lora", "lora": {"rank": 12}}),
        "spec.training.lora.rank"),
    row("lora-dropout-1", ("spec.training", {"method": "lora", "lora": {"dropout": 1}}), "spec.training.lora.dropout"),
    row("lora-alpha-0", ("spec.training", {"method": "lora", "lora": {"alpha": 0}}), "spec.training.lora.alpha"),
    row("lora-target-dotted", ("spec.training", {"method": "lora", "lora": {"targetModules": ["a.q_proj"]}}),
        "spec.training.lora.targetModules"),
    row("lora-target-twice", ("spec.training", {"method": "lora", "lora": {"targetModules": ["q_proj", "q_proj"]}}),
        "spec.training.lora.targetModules"),
    row("export-merge-without-lora", ("spec.export.merge", True), "spec.export.merge"),
    # --- adapters on a shared base (training.method none, spec.serve.adapters, spec.publish) ---
    row("publish-without-lora", ("spec.publish", {"to": "base", "when": "always"}), "spec.publish"),
    row("publish-to-missing", [("spec.training.method", "lora"), ("spec.publish", {"when": "always"})],
        "spec.publish.to"),
    row("publish-as-not-a-label", [("spec.training.method", "lora"),
                                   ("spec.publish", {"to": "base", "as": "Chat_1", "when": "always"})],
        "spec.publish.as"),
    row("publish-when-unknown", [("spec.training.method", "lora"), ("spec.publish", {"to": "base", "when": "never"})],
        "spec.publish.when"),
    row("publish-margin-negative", [("spec.training.method", "lora"),
                                    ("spec.publish", {"to": "base", "when": "always", "margin": -0.5})],
        "spec.publish.margin"),
    row("adapters-on-lora", [("spec.training.method", "lora"),
                             ("spec.serve", {"enabled": True, "image": "v:1", "adapters": {}})], "spec.serve.adapters"),
    row("adapters-max-per-replica-65", ("spec.serve", {"enabled": True, "image": "v:1",
                                                       "adapters": {"maxPerReplica": 65}}),
        "spec.serve.adapters.maxPerReplica"),
    row("adapters-max-rank-48", ("spec.serve", {"enabled": True, "image": "v:1", "adapters": {"maxRank": 48}}),
        "spec.serve.adapters.maxRank"),
    row("method-none-without-serve", [("spec.training.method", "none"), ("spec.dataset", DELETE)], "spec.serve"),
    row("method-none-with-evaluation", [("spec.training.method", "none"), ("spec.dataset", DELETE),
                                        ("spec.serve", {"enabled": True, "image": "v:1"}),
                                        ("spec.evaluation", {"fraction": 0.1})], "spec.evaluation"),
    # --- parser-only: the server refuses these before schema validation (HTTP 400) ---
    row("api-version-v1", ("apiVersion", "tpufinetune.dev/v1"), "apiVersion", PARSER_ONLY),
    row("metadata-list", ("metadata", ["gemma4-dolly"]), "metadata", PARSER_ONLY),
] + [
    # --- injection-looking strings in model, dataset and image ---
    row(f"injection-{where.split('.')[-1]}-{i}", (where, s), where)
    for where in ("spec.model", "spec.dataset.name", "spec.image", "spec.dataset.split")
    for i, s in enumerate(INJECTIONS)
]

COUNTS = {
    "total": len(INVALID),
    "admission": sum(1 for p in INVALID if p.values[2] == ADMISSION),
    "parser_only": sum(1 for p in INVALID if p.values[2] == PARSER_ONLY),
}
DOCUMENTED_COUNTS = {"total": 273, "admission": 271, "parser_only": 2}  # as the module docstring says


# --- helpers ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ns(kubectl):
    """One namespace for the whole module: table rows are dry runs, valid objects get unique names."""
    name = f"crd-{uuid.uuid4().hex[:6]}"
    kubectl("create", "namespace", name, check=True)
    yield name
    kubectl("delete", "namespace", name, "--wait=false", "--ignore-not-found")


@pytest.fixture(scope="module")
def objects(kube_api):
    return client.CustomObjectsApi(kube_api)


def create(objects, ns, doc, dry_run=False):
    return objects.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, doc,
                                                   dry_run="All" if dry_run else None)


def rejection(objects, ns, doc) -> tuple[int, list[tuple[str, str]], str] | None:
    """None if the server accepts `doc` (dry run); else (HTTP status, [(field, message)], message)."""
    try:
        create(objects, ns, doc, dry_run=True)
        return None
    except client.ApiException as e:
        try:
            body = json.loads(e.body)
        except (TypeError, ValueError):
            return e.status, [], str(e.body)
        causes = [(c.get("field") or "", c.get("message") or "") for c in (body.get("details") or {}).get("causes") or []]
        return e.status, causes, body.get("message", "")


def names_field(reported: str, field: str) -> bool:
    """`reported` is the field or a path inside it (spec.resources.worker.limits.google.com/tpu, spec.env[0].name)."""
    return reported == field or reported.startswith(field + ".") or reported.startswith(field + "[")


def parser_problems(doc) -> list:
    with pytest.raises(SpecError) as err:
        parse(doc)
    return err.value.problems


def parser_fields(doc) -> list[str]:
    return [p.field for p in parser_problems(doc)]


# How the API server's schema validation begins its messages (tpuft.api.fields.check words them so).
SERVER_WORDED = ("Invalid value: ", "Unsupported value: ", "Required value", "Too long: ")


def deep_get(obj, dotted):
    for k in dotted.split("."):
        obj = obj[k]
    return obj


# --- valid objects: accepted, defaulted as DEFAULTS says, parsed the same --------------------------

def _spec_equal_modulo_defaults(local_doc, stored_obj):
    """The Spec parsed from the stored object (server defaults) equals the one parsed locally (parser
    defaults): both read DEFAULTS, so the operator and `tpuft render` build the same children."""
    assert parse(stored_obj).spec == parse(local_doc).spec


def test_minimum_spec_is_accepted_and_parses_the_same(objects, ns):
    doc = with_("metadata.name", f"minimum-{uuid.uuid4().hex[:5]}")
    stored = create(objects, ns, doc)
    assert stored["spec"]["topology"] == "4x4" and stored["metadata"]["uid"]
    _spec_equal_modulo_defaults(doc, stored)


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_every_example_is_accepted_and_parses_the_same(objects, ns, path):
    for doc in yaml.safe_load_all(path.read_text()):   # one TPUFinetune, or a base and its fine-tunes
        stored = create(objects, ns, doc)
        assert stored["metadata"]["name"] == doc["metadata"]["name"]
        _spec_equal_modulo_defaults(doc, stored)
        objects.delete_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, doc["metadata"]["name"])


def test_the_server_applies_exactly_the_documented_defaults(objects, ns):
    bare = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "TPUFinetune", "metadata": {"name": "bare"},
            "spec": {"accelerator": "tpu7x", "topology": "2x2x2", "image": "i", "model": "m",
                     "dataset": {"name": "d"}, "checkpoint": {"storagePath": "/ckpt"}}}
    stored = create(objects, ns, bare)
    got = {key: deep_get(stored["spec"], key) for key in DEFAULTS}
    assert got == DEFAULTS
    # Nothing else was invented: every spec leaf is one we sent or a documented default.
    leaves = set()

    def walk(node, prefix=""):
        for k, v in node.items():
            if isinstance(v, dict) and v:
                walk(v, f"{prefix}{k}.")
            else:
                leaves.add(f"{prefix}{k}")
    walk(stored["spec"])
    sent = {"accelerator", "topology", "image", "model", "dataset.name", "checkpoint.storagePath"}
    assert leaves == sent | set(DEFAULTS)
    _spec_equal_modulo_defaults(bare, stored)


EDGE_VALID = [
    pytest.param(doc_with(("spec.accelerator", a), ("spec.topology", t)), id=f"{a}-{t}")
    for g in catalog.GENERATIONS for a in (g.name,) for t in g.topologies
] + [
    pytest.param(doc_with(("spec.accelerator", s), ("spec.topology", g.topologies[0])), id=f"spelling-{s}")
    for g in catalog.GENERATIONS
    for s in sorted({g.ray_accelerator_type, g.ray_version, g.gke_accelerator, *g.aliases})
] + [
    pytest.param(doc_with(("spec.accelerator", "cpu"), ("spec.topology", n)), id=f"cpu-{n}") for n in ("1", "64")
] + [
    pytest.param(doc_with(*u), id=i) for i, u in [
        ("name-40-chars", [("metadata.name", "a" * 40)]),
        ("slices-64", [("spec.slices", 64)]),
        ("lr-tiny", [("spec.training.learningRate", 1e-30)]),
        ("recipe-every-field", [("spec.training", {
            "learningRateSchedule": "cosine", "warmupRatio": 0.05, "minLearningRateRatio": 0.1, "weightDecay": 0.1,
            "maxGradNorm": 0.5, "gradientAccumulationSteps": 8, "maxSteps": 1000, "activationCheckpointing": False,
            "seed": 7})]),
        ("eval-held-out", [("spec.evaluation", {"fraction": 0.05, "everySteps": 50, "earlyStoppingPatience": 3,
                                                "keepBest": True})]),
        ("eval-own-split", [("spec.evaluation", {"name": "gs://bucket/eval.jsonl", "split": "train[:200]"})]),
        ("seq-131072", [("spec.training.maxSeqLength", 131072)]),
        ("service-account", [("spec.serviceAccountName", "team-ksa")]),
        ("service-account-annotations", [("spec.serviceAccountAnnotations",
                                          {"iam.gke.io/gcp-service-account": "a@p.iam.gserviceaccount.com"})]),
        ("dataset-gs-no-query", [("spec.dataset.name", "gs://bucket/d.jsonl")]),
        ("storage-local", [("spec.checkpoint.storagePath", "/mnt/ckpt/run-1")]),
        ("storage-gs-bucket-only", [("spec.checkpoint.storagePath", "gs://my.bucket_1")]),
        ("int-and-string-quantities", [("spec.resources", {
            "head": {"requests": {"cpu": 8, "memory": "16Gi"}, "limits": {"cpu": "8500m"}},
            "worker": {"limits": {"memory": "200Gi", "ephemeral-storage": "1Ti"}}, "shmSize": "64Gi"})]),
        ("env-value-and-secret-ref", [("spec.env", [
            {"name": "A", "value": "1"}, {"name": "B", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}},
            {"name": "C.d-e_f", "value": ""}])]),
        ("reservation-without-spot", [("spec.scheduling", {"spot": False, "reservation": "res-1",
                                                           "tolerations": [{"key": "a", "operator": "Exists"}],
                                                           "nodeSelector": {"pool": "a"},
                                                           "priorityClassName": "high"})]),
        ("spot", [("spec.scheduling", {"spot": True})]),
        ("no-verification-suspended", [("spec.verification", {"enabled": False}), ("spec.suspend", True)]),
        ("labels-annotations", [("spec.labels", {"team": "ml"}), ("spec.annotations", {"note": "hi there"})]),
        ("qualified-keys-and-label-values", [
            ("spec.labels", {"app.kubernetes.io/part-of": "fine-tuning", "example.com/team": "", "k": "V_1.a-b"}),
            ("spec.annotations", {"example.com/" + "n" * 63: "any text; even $(this)", "a": ""}),
            ("spec.scheduling", {"nodeSelector": {"cloud.google.com/gke-nodepool": "pool-1"},
                                 "reservation": "r" * 63,
                                 "tolerations": [{"key": "google.com/tpu", "operator": "Exists", "effect": "NoSchedule"},
                                                 {"key": "k", "operator": "Equal", "value": "v", "effect": "NoExecute",
                                                  "tolerationSeconds": 30}, {"operator": "Exists"}]})]),
        ("64-labels", [("spec.labels", {f"l{i}": "v" for i in range(64)})]),
        ("env-sources-and-secret-names", [
            ("spec.hfTokenSecret", {"name": "hf.secret-1", "key": "HF_TOKEN.v2"}),
            ("spec.env", [{"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                          {"name": "CM", "valueFrom": {"configMapKeyRef": {"name": "c", "key": "k"}}},
                          {"name": "MEM", "valueFrom": {"resourceFieldRef": {"resource": "limits.memory"}}}])]),
        ("split-slice-syntax", [("spec.dataset.split", "train[10%:20%]+validation")]),
        ("dataset-record-layout", [("spec.dataset", {"name": "gs://b/qa.jsonl", "type": "promptCompletion",
                                                     "columns": {"prompt": "question", "completion": "answer"},
                                                     "overlong": "drop"})]),
        ("serve-vllm-other-shape", [("spec.serve", {"enabled": True, "image": "vllm-tpu:1", "topology": "2x4",
                                                    "replicas": 2, "maxModelLength": 4096, "timeoutSeconds": 900})]),
        ("serve-tpu7x-from-v6e", [("spec.serve", {"enabled": True, "image": "v:1", "accelerator": "tpu7x",
                                                  "topology": "2x2x2"})]),
        ("serve-transformers-training-image", [("spec.serve", {"enabled": True, "engine": "transformers"})]),
        ("serve-replicas-autoscaled", [("spec.serve", {"enabled": True, "image": "v:1", "replicas": {"min": 1, "max": 3}})]),
        ("serve-disabled-no-image", [("spec.serve", {"enabled": False})]),
        ("lora-defaults", [("spec.training", {"method": "lora"})]),
        ("lora-all-fields-merged", [("spec.training", {"method": "lora", "lora": {
            "rank": 1024, "alpha": 8192, "dropout": 0, "targetModules": ["q_proj", "v_proj"]}}),
            ("spec.export", {"merge": True})]),
    ]
]


def test_edge_valid_specs_are_accepted_by_server_and_parser(objects, ns):
    """One test over ~80 dry runs: the server and the parser agree on what is valid."""
    disagreements = []
    for p in EDGE_VALID:
        doc, rid = p.values[0], p.id
        try:
            tft = parse(doc)
            builders.build_children(tft)
        except SpecError as e:
            disagreements.append(f"{rid}: parser rejects: {e}")
            continue
        rej = rejection(objects, ns, doc)
        if rej is not None:
            disagreements.append(f"{rid}: server rejects ({rej[0]}): {rej[2]}")
            continue
        _spec_equal_modulo_defaults(doc, create(objects, ns, doc, dry_run=True))
    assert not disagreements, "\n".join(disagreements)
    assert len(EDGE_VALID) >= 60


# --- the invalid table ---------------------------------------------------------------------------

def test_table_counts():
    print(f"\nINVALID table: {COUNTS['total']} rows: {COUNTS['admission']} rejected at admission (HTTP 422, "
          f"field named), {COUNTS['parser_only']} parser-only", file=sys.stderr)
    assert COUNTS == DOCUMENTED_COUNTS, "update the module docstring and DOCUMENTED_COUNTS"
    assert COUNTS["total"] >= 60 and COUNTS["admission"] >= 60
    ids = [p.id for p in INVALID]
    assert len(ids) == len(set(ids))


@pytest.mark.parametrize("doc,field,how", INVALID)
def test_invalid_spec_is_rejected_naming_the_field(objects, ns, doc, field, how):
    fields = parser_fields(doc)
    assert any(names_field(f, field) for f in fields), f"parser did not name {field}: {fields}"
    rej = rejection(objects, ns, doc)
    if how == ADMISSION:
        assert rej is not None, f"the API server ACCEPTED an invalid TPUFinetune ({field})"
        status, causes, message = rej
        assert status == 422, (status, message)
        reported = [f for f, _ in causes]
        assert any(names_field(f, field) for f in reported), f"422 does not name {field}: {message}"
        # A declared field's own check is worded as the server words it, word for word.
        for problem in parser_problems(doc):
            if problem.message.startswith(SERVER_WORDED):
                assert problem.message in [m for f, m in causes if f == problem.field], (problem, causes)
    else:
        # Parser-only: the server refuses it before schema validation, never with a field error.
        assert rej is not None and rej[0] == 400, rej


# --- kubectl: printer columns, explain, short name ------------------------------------------------



def test_kubectl_get_printer_columns_and_short_name(objects, ns, kubectl):
    name = f"cols-{uuid.uuid4().hex[:5]}"
    create(objects, ns, with_("metadata.name", name))
    status = {"status": {"phase": "Serving", "reason": "Serving", "slice": {"hosts": 4, "devices": 16},
                         "training": {"epoch": 2, "loss": 1.25, "evalLoss": 1.5, "tokensPerSecond": 1234.5,
                                      "mfu": 0.5},
                         "goodput": {"ratio": 0.75}, "adapters": {"count": 3},
                         "serving": {"url": "http://x-serve-serve-svc.ns.svc:8000"}}}
    kubectl("patch", "tft", name, "-n", ns, "--subresource=status", "--type=merge", "-p", json.dumps(status),
            check=True)
    out = kubectl("get", "tft", name, "-n", ns, check=True).stdout.splitlines()
    assert out[0].split() == ["NAME", "PHASE", "ACCELERATOR", "TOPOLOGY", "LOSS", "ADAPTERS", "AGE"], out
    assert out[1].split()[:6] == [name, "Serving", "v6e", "4x4", "1.25", "3"], out
    wide = kubectl("get", "tft", name, "-n", ns, "-o", "wide", check=True).stdout.splitlines()
    assert wide[0].split() == ["NAME", "PHASE", "ACCELERATOR", "TOPOLOGY", "LOSS", "EVAL-LOSS", "EPOCH", "TOKENS/S",
                               "FRAMEWORK", "HOSTS", "DEVICES", "REASON", "ENDPOINT", "MFU", "GOODPUT", "ADAPTERS",
                               "AGE"], wide
    assert wide[1].split()[:16] == [name, "Serving", "v6e", "4x4", "1.25", "1.5", "2", "1234.5", "torch", "4", "16",
                                    "Serving", "http://x-serve-serve-svc.ns.svc:8000", "0.5", "0.75", "3"]
    # Plural, singular, short name and kind all resolve to the same object.
    for resource in ("tpufinetunes", "tpufinetune", "tft", "TPUFinetune", f"tpufinetunes.{GROUP}"):
        res = kubectl("get", resource, name, "-n", ns, "-o", "name", check=True)
        assert res.stdout.strip() == f"tpufinetune.{GROUP}/{name}", resource


def test_kubectl_explain_prints_the_field_descriptions(kubectl):
    def explain():
        res = kubectl("explain", "tpufinetune.spec.topology")
        return res if res.returncode == 0 else None
    res = wait_until(explain, interval=0.5, what="kubectl explain (the CRD's OpenAPI is published)")
    text = " ".join(res.stdout.split())
    assert "FIELD: topology <string>" in text
    description = crd.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"][
        "properties"]["topology"]["description"]
    assert " ".join(description.split()) in text and "2x2x2" in text
    spec = " ".join(kubectl("explain", "tft.spec", check=True).stdout.split())
    assert "accelerator <string> -required-" in spec and "checkpoint <Object> -required-" in spec


# --- tpuft render output passes server-side dry runs against KubeRay's CRDs ------------------------

@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_rendered_children_pass_a_server_side_dry_run(kubectl, ns, path):
    rendered = subprocess.run([str(Path(sys.executable).parent / "tpuft"), "render", str(path), "-n", ns],
                              capture_output=True, text=True, timeout=60)
    assert rendered.returncode == 0, rendered.stderr
    docs = [d for d in yaml.safe_load_all(rendered.stdout) if d]
    # spec.serviceAccountName: the user's account, bound but never created
    own = set() if any("serviceAccountName" in d["spec"] for d in yaml.safe_load_all(path.read_text())) \
        else {"ServiceAccount"}
    assert {d["kind"] for d in docs} >= {"RayCluster", "RayJob", "Role", "RoleBinding", "NetworkPolicy", *own}
    assert all(d["metadata"]["namespace"] == ns for d in docs)
    res = kubectl("apply", "--dry-run=server", "--validate=strict", "-o", "json", "-f", "-", input=rendered.stdout)
    assert res.returncode == 0, res.stderr
    assert "unknown field" not in res.stderr.lower(), res.stderr
    applied = json.loads(res.stdout)
    items = applied.get("items", [applied])
    assert [(i["kind"], i["metadata"]["name"]) for i in items] == [(d["kind"], d["metadata"]["name"]) for d in docs]
    # Nothing was pruned: what we sent comes back (the server only adds defaults).
    for sent, got in zip(docs, items):
        _assert_subset(sent["spec"] if "spec" in sent else {k: v for k, v in sent.items() if k in ("rules", "roleRef",
                                                                                                    "subjects")},
                       got["spec"] if "spec" in got else got, f"{sent['kind']}/{sent['metadata']['name']}")


def _assert_subset(sent, got, where):
    if isinstance(sent, dict):
        assert isinstance(got, dict), where
        for k, v in sent.items():
            assert k in got, f"{where}.{k} was pruned by the server"
            _assert_subset(v, got[k], f"{where}.{k}")
    elif isinstance(sent, list):
        assert isinstance(got, list) and len(got) == len(sent), where
        for i, (a, b) in enumerate(zip(sent, got)):
            _assert_subset(a, b, f"{where}[{i}]")
    else:
        assert sent == got or str(sent) == str(got), f"{where}: sent {sent!r}, got {got!r}"


def test_children_of_every_edge_valid_spec_pass_server_dry_runs_down_to_the_pods(kubectl, ns):
    """What the server accepts as a TPUFinetune must also give children the server accepts: the
    RayCluster, RayJobs and RBAC objects (strict dry run against the KubeRay CRDs) and the Pods
    KubeRay will make from the head and worker templates (a Pod dry run also checks labels, node
    selectors, env and resources, which the RayCluster CRD leaves unchecked)."""
    children, pods, accounts = [], [], set()
    for p in EDGE_VALID:
        doc = copy.deepcopy(p.values[0])
        doc["metadata"]["namespace"] = ns
        tft = parse(doc)
        kids = builders.build_children(tft)
        children += kids
        accounts.add(builders.service_account(tft))   # the operator's, or spec.serviceAccountName (the user's)
        rc = kids[0]
        for group in [rc["spec"]["headGroupSpec"], *rc["spec"]["workerGroupSpecs"]]:
            template = copy.deepcopy(group["template"])
            template["metadata"]["generateName"] = f"{rc['metadata']['name']}-"
            pods.append({"apiVersion": "v1", "kind": "Pod", "metadata": template["metadata"], "spec": template["spec"]})
    for sa in sorted(accounts):  # the ServiceAccount admission plugin needs the pods' account to exist
        kubectl("create", "serviceaccount", sa, "-n", ns)
    kubectl("create", "priorityclass", "high", "--value=1000")  # used by an EDGE_VALID spec; may exist
    def unique(items):  # accelerator spellings give identical children: send each object once
        return list({json.dumps(i, sort_keys=True): i for i in items}.values())
    children, pods = unique(children), unique(pods)
    for what, verb, items in (("children", "apply", children), ("pods", "create", pods)):
        listing = json.dumps({"apiVersion": "v1", "kind": "List", "items": items})
        res = kubectl(verb, "--dry-run=server", "--validate=strict", "-n", ns, "-o", "name", "-f", "-",
                      input=listing, timeout=300)
        assert res.returncode == 0, f"{what}: {res.stderr[-3000:]}"
        assert len(res.stdout.split()) == len(items), (what, res.stdout)
