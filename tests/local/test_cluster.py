"""tpuft_local.cluster's pure parts: which kubectl failures `cluster up` tries again (ControlPlane.kubectl_retrying)."""
from __future__ import annotations

import subprocess
from functools import partial
from types import SimpleNamespace

import pytest

from tpuft_local import cluster, controlplane

OPENAPI_TIMEOUT = ('error: error validating "STDIN": error validating data: Get "https://10.201.0.1:32867/openapi/v2'
                   '?timeout=32s": net/http: request canceled (Client.Timeout exceeded while awaiting headers)')
# the API server's own request timeout: a CRD's server-side apply beside five Ray clusters on the node (2026-12-07)
SERVER_TIMEOUT = ("Error from server (Timeout): Timeout: request did not complete within requested timeout - "
                  "context deadline exceeded")
REFUSED = 'Error from server (Invalid): error when creating "STDIN": Namespace "Bad_Name" is invalid'


class FakeKubectl:
    def __init__(self, errors: list[str]):
        self.errors, self.calls = list(errors), 0

    def __call__(self, *args, check=False, input=None):
        self.calls += 1
        err = self.errors.pop(0) if self.errors else ""
        return subprocess.CompletedProcess(args, 1 if err else 0, "", err)


@pytest.fixture
def no_wait(monkeypatch):
    monkeypatch.setattr(controlplane.time, "sleep", lambda s: None)


def _cluster(errors: list[str]) -> SimpleNamespace:
    """Just what LocalCluster.apply uses: its control plane's kubectl (answering `errors` in turn) and
    kubectl_retrying, and its own kubectl_retrying."""
    plane = SimpleNamespace(kubectl=FakeKubectl(errors))
    plane.kubectl_retrying = partial(controlplane.ControlPlane.kubectl_retrying, plane)
    fake = SimpleNamespace(cp=plane, kubectl=plane.kubectl)
    fake.kubectl_retrying = partial(cluster.LocalCluster.kubectl_retrying, fake)
    return fake


@pytest.mark.parametrize("errors, calls", [
    ([], 1),
    ([OPENAPI_TIMEOUT], 2),                       # seen in a clean-clone CI run (2026-12-04)
    ([OPENAPI_TIMEOUT, OPENAPI_TIMEOUT], 3),
    ([SERVER_TIMEOUT], 2),
], ids=["first time", "once slow", "twice slow", "server timed out"])
def test_apply_tries_again_while_the_api_server_is_slow(no_wait, errors, calls):
    fake = _cluster(errors)
    cluster.LocalCluster.apply(fake, [{"kind": "Namespace"}])
    assert fake.kubectl.calls == calls


@pytest.mark.parametrize("errors, calls", [
    ([REFUSED], 1),                                # a refusal is final: no retry
    ([OPENAPI_TIMEOUT] * 3, 3),                    # bounded
], ids=["refused", "slow every time"])
def test_apply_gives_up_on_a_refusal_at_once_and_on_slowness_after_its_attempts(no_wait, errors, calls):
    fake = _cluster(errors)
    with pytest.raises(cluster.ClusterError, match=f"attempt {calls} of 3"):
        cluster.LocalCluster.apply(fake, [{"kind": "Namespace"}])
    assert fake.kubectl.calls == calls


def test_env_points_gcs_clients_at_the_stand_ins_once_up_started_them(tmp_path, monkeypatch, capsys):
    """`eval "$(tpuft cluster env)"` lets `tpuft logs`/`tpuft plot` read the local cluster's gs:// bucket."""
    kubectl = tmp_path / "bin" / "kubectl"   # no build: the env command only names its folder
    kubectl.parent.mkdir()
    kubectl.write_text("#!/bin/sh\n")
    kubectl.chmod(0o755)
    monkeypatch.setenv("TPUFT_BIN_KUBECTL", str(kubectl))
    state = tmp_path / "state"
    args = SimpleNamespace(action="env", state_dir=state)

    assert cluster.run_cluster(args) == 0
    before = capsys.readouterr().out
    assert "CLOUD_STORAGE_EMULATOR_ENDPOINT" not in before and "GCE_METADATA_ROOT" not in before
    assert f"export PATH={kubectl.parent}" in before

    state.mkdir(exist_ok=True)
    (state / cluster.GCS_PORT_FILE).write_text("4443")
    (state / cluster.METADATA_PORT_FILE).write_text("8089")
    assert cluster.run_cluster(args) == 0
    gateway = cluster.LocalCluster(state).net.gateway
    assert capsys.readouterr().out.splitlines()[2:] == [
        f"export CLOUD_STORAGE_EMULATOR_ENDPOINT=http://{gateway}:4443", f"export GCE_METADATA_ROOT={gateway}:8089"]


def test_a_demo_skips_up_only_while_nothing_it_was_made_from_changed_and_every_process_runs(tmp_path, monkeypatch):
    local = cluster.LocalCluster(tmp_path / "state")
    local.state.mkdir(parents=True)
    running = {"etcd": 11, "kube-apiserver": 12, "kubelet": 13, "tpufinetune-operator": None}
    monkeypatch.setattr(local, "component_pids", lambda: dict(running))
    monkeypatch.setattr(local.cp, "ready", lambda: True)
    assert local._unchanged_since() is None            # never up
    local._write_stamp(images=True)
    assert local._unchanged_since() is not None

    running["kubelet"] = 14                                 # restarted since: `up` checks what it left
    assert local._unchanged_since() is None
    running["kubelet"] = 13
    monkeypatch.setattr(local.cp, "ready", lambda: False)   # the API server does not answer
    assert local._unchanged_since() is None
    monkeypatch.setattr(local.cp, "ready", lambda: True)
    local.kueue = not local.kueue                           # another setting
    assert local._unchanged_since() is None
    local.kueue = not local.kueue
    versions = cluster.VERSIONS
    monkeypatch.setattr(cluster, "VERSIONS", {**versions, "kubelet": "v9.9.9"})   # another tool
    assert local._unchanged_since() is None
    monkeypatch.setattr(cluster, "VERSIONS", versions)
    assert local._unchanged_since() is not None
    from tpuft_local import images
    monkeypatch.setattr(images, "inputs_hashes", lambda names: {n: "changed" for n in names})  # an image's inputs
    assert local._unchanged_since() is None
