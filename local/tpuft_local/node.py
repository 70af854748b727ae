"""The real node: containerd + runc with a CNI bridge, the kubelet and kube-proxy.

Configuration only (pure functions returning the files' contents) plus `Node`, which writes
them and starts the three processes. Settings each cost an error in the feasibility probe
(see docs/local-cluster.md): cgroup v1 needs `failCgroupV1: false`; runc
without CAP_SYS_RESOURCE needs `restrict_oom_score_adj`; pulls must never leave the machine,
so every registry resolves to a closed loopback port and images are imported instead.
"""
from __future__ import annotations

import json
from pathlib import Path

from tpuft_local.network import Network

NODE_NAME = "tpuft-node"
NODE_POOL = "local-pool"  # the real node's cloud.google.com/gke-nodepool label
PAUSE_IMAGE = "localhost/tpuft/pause:3.10"
KUBELET_PORT = 10250
CLOSED_REGISTRY = "http://127.0.0.1:1"  # nothing listens there: a pull fails at once, locally


def containerd_config(root: Path, socket: Path, net_dir: Path, certs_dir: Path) -> str:
    """containerd 1.6 config (version 2) for the kubelet's CRI, all state under `root`."""
    return f'''version = 2
root = "{root}/root"
state = "{root}/state"
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs",
                    "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.aufs"]
[grpc]
  address = "{socket}"
[ttrpc]
  address = "{socket}.ttrpc"
[plugins."io.containerd.internal.v1.opt"]
  path = "{root}/opt"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{PAUSE_IMAGE}"
  # The machine lacks CAP_SYS_RESOURCE: without this every sandbox fails in runc
  # ("failed to update /proc/self/oom_score_adj: Permission denied").
  restrict_oom_score_adj = true
  stream_server_address = "127.0.0.1"
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "{net_dir}"
  [plugins."io.containerd.grpc.v1.cri".registry]
    config_path = "{certs_dir}"
'''


def closed_registry_hosts() -> str:
    """certs.d/_default/hosts.toml: every registry is the closed loopback port, so no pull leaves."""
    return f'server = "{CLOSED_REGISTRY}"\n[host."{CLOSED_REGISTRY}"]\n  capabilities = ["pull", "resolve"]\n'


def cni_config(net: Network, ipam_dir: Path) -> dict:
    """The pods' network: the bridge plugin on our bridge, host-local IPAM, no masquerade (nothing leaves)."""
    return {"cniVersion": "1.0.0", "name": "tpuft", "plugins": [
        {"type": "bridge", "bridge": net.bridge, "isGateway": True, "ipMasq": False, "hairpinMode": True,
         "ipam": {"type": "host-local", "dataDir": str(ipam_dir),
                  "ranges": [[{"subnet": net.pod_cidr, "gateway": net.gateway,
                               "rangeStart": str(_nth(net.pod_cidr, 10))}]],
                  "routes": [{"dst": "0.0.0.0/0"}]}},
        {"type": "loopback"}]}


def _nth(cidr: str, n: int) -> str:
    import ipaddress
    return str(ipaddress.ip_network(cidr)[n])


def kubelet_config(net: Network, *, socket: Path, pki: Path, resolv_conf: Path, healthz_port: int) -> dict:
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
        "failCgroupV1": False,  # this machine kind has cgroup v1 controllers; 1.35 refuses them by default
        "cgroupDriver": "cgroupfs",
        "address": net.gateway, "port": KUBELET_PORT, "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1", "healthzPort": healthz_port,
        "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": True},
                           "x509": {"clientCAFile": str(pki / "ca.crt")}},
        "authorization": {"mode": "Webhook"},
        "tlsCertFile": str(pki / "kubelet-serving.crt"), "tlsPrivateKeyFile": str(pki / "kubelet-serving.key"),
        "clusterDNS": [net.dns_service_ip], "clusterDomain": "cluster.local",
        # No nameserver: a pod may resolve cluster names only, never through the host's resolver.
        "resolvConf": str(resolv_conf),
        "containerRuntimeEndpoint": f"unix://{socket}", "imageServiceEndpoint": f"unix://{socket}",
        "failSwapOn": False, "serializeImagePulls": False, "maxPods": 110,
        # A 5 GiB workload image on a shared disk must not trip disk-pressure evictions.
        "evictionHard": {"memory.available": "200Mi", "nodefs.available": "2%", "imagefs.available": "2%",
                         "nodefs.inodesFree": "2%"},
        "imageGCHighThresholdPercent": 98, "imageGCLowThresholdPercent": 95,
        "staticPodPath": "", "podPidsLimit": -1,
    }


def kube_proxy_config(net: Network, kubeconfig: Path, healthz_port: int, metrics_port: int) -> dict:
    return {
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1", "kind": "KubeProxyConfiguration",
        "clientConnection": {"kubeconfig": str(kubeconfig)}, "mode": "iptables",
        "clusterCIDR": net.pod_cidr, "hostnameOverride": NODE_NAME,
        "healthzBindAddress": f"127.0.0.1:{healthz_port}", "metricsBindAddress": f"127.0.0.1:{metrics_port}",
        "nodePortAddresses": [f"{net.gateway}/32"],  # NodePorts on the bridge only, never on the machine's interface
        # 0: leave the host's conntrack settings as they are (fewer host changes to undo).
        "conntrack": {"maxPerCore": 0, "min": 0, "tcpEstablishedTimeout": "0s", "tcpCloseWaitTimeout": "0s"},
        "iptables": {"localhostNodePorts": False},
    }


def write_json(path: Path, data: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path
