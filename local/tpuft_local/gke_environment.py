"""LOCAL STAND-IN for what a GKE node gives every pod: Google's storage API and the metadata server
that Workload Identity's tokens come from. NOT part of the operator; never deploy it.

On GKE nothing is injected: a pod reaches storage.googleapis.com directly, and the node's
gke-metadata-server answers the metadata address with a token for the pod's Kubernetes service
account. Here GCS is fake-gcs-server and the metadata server is tpuft_local.gcs's stand-in, both on
the cluster's bridge; the Google C++ client inside pyarrow finds them only through its environment
(CLOUD_STORAGE_EMULATOR_ENDPOINT, GCE_METADATA_ROOT). So the local cluster adds those variables to
KubeRay's Ray pods at admission (a mutating webhook served by the TPU webhook stand-in's process),
and a TPUFinetune stays exactly what a GKE user writes: no spec field, no operator setting.

A container that already sets one of the variables keeps its own value (a user pointing at another
endpoint). `mutate_pod` is pure; `webhook_configuration` registers it.
"""
from __future__ import annotations

import base64
from typing import Mapping

MUTATE_PATH = "/mutate-gke-environment"
# Every pod KubeRay makes (RayCluster, RayJob's cluster, RayService's), not its submitter Jobs'.
RAY_POD_LABELS = {"app.kubernetes.io/created-by": "kuberay-operator"}
CONFIGURATION_NAME = "tpuft-local-gke-environment"


def mutate_pod(pod: dict, env: Mapping[str, str]) -> list[dict]:
    """JSONPatch adding `env` to every container and init container of `pod`, each variable only
    where that container does not set it already."""
    patch: list[dict] = []
    spec = pod.get("spec") or {}
    for kind in ("initContainers", "containers"):
        for index, container in enumerate(spec.get(kind) or []):
            present = {e.get("name") for e in container.get("env") or []}
            missing = [{"name": name, "value": value} for name, value in env.items() if name not in present]
            if not missing:
                continue
            if "env" not in container:
                patch.append({"op": "add", "path": f"/spec/{kind}/{index}/env", "value": missing})
            else:
                patch += [{"op": "add", "path": f"/spec/{kind}/{index}/env/-", "value": e} for e in missing]
    return patch


def parse_env(pairs: list[str]) -> dict[str, str]:
    """`--gke-env NAME=VALUE` arguments as a mapping (the value may contain '=')."""
    env = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name:
            raise ValueError(f"--gke-env {pair!r}: expected NAME=VALUE")
        env[name] = value
    return env


def webhook_configuration(base_url: str, ca_bundle: bytes, *, timeout_seconds: int = 5) -> dict:
    """The MutatingWebhookConfiguration for `mutate_pod` served at base_url + MUTATE_PATH."""
    return {
        "apiVersion": "admissionregistration.k8s.io/v1", "kind": "MutatingWebhookConfiguration",
        "metadata": {"name": CONFIGURATION_NAME},
        "webhooks": [{
            "name": "gke-environment.tpuft-local.dev", "admissionReviewVersions": ["v1"], "sideEffects": "None",
            # Fail: a Ray pod started without the variables would reach for Google's real hosts
            "failurePolicy": "Fail", "timeoutSeconds": timeout_seconds,
            "clientConfig": {"url": base_url.rstrip("/") + MUTATE_PATH, "caBundle": base64.b64encode(ca_bundle).decode()},
            "rules": [{"operations": ["CREATE"], "apiGroups": [""], "apiVersions": ["v1"], "resources": ["pods"],
                       "scope": "Namespaced"}],
            "namespaceSelector": {"matchExpressions": [{"key": "kubernetes.io/metadata.name", "operator": "NotIn",
                                                        "values": ["kube-system", "kube-node-lease"]}]},
            "objectSelector": {"matchLabels": dict(RAY_POD_LABELS)},
        }],
    }
