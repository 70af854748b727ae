"""Kubernetes API I/O for the reconciler (synchronous kubernetes client; tpuft.controller.reconciler runs it in
a worker thread). Every error names the verb, kind and namespace/name it was about.

Verbs used (and nothing else; see charts/.../_rbac-rules.tpl): tpufinetunes status patch (kopf lists/watches);
rayclusters/rayjobs get, create, patch, delete; rayservices get, create, delete (spec.serve); serviceaccounts, roles, rolebindings get,
create; networkpolicies get, create (the run's ingress policy; get only to adopt ours on a 409); events create; pods list (a RayCluster's, while its slice comes up and after a job failed or a host was lost: a worker killed for memory); nodes list
(optional, cluster-wide installs: node pool hints for an unschedulable slice); Kueue workloads list (by
job-uid label, a queued RayCluster's). The operator never reads Secrets.
"""
from __future__ import annotations

import json
import logging
import os
import uuid
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Mapping

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from tpuft.api import constants as c
from tpuft.api import gke
from tpuft.api import kuberay
from tpuft.api import kueue
from tpuft.controller.diagnosis import PodObs
from tpuft.controller.observed import CHILD_KINDS, Action, Event, Op, QueueObs

log = logging.getLogger("tpuft.controller.kube")
MERGE_PATCH = "application/merge-patch+json"
RBAC_GROUP, RBAC_VERSION = "rbac.authorization.k8s.io", "v1"
REJECTED_STATUSES = {400, 403, 422}  # the API server or an admission webhook said no: retrying will not help

# kind -> (group, version, plural) for the objects reached through CustomObjectsApi
CUSTOM = {
    c.KIND: (c.GROUP, c.VERSION, c.PLURAL),
    **{k.kind: (k.group, k.version, k.plural) for k in CHILD_KINDS},
    "Role": (RBAC_GROUP, RBAC_VERSION, "roles"),
    "RoleBinding": (RBAC_GROUP, RBAC_VERSION, "rolebindings"),
    c.NETWORK_POLICY_KIND: (c.NETWORKING_GROUP, c.NETWORKING_VERSION, "networkpolicies"),
}


