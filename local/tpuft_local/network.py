"""The local cluster's addresses: one bridge, the pod, Service and simulated-pod ranges.

Every address the cluster uses lives on a bridge this project creates (`tpuft0`) or in ranges
routed only inside the machine; `check_free` refuses ranges that overlap the machine's own
routes (its interface network, its DNS resolver), which are read at run time, never assumed.
"""
from __future__ import annotations

import dataclasses
import ipaddress
import re
import subprocess
from pathlib import Path


class NetworkError(RuntimeError):
    """The chosen ranges collide with the machine's own; the message says which and how to change them."""


@dataclasses.dataclass(frozen=True)
class Network:
    bridge: str = "tpuft0"
    pod_cidr: str = "10.201.0.0/24"      # the real node's pods, on the bridge; .1 is the host side
    service_cidr: str = "10.202.0.0/24"  # ClusterIPs (kube-proxy's iptables rules)
    fake_pod_cidr: str = "10.203.0.0/16"  # IPs KWOK hands to pods on simulated nodes: blackholed

    @property
    def gateway(self) -> str:
        """The host's address on the bridge: the API server, kubelet, CoreDNS and the webhook listen here."""
        return str(next(ipaddress.ip_network(self.pod_cidr).hosts()))

    @property
    def kubernetes_service_ip(self) -> str:
        return str(ipaddress.ip_network(self.service_cidr)[1])

    @property
    def dns_service_ip(self) -> str:
        return str(ipaddress.ip_network(self.service_cidr)[10])

    @property
    def ranges(self) -> tuple[str, ...]:
        return (self.pod_cidr, self.service_cidr, self.fake_pod_cidr)


def _machine_networks() -> list[tuple[str, ipaddress.IPv4Network]]:
    """(what, network) for every route and resolver of the machine that is not ours."""
    found: list[tuple[str, ipaddress.IPv4Network]] = []
    out = subprocess.run(["ip", "-4", "route", "show", "table", "all"], capture_output=True, text=True).stdout
    for line in out.splitlines():
        dest, _, rest = line.partition(" ")
        if dest in ("default", "local", "broadcast", "unreachable", "blackhole") or "dev lo" in rest:
            continue
        dev = re.search(r"\bdev (\S+)", rest)
        if dev and dev.group(1).startswith("tpuft") or "cni" in rest or "veth" in rest:
            continue
        try:
            found.append((f"route {line.strip()}", ipaddress.ip_network(dest, strict=False)))
        except ValueError:
            continue
    try:
        for line in Path("/etc/resolv.conf").read_text().splitlines():
            parts = line.split()
            if len(parts) >= 2 and parts[0] == "nameserver" and ":" not in parts[1]:
                found.append((f"DNS resolver {parts[1]}", ipaddress.ip_network(parts[1] + "/32")))
    except OSError:
        pass
    return found


def check_free(net: Network) -> None:
    """Raise NetworkError when one of our ranges overlaps the machine's own networks."""
    for cidr in net.ranges:
        ours = ipaddress.ip_network(cidr)
        for what, theirs in _machine_networks():
            if ours.overlaps(theirs) and not theirs.is_loopback:
                raise NetworkError(f"the cluster range {cidr} overlaps this machine's {what}; "
                                   "pick other ranges with TPUFT_POD_CIDR / TPUFT_SERVICE_CIDR / TPUFT_FAKE_POD_CIDR")


def from_env(env: dict[str, str]) -> Network:
    base = Network()
    return Network(pod_cidr=env.get("TPUFT_POD_CIDR", base.pod_cidr),
                   service_cidr=env.get("TPUFT_SERVICE_CIDR", base.service_cidr),
                   fake_pod_cidr=env.get("TPUFT_FAKE_POD_CIDR", base.fake_pod_cidr))
