"""Kueue on the local cluster, as data: its Configuration, its webhooks pointed at the host
process, its RBAC, and the queue objects `tpuft cluster up` makes (one ResourceFlavor per pool,
the ClusterQueues `local`, `flex-start` and `tas`, and a LocalQueue of each name in the demo
namespace: DEMO_LOCAL_QUEUES, which `tpuft demo --namespace` makes in its own namespace too).

Kueue (sigs.k8s.io/kueue, built from hack/tools by tpuft_local.toolchain) runs as a host process
like KubeRay's operator: no registry serves its image. Its webhook server listens on the bridge
address with a serving cert from the cluster CA (the way the TPU webhook stand-in does), so its
internal cert management is off and the webhook configurations carry a URL and the CA bundle
instead of a Service. Only the RayCluster and RayJob integrations are on: the webhooks of the
others (batch/Job, Pod, ...) are left out, or every Job KubeRay creates would be sent to a
handler that is not served.
"""
from __future__ import annotations

import base64
from pathlib import Path

import yaml

from tpuft.api import gke
from tpuft.api import kueue
from tpuft_local import pools as poolslib

USER = "tpuft:kueue"
NAMESPACE = "kueue-system"          # Kueue's own namespace (events, its config's `namespace`)
FRAMEWORKS = ("ray.io/raycluster", "ray.io/rayjob")
# Webhook paths kept from Kueue's config/components/webhook/manifests.yaml: its own kinds and Ray's.
KEPT_PATHS = ("-kueue-x-k8s-io-", "-ray-io-v1-raycluster", "-ray-io-v1-rayjob")
CLUSTER_QUEUE = "local"
LOCAL_QUEUE = "local"
CPU_FLAVOR = "cpu"
# The CPU flavor's quota: the simulated CPU pool's node (TPU slices' Ray heads) plus room for the
# CPU examples on the real node. Every pod Kueue admits asks for cpu and memory; the TPU flavors'
# own cpu and memory are their pools' allocatable, so a slice is held back by google.com/tpu alone.
CPU_QUOTA = ("32", "128Gi")
MANAGED = {"app.kubernetes.io/managed-by": "tpuft-local"}


def configuration(webhook_host: str, webhook_port: int, cert_dir: Path, health_port: int) -> dict:
    """Kueue's Configuration (config.kueue.x-k8s.io/v1beta2) for a host process: no leader
    election, no metrics listener, the webhook on the bridge address with our cert."""
    return {
        "apiVersion": "config.kueue.x-k8s.io/v1beta2", "kind": "Configuration",
        "namespace": NAMESPACE,
        "manageJobsWithoutQueueName": False,   # only what carries kueue.x-k8s.io/queue-name
        "health": {"healthProbeBindAddress": f"127.0.0.1:{health_port}"},
        "metrics": {"bindAddress": "0"},
        "webhook": {"host": webhook_host, "port": webhook_port, "certDir": str(cert_dir)},
        "leaderElection": {"leaderElect": False},
        "internalCertManagement": {"enable": False},
        "integrations": {"frameworks": list(FRAMEWORKS)},
    }


# Without its internal cert management Kueue v0.17.0 reads the metrics server's cert from this fixed
# path (cmd/kueue/main.go), even with metrics off, and exits when it is missing.
METRICS_CERT_DIR = "/etc/kueue/metrics/certs"


def private_etc(state: Path, certs: Path) -> list[str]:
    """The argv prefix that runs Kueue in a mount namespace of its own whose /etc is an overlay
    (upper layer under `state`) holding METRICS_CERT_DIR -> `certs`: the host's /etc is not touched,
    and the mount goes with the process."""
    upper, work = state / "upper", state / "work"
    for d in (upper, work):
        d.mkdir(parents=True, exist_ok=True)
    script = (f"mount -t overlay tpuft-kueue-etc -o lowerdir=/etc,upperdir={upper},workdir={work} /etc && "
              f"mkdir -p {Path(METRICS_CERT_DIR).parent} && ln -sfn {certs} {METRICS_CERT_DIR} && exec \"$0\" \"$@\"")
    return ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", script]


def webhook_configurations(manifests: Path, url: str, ca_pem: bytes) -> list[dict]:
    """Kueue's Mutating/ValidatingWebhookConfigurations with only the kept webhooks, each sent to
    `url` + its path (the host process) under our CA instead of Kueue's in-cluster Service."""
    out = []
    for doc in yaml.safe_load_all(manifests.read_text()):
        if not doc:
            continue
        hooks = []
        for hook in doc.get("webhooks") or []:
            path = hook["clientConfig"]["service"]["path"]
            if any(k in path for k in KEPT_PATHS):
                hooks.append({**hook, "clientConfig": {"url": url + path,
                                                       "caBundle": base64.b64encode(ca_pem).decode()}})
        name = "tpuft-kueue-" + doc["metadata"]["name"]
        out.append({**doc, "metadata": {"name": name, "labels": MANAGED}, "webhooks": hooks})
    return out