class KubeError(Exception):
    """An API call failed; retry later. `message` names verb, kind and namespace/name."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


class Rejected(KubeError):
    """A create was refused at admission (validation, webhook, policy): a permanent answer."""

    def __init__(self, kind: str, name: str, message: str, status: int | None = None):
        super().__init__(message, status)
        self.kind, self.name, self.api_message = kind, name, message


def api_message(e: ApiException) -> str:
    try:
        return json.loads(e.body or "{}").get("message") or e.reason or str(e.status)
    except (ValueError, AttributeError):
        return str(e.body or e.reason or e.status)


def _wrap(verb: str, kind: str, ns: str, name: str, e: Exception) -> KubeError:
    if isinstance(e, ApiException):
        return KubeError(f"{verb} {kind} {ns}/{name}: HTTP {e.status}: {api_message(e)}", e.status)
    return KubeError(f"{verb} {kind} {ns}/{name}: {type(e).__name__}: {e}")


def new_api_client() -> client.ApiClient:
    """In-cluster config when running in a pod, else the kubeconfig (KUBECONFIG)."""
    try:
        config.load_incluster_config()
        return client.ApiClient()
    except config.ConfigException:
        # KUBECONFIG read now, not at import (the client's default is fixed when it is imported).
        return config.new_client_from_config(config_file=os.environ.get("KUBECONFIG") or None)


@dataclass
class Kube:
    api: client.ApiClient
    timeout: float   # seconds, each request (Settings.api_timeout_seconds)

    def __post_init__(self) -> None:
        self.custom = client.CustomObjectsApi(self.api)
        self.core = client.CoreV1Api(self.api)
        self._nodes_forbidden = False

    # --- reads -----------------------------------------------------------------------------------
    def get(self, kind: str, ns: str, name: str) -> dict | None:
        """The object as a dict (camelCase), or None when it does not exist."""
        try:
            if kind == "ServiceAccount":
                sa = self.core.read_namespaced_service_account(name, ns, _request_timeout=self.timeout)
                return self.api.sanitize_for_serialization(sa)
            g, v, p = CUSTOM[kind]
            return self.custom.get_namespaced_custom_object(g, v, ns, p, name, _request_timeout=self.timeout)
        except ApiException as e:
            if e.status == 404:
                return None
            raise _wrap("get", kind, ns, name, e) from e
        except Exception as e:  # connection errors, timeouts
            raise _wrap("get", kind, ns, name, e) from e

    def slice_pods(self, ns: str, cluster: str) -> tuple[PodObs, ...] | None:
        """A RayCluster's pods (KubeRay labels them ray.io/cluster=<name>), reduced for
        tpuft.controller.diagnosis. Best effort: without permission or on an error, None (and a warning)."""
        return self.pods(ns, f"{kuberay.RAY_CLUSTER_LABEL}={cluster}")

    def pods(self, ns: str, selector: str) -> tuple[PodObs, ...] | None:
        """Pods by label selector, reduced for tpuft.controller.diagnosis; None (and a warning) on any error."""
        try:
            resp = self.core.list_namespaced_pod(ns, label_selector=selector, _preload_content=False,
                                                 _request_timeout=self.timeout)
            items = json.loads(resp.data).get("items") or []
        except Exception as e:  # noqa: BLE001 - diagnosis is extra: the reconcile goes on without it
            log.warning("list pods %s in %s failed: %s", selector, ns, e)
            return None
        return tuple(PodObs.of(pod) for pod in items)

    def node_pools(self) -> tuple[tuple[str, str, int], ...] | None:
        """TPU node pools as nodes show them: (accelerator, topology, nodes). None where the
        operator may not list nodes (namespaced installs, or the chart's rbac.nodePoolHints off):
        asked once, then not again."""
        if self._nodes_forbidden:
            return None
        try:
            nodes = self.core.list_node(label_selector=gke.GKE_TPU_ACCELERATOR_SELECTOR,
                                        _request_timeout=self.timeout).items
        except ApiException as e:
            if e.status in (401, 403):
                self._nodes_forbidden = True
                log.info("node pool hints off: the operator may not list nodes (%s)", e.status)
            else:
                log.warning("list nodes failed: %s", e)
            return None
        except Exception as e:  # noqa: BLE001 - a hint: the reconcile goes on without it
            log.warning("list nodes failed: %s", e)
            return None
        counts: dict[tuple[str, str], int] = {}
        for n in nodes:
            labels = n.metadata.labels or {}
            key = (labels.get(gke.GKE_TPU_ACCELERATOR_SELECTOR, ""), labels.get(gke.GKE_TPU_TOPOLOGY_SELECTOR, "?"))
            counts[key] = counts.get(key, 0) + 1
        return tuple((a, t, n) for (a, t), n in sorted(counts.items()))

    def queue(self, ns: str, cluster_uid: str) -> QueueObs | None:
        """Kueue's Workload of the RayCluster with this UID (Kueue labels it with the job's UID):
        QueueObs(installed=False) when no Workload API is served (404), None on any other error
        (the reconcile goes on without Kueue's words; a warning says why)."""
        try:
            resp = self.custom.list_namespaced_custom_object(
                kueue.KUEUE_GROUP, kueue.KUEUE_VERSION, ns, kueue.WORKLOAD_PLURAL,
                label_selector=f"{kueue.KUEUE_JOB_UID_LABEL}={cluster_uid}", _request_timeout=self.timeout)
        except ApiException as e:
            if e.status == 404:
                return QueueObs(installed=False)
            log.warning("list %s in %s failed: HTTP %s: %s", kueue.WORKLOAD_PLURAL, ns, e.status, api_message(e))
            return None
        except Exception as e:  # noqa: BLE001 - Kueue's words are extra: the reconcile goes on without them
            log.warning("list %s in %s failed: %s", kueue.WORKLOAD_PLURAL, ns, e)
            return None
        items = sorted(resp.get("items") or [], key=lambda w: (w.get("metadata") or {}).get("creationTimestamp") or "")
        workload = items[-1] if items else None
        queue = QueueObs.of(workload)
        if not queue.check_rejected:
            return queue
        return QueueObs.of(workload, self._provisioning_requests(ns))

    def _provisioning_requests(self, ns: str) -> tuple[dict, ...] | None:
        """The namespace's ProvisioningRequests (Kueue's, for a Workload whose check it rejected: a
        revoked or expired booking is requeued, a failed one fails the run). None when unreadable."""
        try:
            resp = self.custom.list_namespaced_custom_object(
                kueue.PROVREQ_GROUP, kueue.PROVREQ_VERSION, ns, kueue.PROVREQ_PLURAL, _request_timeout=self.timeout)
        except Exception as e:  # noqa: BLE001 - the run waits (Queued) and says so instead of failing
            log.warning("list %s in %s failed: %s", kueue.PROVREQ_PLURAL, ns, e)
            return None
        return tuple(resp.get("items") or [])

    # --- writes ----------------------------------------------------------------------------------
    def create(self, kind: str, ns: str, body: Mapping[str, Any], owner_uid: str) -> str:
        """Create, or adopt an existing object of ours with that name. Returns 'created'/'adopted'."""
        name = body["metadata"]["name"]
        try:
            if kind == "ServiceAccount":
                self.core.create_namespaced_service_account(ns, dict(body), _request_timeout=self.timeout)
            else:
                g, v, p = CUSTOM[kind]
                self.custom.create_namespaced_custom_object(g, v, ns, p, dict(body), _request_timeout=self.timeout)
            return "created"
        except ApiException as e:
            if e.status == 409:
                return self._adopt(kind, ns, name, owner_uid)
            if e.status in REJECTED_STATUSES:
                raise Rejected(kind, name, api_message(e), e.status) from e
            raise _wrap("create", kind, ns, name, e) from e
        except Exception as e:
            raise _wrap("create", kind, ns, name, e) from e

    def _adopt(self, kind: str, ns: str, name: str, owner_uid: str) -> str:
        existing = self.get(kind, ns, name)
        if existing is None:
            raise KubeError(f"create {kind} {ns}/{name}: AlreadyExists, then gone; will retry")
        meta = existing.get("metadata") or {}
        if meta.get("deletionTimestamp"):
            raise KubeError(f"create {kind} {ns}/{name}: an older object of that name is still being deleted; "
                            "will retry")
        owners = [r.get("uid") for r in meta.get("ownerReferences") or []]
        if owner_uid and owner_uid not in owners:
            raise KubeError(f"create {kind} {ns}/{name}: an object of that name exists and is not owned by this "
                            f"TPUFinetune (owners: {owners or 'none'}); delete or rename it")
        return "adopted"

    def patch_suspend(self, kind: str, ns: str, name: str, suspend: bool) -> None:
        g, v, p = CUSTOM[kind]
        self._unless_gone("patch", kind, ns, name, lambda: self.custom.patch_namespaced_custom_object(
            g, v, ns, p, name, {"spec": {"suspend": suspend}}, _content_type=MERGE_PATCH,
            _request_timeout=self.timeout))

    def delete(self, kind: str, ns: str, name: str) -> None:
        g, v, p = CUSTOM[kind]
        # A RayJob goes in the foreground: it is gone only once KubeRay's submitter Job and its pods
        # are, so its RayCluster, deleted or suspended after it (phases.jobs._release), cannot fail a
        # submitter still following its job, and a new RayJob of the same name never finds the old
        # submitter Job (KubeRay reuses a Job of the RayJob's name).
        policy = "Foreground" if kind == kuberay.RAYJOB_KIND else "Background"
        self._unless_gone("delete", kind, ns, name, lambda: self.custom.delete_namespaced_custom_object(
            g, v, ns, p, name, propagation_policy=policy, _request_timeout=self.timeout))

    @staticmethod
    def _unless_gone(verb: str, kind: str, ns: str, name: str, call) -> None:
        """Run a write on an existing child; one already gone (404) needs nothing more."""
        try:
            call()
        except Exception as e:  # ApiException and connection errors/timeouts alike name the object
            if isinstance(e, ApiException) and e.status == 404:
                return
            raise _wrap(verb, kind, ns, name, e) from e

    def perform(self, ns: str, owner_uid: str, action: Action) -> str:
        if action.op == Op.CREATE:
            return self.create(action.kind, ns, action.body or {}, owner_uid)
        if action.op in (Op.SUSPEND, Op.RESUME):
            self.patch_suspend(action.kind, ns, action.name, action.op == Op.SUSPEND)
            return action.op.value
        if action.op == Op.DELETE:
            self.delete(action.kind, ns, action.name)
            return "deleted"
        raise ValueError(f"unknown action {action}")

    def patch_status(self, ns: str, name: str, patch: Mapping[str, Any]) -> bool:
        """Merge-patch the status subresource with the operator's keys only. False if the object is gone."""
        try:
            self.custom.patch_namespaced_custom_object_status(
                c.GROUP, c.VERSION, ns, c.PLURAL, name, {"status": dict(patch)},
                _content_type=MERGE_PATCH, _request_timeout=self.timeout)
            return True
        except ApiException as e:
            if e.status == 404:
                return False
            raise _wrap("patch status of", c.KIND, ns, name, e) from e
        except Exception as e:
            raise _wrap("patch status of", c.KIND, ns, name, e) from e

    def post_event(self, obj: Mapping[str, Any], event: Event) -> None:
        """A core/v1 Event about the TPUFinetune (`kubectl describe tft` / `kubectl get events`). Best effort."""
        meta = obj.get("metadata") or {}
        ns, name = meta.get("namespace"), meta.get("name")
        now = datetime.now(timezone.utc)
        body = {
            "metadata": {"name": f"{name}.{uuid.uuid4().hex[:16]}", "namespace": ns},
            "involvedObject": {"apiVersion": c.API_VERSION, "kind": c.KIND, "name": name, "namespace": ns,
                               "uid": meta.get("uid"), "resourceVersion": meta.get("resourceVersion")},
            "reason": event.reason.value, "message": event.message[:1024], "type": event.type.value,
            "firstTimestamp": now, "lastTimestamp": now, "count": 1,
            "source": {"component": c.MANAGED_BY}, "reportingComponent": c.MANAGED_BY,
            "reportingInstance": os.environ.get("HOSTNAME", c.MANAGED_BY),
        }
        try:
            self.core.create_namespaced_event(ns, body, _request_timeout=self.timeout)
        except Exception as e:  # noqa: BLE001 - events are best effort: never fail a reconcile over one
            log.warning("post event %s on %s %s/%s failed: %s", event.reason.value, c.KIND, ns, name, e)
