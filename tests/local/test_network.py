"""The cluster's ranges never overlap the machine's own networks (read at run time)."""
import ipaddress

import pytest

from tpuft_local import network
from tpuft_local.network import Network, NetworkError


def test_addresses_derive_from_the_ranges():
    net = Network()
    assert net.gateway == "10.201.0.1"
    assert net.kubernetes_service_ip == "10.202.0.1" and net.dns_service_ip == "10.202.0.10"


def test_overlap_with_a_machine_route_is_refused(monkeypatch):
    monkeypatch.setattr(network, "_machine_networks",
                        lambda: [("route 10.201.0.0/16 dev eth1", ipaddress.ip_network("10.201.0.0/16"))])
    with pytest.raises(NetworkError, match="10.201.0.0/24 overlaps this machine's route.*TPUFT_POD_CIDR"):
        network.check_free(Network())


def test_overlap_with_the_dns_resolver_is_refused(monkeypatch):
    monkeypatch.setattr(network, "_machine_networks",
                        lambda: [("DNS resolver 10.202.0.53", ipaddress.ip_network("10.202.0.53/32"))])
    with pytest.raises(NetworkError, match="DNS resolver"):
        network.check_free(Network())


def test_ranges_from_the_environment():
    net = network.from_env({"TPUFT_POD_CIDR": "10.99.0.0/24"})
    assert net.pod_cidr == "10.99.0.0/24" and net.gateway == "10.99.0.1"