def rbac(rbac_dir: Path) -> list[dict]:
    """Kueue's own manager roles (config/components/rbac): the ClusterRole (role.yaml) and the Role
    on Secrets in its namespace (manager_secrets_role.yaml: its cache watches them there), bound to
    its user."""
    role = yaml.safe_load((rbac_dir / "role.yaml").read_text())
    secrets = yaml.safe_load((rbac_dir / "manager_secrets_role.yaml").read_text())
    name = "tpuft:kueue-manager"
    subjects = [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": USER}]
    ref = {"apiGroup": "rbac.authorization.k8s.io"}
    return [{**role, "metadata": {"name": name, "labels": MANAGED}},
            {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
             "metadata": {"name": name, "labels": MANAGED},
             "roleRef": {**ref, "kind": "ClusterRole", "name": name}, "subjects": subjects},
            {**secrets, "metadata": {"name": name, "namespace": NAMESPACE, "labels": MANAGED}},
            {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
             "metadata": {"name": name, "namespace": NAMESPACE, "labels": MANAGED},
             "roleRef": {**ref, "kind": "Role", "name": name}, "subjects": subjects}]


def _flavor(name: str, node_labels: dict, tpu: bool) -> dict:
    spec: dict = {"nodeLabels": dict(node_labels)} if node_labels else {}
    if tpu:   # the pools' taint; Kueue adds the toleration to what it admits on this flavor
        spec["tolerations"] = [{"key": gke.TPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}]
    return {"apiVersion": f"{kueue.KUEUE_GROUP}/{kueue.KUEUE_VERSION}", "kind": "ResourceFlavor",
            "metadata": {"name": name, "labels": MANAGED}, "spec": spec}


def _cpu_quota() -> dict:
    """The CPU flavor's quota (the Ray heads): CPU and memory, no chips. Listed first in a
    ClusterQueue, so a head takes it and a TPU worker the next flavor whose chips fit."""
    return {"name": CPU_FLAVOR, "resources": [
        {"name": "cpu", "nominalQuota": CPU_QUOTA[0]}, {"name": "memory", "nominalQuota": CPU_QUOTA[1]},
        {"name": gke.TPU_RESOURCE, "nominalQuota": 0}]}


def _tpu_quota(flavor: str, pool, slices: int) -> dict:
    """A TPU flavor's quota for `slices` slices of the pool's shape: its hosts' CPU and memory, its chips."""
    s, hosts = pool.slice, pool.slice.hosts * slices
    node = poolslib.tpu_nodes(pool)[0]["status"]["allocatable"]
    return {"name": flavor, "resources": [
        {"name": "cpu", "nominalQuota": _times(node["cpu"], hosts)},
        {"name": "memory", "nominalQuota": _times(node["memory"], hosts)},
        {"name": gke.TPU_RESOURCE, "nominalQuota": s.chips_per_host * hosts}]}


def _cluster_queue(name: str, flavors: list[dict], **spec) -> dict:
    """A ClusterQueue for every namespace with one resource group (CPU, memory, chips) over `flavors`."""
    return {"apiVersion": f"{kueue.KUEUE_GROUP}/{kueue.KUEUE_VERSION}", "kind": "ClusterQueue",
            "metadata": {"name": name, "labels": MANAGED},
            "spec": {"namespaceSelector": {}, **spec,
                     "resourceGroups": [{"coveredResources": ["cpu", "memory", gke.TPU_RESOURCE], "flavors": flavors}]}}


def queue_objects(tpu_pools, local_queue_namespace: str | None = None,
                  cluster_queue: str = CLUSTER_QUEUE) -> list[dict]:
    """One ResourceFlavor per TPU pool (GKE's accelerator and topology labels, the google.com/tpu
    toleration) and one for CPU (no node labels: the scheduler places CPU pods as without Kueue);
    the ClusterQueue whose google.com/tpu quota is exactly one slice of each pool (preemption of
    lower priority within it); a LocalQueue pointing at it."""
    flavors = [_flavor(CPU_FLAVOR, {}, tpu=False)]
    quotas = [_cpu_quota()]
    for pool in tpu_pools:
        flavors.append(_flavor(pool.name, dict(pool.slice.node_selector), tpu=True))
        quotas.append(_tpu_quota(pool.name, pool, 1))   # one slice
    # A TPU worker takes the first flavor whose node labels match its node selector and whose chips fit.
    cq = _cluster_queue(cluster_queue, quotas, preemption={"withinClusterQueue": "LowerPriority"})
    out = [*flavors, cq]
    if local_queue_namespace:
        out.append(local_queue(local_queue_namespace, cluster_queue))
    return out


def local_queue(namespace: str, cluster_queue: str = CLUSTER_QUEUE, name: str = LOCAL_QUEUE) -> dict:
    return {"apiVersion": f"{kueue.KUEUE_GROUP}/{kueue.KUEUE_VERSION}", "kind": "LocalQueue",
            "metadata": {"name": name, "namespace": namespace, "labels": MANAGED},
            "spec": {"clusterQueue": cluster_queue}}


def _times(quantity: str, n: int) -> str:
    """n x a Kubernetes quantity in the forms pools.gke_allocatable writes ("179555m", "711603Mi")."""
    for suffix in ("m", "Mi", "Gi"):
        if quantity.endswith(suffix):
            return f"{int(quantity[:-len(suffix)]) * n}{suffix}"
    return str(int(quantity) * n)


# --- GKE flex-start (queued provisioning) through Kueue's ProvisioningRequest admission check ---------
FLEX_START = "flex-start"   # the ClusterQueue, LocalQueue, AdmissionCheck and ProvisioningRequestConfig
QUEUED_PROVISIONING_CLASS = "queued-provisioning.gke.io"
PROVISIONING_CONTROLLER = "kueue.x-k8s.io/provisioning-request"
TOPOLOGY = "tpu-slices"     # Kueue TAS: a multi-host slice is one GKE node pool, its hosts the nodes


def flex_start_flavor_name(pool) -> str:
    return f"{pool.name}-{FLEX_START}"


def flex_start_objects(pool, local_queue_namespace: str | None = None, slices: int = 2) -> list[dict]:
    """GKE flex-start for one TPU shape, as GKE documents it for Kueue: a ResourceFlavor with the
    flex-start node labels and the google.com/tpu and cloud.google.com/gke-queued tolerations, a
    ProvisioningRequestConfig of class queued-provisioning.gke.io managing google.com/tpu, the
    AdmissionCheck using it, a ClusterQueue `flex-start` with the check on that flavor (quota for
    `slices` slices: the nodes do not exist until provisioned) and a LocalQueue. The chart's
    kueue/gke-flex-start.yaml is the same shape (tests/local/test_kueue.py)."""
    s, api = pool.slice, f"{kueue.KUEUE_GROUP}/{kueue.KUEUE_VERSION}"
    flavor = {"apiVersion": api, "kind": "ResourceFlavor",
              "metadata": {"name": flex_start_flavor_name(pool), "labels": MANAGED},
              "spec": {"nodeLabels": {**dict(s.node_selector), gke.GKE_FLEX_START_SELECTOR: "true"},
                       "tolerations": [{"key": gke.TPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"},
                                       {"key": gke.GKE_QUEUED_TAINT, "operator": "Exists", "effect": "NoSchedule"}]}}
    config = {"apiVersion": api, "kind": "ProvisioningRequestConfig", "metadata": {"name": FLEX_START, "labels": MANAGED},
              "spec": {"provisioningClassName": QUEUED_PROVISIONING_CLASS, "managedResources": [gke.TPU_RESOURCE]}}
    check = {"apiVersion": api, "kind": "AdmissionCheck", "metadata": {"name": FLEX_START, "labels": MANAGED},
             "spec": {"controllerName": PROVISIONING_CONTROLLER,
                      "parameters": {"apiGroup": kueue.KUEUE_GROUP, "kind": "ProvisioningRequestConfig", "name": FLEX_START}}}
    cq = _cluster_queue(FLEX_START, [_cpu_quota(), _tpu_quota(flex_start_flavor_name(pool), pool, slices)],
                        admissionChecksStrategy=_flex_start_check(pool))
    out = [flavor, config, check, cq]
    if local_queue_namespace:
        out.append(demo_local_queue(local_queue_namespace, FLEX_START))
    return out


def _flex_start_check(pool) -> dict:
    """The ProvisioningRequest check on the flex-start flavor only: a CPU head needs no provisioning."""
    return {"admissionChecks": [{"name": FLEX_START, "onFlavors": [flex_start_flavor_name(pool)]}]}


FALLBACK = "tpu-fallback"   # the ClusterQueue (and LocalQueue) trying the static pool, then flex-start


def fallback_objects(pool, local_queue_namespace: str | None = None, cluster_queue: str = FALLBACK) -> list[dict]:
    """Kueue v0.17's fallback order across capacity types: one ClusterQueue whose TPU flavors are
    listed in the order they are tried, the pool's own flavor (on-demand or a reservation: one slice
    of quota) and then the flex-start flavor, the ProvisioningRequest check on that one only. A run
    names no capacity type; Kueue takes the first flavor whose quota is free and puts its node labels
    and tolerations on the pods. Over the flavors `queue_objects` and `flex_start_objects` make."""
    cq = _cluster_queue(cluster_queue, [_cpu_quota(), _tpu_quota(pool.name, pool, 1),
                                        _tpu_quota(flex_start_flavor_name(pool), pool, 1)],
                        admissionChecksStrategy=_flex_start_check(pool))
    out = [cq]
    if local_queue_namespace:
        out.append(local_queue(local_queue_namespace, cluster_queue, cluster_queue))
    return out


def topology() -> dict:
    """Kueue's Topology for TPU slices by GKE's labels: a node pool (one multi-host slice), its nodes."""
    return {"apiVersion": f"{kueue.KUEUE_GROUP}/{kueue.KUEUE_VERSION}", "kind": "Topology",
            "metadata": {"name": TOPOLOGY, "labels": MANAGED},
            "spec": {"levels": [{"nodeLabel": gke.GKE_NODEPOOL_LABEL}, {"nodeLabel": "kubernetes.io/hostname"}]}}


TAS = "tas"   # the ClusterQueue and LocalQueue placing slices by Kueue Topology Aware Scheduling


def tas_objects(pool, local_queue_namespace: str | None = None) -> list[dict]:
    """Kueue Topology Aware Scheduling on a static TPU pool: the Topology, a flavor with the pool's
    labels and topologyName, and a ClusterQueue `tas` with quota for all of the pool's slices (a
    `slices: N` run's N x hosts pods placed slice by slice on node pools; tpuft.controller.builders' pod-set
    annotations ask for it with scheduling.topologyAware)."""
    name = f"{pool.name}-{TAS}"
    flavor = _flavor(name, dict(pool.slice.node_selector), tpu=True)
    flavor["spec"]["topologyName"] = TOPOLOGY
    cq = _cluster_queue(TAS, [_cpu_quota(), _tpu_quota(name, pool, pool.slices)])
    out = [topology(), flavor, cq]
    if local_queue_namespace:
        out.append(demo_local_queue(local_queue_namespace, TAS))
    return out


# The LocalQueues `tpuft cluster up` makes in the demo namespace (queue_objects, flex_start_objects,
# tas_objects), each with the ClusterQueue it points at. Kueue keeps an object whose queue-name label
# names a LocalQueue missing from its namespace Queued for good, so `tpuft demo` makes the one its
# object names in whatever namespace it runs in, from this same table.
DEMO_LOCAL_QUEUES = {LOCAL_QUEUE: CLUSTER_QUEUE, FLEX_START: FLEX_START, TAS: TAS}


def demo_local_queue(namespace: str, name: str) -> dict:
    """The LocalQueue `name` of DEMO_LOCAL_QUEUES, in `namespace`."""
    return local_queue(namespace, DEMO_LOCAL_QUEUES[name], name)


def standin_rbac(user: str) -> list[dict]:
    """What the queued-provisioning stand-in may do: read ProvisioningRequests and their PodTemplates,
    set their status, list pods (who consumes a booking), make and remove the flex-start nodes, read
    its settings ConfigMap."""
    from tpuft_local import queued_provisioning as qp
    name = "tpuft:queued-provisioning-standin"
    rules = [
        {"apiGroups": [qp.GROUP], "resources": [qp.PLURAL], "verbs": ["get", "list"]},
        {"apiGroups": [qp.GROUP], "resources": [f"{qp.PLURAL}/status"], "verbs": ["patch"]},
        {"apiGroups": [""], "resources": ["podtemplates"], "verbs": ["get"]},
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]},
        {"apiGroups": [""], "resources": ["nodes"], "verbs": ["list", "create", "delete"]},
        {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get"], "resourceNames": [qp.SETTINGS]},
    ]
    ref = {"apiGroup": "rbac.authorization.k8s.io"}
    return [{"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
             "metadata": {"name": name, "labels": MANAGED}, "rules": rules},
            {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
             "metadata": {"name": name, "labels": MANAGED}, "roleRef": {**ref, "kind": "ClusterRole", "name": name},
             "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": user}]}]
