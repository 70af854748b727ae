"""The node's settings that each cost an error in the feasibility probe, and the network rule."""
from pathlib import Path

from tpuft_local import host, node
from tpuft_local.controlplane import scheduler_config
from tpuft_local.network import Network
from tpuft_local.node import NODE_POOL
from tpuft_local.pools import POOL_LABEL

NET = Network()


def test_containerd_never_pulls_from_outside_and_runs_without_cap_sys_resource(tmp_path):
    config = node.containerd_config(tmp_path, tmp_path / "c.sock", tmp_path / "net.d", tmp_path / "certs.d")
    assert "restrict_oom_score_adj = true" in config
    assert f'sandbox_image = "{node.PAUSE_IMAGE}"' in config
    assert f'config_path = "{tmp_path / "certs.d"}"' in config
    hosts = node.closed_registry_hosts()
    assert 'server = "http://127.0.0.1:1"' in hosts and "https://" not in hosts


def test_kubelet_accepts_cgroup_v1_and_gives_pods_no_upstream_resolver(tmp_path):
    cfg = node.kubelet_config(NET, socket=Path("/s"), pki=tmp_path, resolv_conf=tmp_path / "r", healthz_port=1)
    assert cfg["failCgroupV1"] is False and cfg["cgroupDriver"] == "cgroupfs"
    assert cfg["clusterDNS"] == [NET.dns_service_ip] and cfg["resolvConf"] == str(tmp_path / "r")
    assert cfg["address"] == NET.gateway and cfg["readOnlyPort"] == 0
    assert cfg["authentication"]["anonymous"]["enabled"] is False


def test_pods_network_never_masquerades_out():
    cni = node.cni_config(NET, Path("/ipam"))
    bridge = cni["plugins"][0]
    assert bridge["bridge"] == NET.bridge and bridge["ipMasq"] is False
    assert bridge["ipam"]["ranges"][0][0]["subnet"] == NET.pod_cidr


def test_node_ports_only_on_the_bridge():
    cfg = node.kube_proxy_config(NET, Path("/k"), 1, 2)
    assert cfg["nodePortAddresses"] == [f"{NET.gateway}/32"]


def test_guard_chain_lets_pods_reach_only_each_other_and_the_bridge_address():
    rules = host.guard_rules(NET)
    assert rules[0] == ["-i", "tpuft0", "-o", "tpuft0", "-j", "RETURN"]
    assert rules[1] == ["-i", "tpuft0", "-d", f"{NET.gateway}/32", "-j", "RETURN"]
    assert rules[2] == ["-i", "tpuft0", "-j", "DROP"] and rules[3] == ["-o", "tpuft0", "-j", "DROP"]


def test_scheduler_prefers_the_real_node_for_every_pod_that_fits():
    cfg = scheduler_config(Path("/k"))
    (profile,) = cfg["profiles"]
    args = {p["name"]: p["args"] for p in profile["pluginConfig"]}
    (pref,) = args["NodeAffinity"]["addedAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert pref["preference"]["matchExpressions"] == [{"key": POOL_LABEL, "operator": "In", "values": [NODE_POOL]}]
    weights = {p["name"]: p["weight"] for p in profile["plugins"]["score"]["enabled"]}
    assert weights["NodeAffinity"] > 10 * weights["NodeResourcesFit"]
    assert args["NodeResourcesFit"]["scoringStrategy"]["type"] == "MostAllocated"
