"""Objects and tables more than one test module builds on (test modules import these from here,
never from each other)."""
from __future__ import annotations

import copy

import yaml

# The minimum spec, as written.
MINIMUM = yaml.safe_load("""
apiVersion: tpufinetune.dev/v1alpha1
kind: TPUFinetune
metadata: {name: gemma4-dolly}
spec:
  accelerator: v6e
  topology: "4x4"
  slices: 1
  image: REGISTRY/ray-torchtpu:latest
  model: google/gemma-4-E2B-it
  dataset: {name: databricks/databricks-dolly-15k, split: "train[:1024]"}
  training: {epochs: 3, batchSizePerDevice: 4, maxSeqLength: 512, learningRate: 2.0e-5}
  checkpoint: {storagePath: "gs://my-bucket/ray_train_torchtpu"}
  hfTokenSecret: {name: hf-secret, key: hf_api_token}
  verification: {enabled: true, timeoutSeconds: 600}
  provisioningTimeoutSeconds: 1800
""")

DELETE = object()


def with_(path: str, value, base=MINIMUM):
    """A copy of base with the dotted path set (value DELETE removes it)."""
    doc = copy.deepcopy(base)
    keys = path.split(".")
    node = doc
    for k in keys[:-1]:
        node = node.setdefault(k, {})
    if value is DELETE:
        node.pop(keys[-1], None)
    else:
        node[keys[-1]] = value
    return doc


# Misspelt fields: (id, dotted path of the parent, the wrong key, its value, the name to suggest).
# The API server refuses each one under strict field validation (kubectl's default);
# `tpuft validate` must too, naming the same path.
UNKNOWN_FIELDS = [
    ("spec-trainng", "spec", "trainng", {"epochs": 1}, "training"),
    ("training-epoch", "spec.training", "epoch", 3, "epochs"),
    ("checkpoint-storagepath", "spec.checkpoint", "storagepath", "/ckpt", "storagePath"),
    ("verification-timeoutSecond", "spec.verification", "timeoutSecond", 60, "timeoutSeconds"),
    ("dataset-splits", "spec.dataset", "splits", "train", "split"),
    ("hfTokenSecret-keys", "spec.hfTokenSecret", "keys", "k", "key"),
    ("resources-head-request", "spec.resources.head", "request", {"cpu": "1"}, "requests"),
    ("resources-shmsize", "spec.resources", "shmsize", "1Gi", "shmSize"),
    ("scheduling-nodeselector", "spec.scheduling", "nodeselector", {"a": "b"}, "nodeSelector"),
    ("spec-suspended", "spec", "suspended", True, "suspend"),
    ("spec-ttl", "spec", "ttlSecondAfterFinished", 1, "ttlSecondsAfterFinished"),
    ("metadata-labells", "metadata", "labells", {"a": "b"}, "labels"),
]


def with_unknown(parent: str, key: str, value, base=MINIMUM) -> dict:
    """A copy of base with `key` added under the dotted `parent` (created when missing)."""
    doc = copy.deepcopy(base)
    node = doc
    for k in parent.split("."):
        node = node.setdefault(k, {})
    node[key] = value
    return doc
