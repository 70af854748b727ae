"""`tpuft cluster down` stops everything by PID and undoes every host change. Runs last among
the cluster tests (pytest takes modules in name order); the session fixture's own teardown then
finds nothing left to stop."""
from __future__ import annotations

import subprocess

from tpuft_local import host


def _sh(*cmd: str) -> str:
    return subprocess.run(cmd, capture_output=True, text=True).stdout


def test_down_stops_everything_and_undoes_the_host_changes(local_cluster):
    journal = host.Journal.load(local_cluster.journal.path)
    sysctls_before_up = dict(journal.sysctls)
    assert sysctls_before_up and journal.chains == [host.GUARD_CHAIN]
    done = local_cluster.down(keep_packages=True)
    assert all(pid is None for pid in local_cluster.component_pids().values()), local_cluster.component_pids()
    assert not _sh("pgrep", "-f", str(local_cluster.socket)).strip()  # no containerd shim left
    assert host.GUARD_CHAIN not in _sh("iptables", "-S")
    assert "KUBE-" not in _sh("iptables", "-S") + _sh("iptables", "-t", "nat", "-S")
    assert local_cluster.net.bridge not in _sh("ip", "link")
    assert local_cluster.net.fake_pod_cidr not in _sh("ip", "route", "show", "type", "blackhole")
    for key, value in sysctls_before_up.items():
        assert host.read_sysctl(key) == value, key
    assert str(local_cluster.state) not in _sh("cat", "/proc/self/mountinfo")
    assert any("removed iptables chain" in line for line in done), done
