"""Cluster add-ons as data: CoreDNS (cluster DNS), the identities and RBAC of the host-run
components (CoreDNS, KWOK, KubeRay's operator), and the `kube-dns` Service.

CoreDNS, KWOK and KubeRay run as host processes from binaries built here (no registry serves
their images). CoreDNS listens on the bridge address; the `kube-dns` Service (ClusterIP
`dns_service_ip`, the kubelet's clusterDNS) has Endpoints pointing there. Nothing is forwarded
upstream: names outside cluster.local get NXDOMAIN, so no pod query reaches the host's resolver.
"""
from __future__ import annotations

from tpuft_local.network import Network

COREDNS_USER = "tpuft:coredns"
KUBERAY_USER = "tpuft:kuberay-operator"
KWOK_USER = "tpuft:kwok"
WEBHOOK_USER = "tpuft:tpu-webhook"
KUBERAY_CLUSTER_ROLE = "kuberay-operator"  # KubeRay's own config/rbac/role.yaml, applied from the module


# What `kubectl logs` shows for a container on a simulated host (KWOK runs no container): one
# line in the CRI log format the kubelet's log reader (and KWOK's) parses.
SIMULATED_HOST_LOG = ("2026-01-01T00:00:00.000000000Z stdout F [tpuft cluster] this pod is on a simulated GKE "
                      "host (KWOK): no container runs here, so there is no log. Pods on the real node "
                      "(tpuft-node) have theirs; a run's driver log: tpuft logs NAME.\n")


def kwok_config(logs_file: str) -> str:
    """KWOK's --config: every pod on a KWOK node answers `kubectl logs` with `logs_file`."""
    return ("apiVersion: kwok.x-k8s.io/v1alpha1\nkind: ClusterLogs\nmetadata:\n  name: simulated-tpu-hosts\n"
            f"spec:\n  selector: {{}}\n  logs:\n  - logsFile: {logs_file}\n    follow: false\n")


def corefile(net: Network, kubeconfig: str, health_port: int, ready_port: int) -> str:
    """Cluster names from the API server; every other name NXDOMAIN (no `forward` anywhere)."""
    return f"""cluster.local:53 in-addr.arpa:53 ip6.arpa:53 {{
    bind {net.gateway}
    errors
    health 127.0.0.1:{health_port}
    ready 127.0.0.1:{ready_port}
    kubernetes cluster.local in-addr.arpa ip6.arpa {{
        kubeconfig {kubeconfig} tpuft-local
        pods insecure
    }}
    cache 30
}}
.:53 {{
    bind {net.gateway}
    errors
    template ANY ANY {{
        rcode NXDOMAIN
    }}
}}
"""


def _binding(name: str, role: str, user: str) -> dict:
    return {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
            "metadata": {"name": name, "labels": {"app.kubernetes.io/managed-by": "tpuft-local"}},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role},
            "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": user}]}


def rbac() -> list[dict]:
    """CoreDNS reads Services/EndpointSlices/Namespaces; KWOK plays every simulated kubelet
    (nodes, their leases and pods' status); the TPU webhook stand-in lists a slice's pods;
    KubeRay gets exactly its own ClusterRole."""
    coredns_role = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
                    "metadata": {"name": "tpuft:coredns", "labels": {"app.kubernetes.io/managed-by": "tpuft-local"}},
                    "rules": [{"apiGroups": [""], "resources": ["services", "namespaces", "pods"],
                               "verbs": ["list", "watch"]},
                              {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                               "verbs": ["list", "watch"]}]}
    kwok_role = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
                 "metadata": {"name": "tpuft:kwok", "labels": {"app.kubernetes.io/managed-by": "tpuft-local"}},
                 "rules": [{"apiGroups": [""], "resources": ["nodes", "nodes/status", "pods", "pods/status"],
                            "verbs": ["get", "list", "watch", "patch", "update", "delete"]},
                           {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
                            "verbs": ["get", "list", "watch", "create", "update", "patch", "delete"]},
                           {"apiGroups": [""], "resources": ["events"], "verbs": ["create", "patch"]}]}
    webhook_role = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
                    "metadata": {"name": "tpuft:tpu-webhook", "labels": {"app.kubernetes.io/managed-by": "tpuft-local"}},
                    "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]}]}
    return [coredns_role, _binding("tpuft:coredns", "tpuft:coredns", COREDNS_USER),
            webhook_role, _binding("tpuft:tpu-webhook", "tpuft:tpu-webhook", WEBHOOK_USER),
            kwok_role, _binding("tpuft:kwok", "tpuft:kwok", KWOK_USER),
            _binding("tpuft:kuberay-operator", KUBERAY_CLUSTER_ROLE, KUBERAY_USER)]


def kube_dns(net: Network) -> list[dict]:
    ports = [{"name": "dns", "port": 53, "protocol": "UDP"}, {"name": "dns-tcp", "port": 53, "protocol": "TCP"}]
    labels = {"k8s-app": "kube-dns", "app.kubernetes.io/managed-by": "tpuft-local"}
    return [
        {"apiVersion": "v1", "kind": "Service",
         "metadata": {"name": "kube-dns", "namespace": "kube-system", "labels": labels},
         "spec": {"clusterIP": net.dns_service_ip, "ports": [dict(p, targetPort=53) for p in ports]}},
        {"apiVersion": "v1", "kind": "Endpoints",
         "metadata": {"name": "kube-dns", "namespace": "kube-system", "labels": labels},
         "subsets": [{"addresses": [{"ip": net.gateway}], "ports": ports}]},
    ]
