"""`tpuft cluster status|up|env|kubectl` against the running local cluster."""
from __future__ import annotations

import os
import subprocess
import sys

from tpuft_local import cluster as cl

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def tpuft(*args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tpuft.cli", "cluster", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)


def test_status_lists_every_component_and_pool(local_cluster):
    res = tpuft("status")
    assert res.returncode == 0, res.stdout + res.stderr
    for comp in ("etcd", "kube-apiserver", "kube-scheduler", "kubelet", "containerd", "kube-proxy", "coredns",
                 "kwok", "kuberay-operator", "tpu-webhook", "kueue"):
        assert any(line.startswith(comp) and "pid " in line for line in res.stdout.splitlines()), (comp, res.stdout)
    assert "v6e-4x4-0" in res.stdout and "4/4 Ready" in res.stdout and "[simulated (KWOK)]" in res.stdout
    assert "local-pool" in res.stdout and "[real (kubelet + containerd)]" in res.stdout


def test_up_again_keeps_what_runs_and_repairs_what_died(local_cluster):
    before = local_cluster.component_pids()
    os.kill(before["kwok"], 9)  # a component dies
    res = tpuft("up", "--no-operator")
    assert res.returncode == 0, res.stderr[-3000:]
    after = local_cluster.component_pids()
    assert after["kwok"] and after["kwok"] != before["kwok"]  # started again
    for name in ("kube-apiserver", "kubelet", "containerd", "kuberay-operator", "kueue"):
        assert after[name] == before[name], name  # left alone


def test_env_and_kubectl_reach_it(local_cluster):
    env = tpuft("env").stdout
    assert f"export KUBECONFIG={local_cluster.kubeconfig}" in env
    res = tpuft("kubectl", "--", "get", "rayclusters", "-A")
    assert res.returncode == 0, res.stderr


def test_components_belong_to_this_state_dir(local_cluster):
    """Every PID `down` would stop names this cluster's state dir in its argv."""
    for name, pid in local_cluster.component_pids().items():
        if pid:
            argv = open(f"/proc/{pid}/cmdline", "rb").read().decode().split("\0")
            assert any(str(local_cluster.state) in a for a in argv), (name, argv)
    assert cl.default_state_dir() == local_cluster.state or os.environ.get("TPUFT_HOME")
