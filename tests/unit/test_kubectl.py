"""The laptop commands (tpuft logs, plot, chat) when kubectl has no cluster configured: one line
saying what is missing and how to fix it, not kubectl's five connection errors."""
from __future__ import annotations

import sys

import pytest

from tpuft import cli
from tpuft.cli import kubectl

# What kubectl 1.35 prints without KUBECONFIG or ~/.kube/config (recorded: five API group lookups, then one line)
UNCONFIGURED = "\n".join(
    ['E1206 22:05:01.942584   30126 memcache.go:265] "Unhandled Error" err="couldn\'t get current server API group '
     'list: Get \\"http://localhost:8080/api?timeout=32s\\": dial tcp 127.0.0.1:8080: connect: connection refused"'] * 5
    + ["The connection to the server localhost:8080 was refused - did you specify the right host or port?"])


@pytest.fixture
def unconfigured_kubectl(tmp_path):
    fake = tmp_path / "kubectl"
    fake.write_text(f"#!{sys.executable}\nimport sys\nsys.stderr.write({UNCONFIGURED!r} + '\\n')\nsys.exit(1)\n")
    fake.chmod(0o755)
    return str(fake)


@pytest.mark.parametrize("argv", [["logs", "ft", "-n", "ns"], ["plot", "ft", "-n", "ns", "-o", "out.png"],
                                  ["chat", "ft", "hi", "-n", "ns"]], ids=["logs", "plot", "chat"])
def test_each_laptop_command_says_once_that_no_cluster_is_configured(argv, unconfigured_kubectl, capsys, tmp_path,
                                                                     monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli.main([*argv, "--kubectl", unconfigured_kubectl]) != 0
    err = capsys.readouterr().err
    assert err.count(kubectl.NO_CLUSTER) == 1 and 'eval "$(tpuft cluster env)"' in err
    assert "localhost:8080/api" not in err and "memcache.go" not in err


def test_what_a_cluster_says_is_not_taken_for_no_cluster():
    assert not kubectl.unconfigured('Error from server (NotFound): tpufinetunes.tpufinetune.dev "ft" not found')
    assert kubectl.unconfigured(UNCONFIGURED)
