"""tpuft_local.demo_gitops with a real git repository and a fake API: what `tpuft demo --gitops`
commits, the Application it creates, what it prints of Argo CD's view, and its error when Argo CD
never creates the object. (The whole path on the real cluster: tests/cluster/test_demo.py.)"""
from __future__ import annotations

import subprocess

import pytest
import yaml
from kubernetes.client.rest import ApiException

from tpuft.api import constants as c
from tpuft_local import argocd, demo_gitops

MANIFEST = {"apiVersion": f"{c.GROUP}/{c.VERSION}", "kind": c.KIND, "metadata": {"name": "m", "namespace": "ns"},
            "spec": {"accelerator": "cpu", "topology": "2"}}


class FakeCustom:
    """The CustomObjectsApi calls demo_gitops makes: one Application, one TPUFinetune that appears
    after `appears_after` reads (never, if None)."""

    def __init__(self, appears_after: int | None, app_status: dict | None = None):
        self.appears_after, self.reads, self.app, self.app_status = appears_after, 0, None, app_status or {}

    def get_namespaced_custom_object(self, group, version, namespace, plural, name):
        if plural == "applications":
            if self.app is None:
                raise ApiException(status=404)
            return {**self.app, "status": self.app_status}
        self.reads += 1
        if self.appears_after is None or self.reads <= self.appears_after:
            raise ApiException(status=404)
        return {"metadata": {"name": name, "creationTimestamp": "2026-12-05T06:00:00Z"}}

    def delete_namespaced_custom_object(self, *args):
        raise ApiException(status=404)

    def create_namespaced_custom_object(self, group, version, namespace, plural, body):
        assert (group, version, namespace, plural) == demo_gitops.APPS
        self.app = body


@pytest.fixture
def repo(tmp_path):
    return argocd.init_repo(tmp_path / "git")


def _cluster(repo):
    class Cluster:
        def ensure_argocd(self):
            return repo, "git://127.0.0.1:1/tpuft.git"
    return Cluster()


def test_the_manifest_is_committed_and_an_application_syncs_its_folder(repo, monkeypatch):
    monkeypatch.setattr(demo_gitops.time, "sleep", lambda s: None)
    custom, said = FakeCustom(appears_after=2), []
    name, created, view = demo_gitops.apply(custom, _cluster(repo), MANIFEST, "ns", said.append)
    assert name == "m" and created.year == 2026 and view.name == "demo-ns-m"
    committed = subprocess.run(["git", "--git-dir", str(repo), "show", "main:demo/ns/m/m.yaml"],
                               capture_output=True, text=True, check=True).stdout
    assert yaml.safe_load(committed) == MANIFEST
    spec = custom.app["spec"]
    assert custom.app["metadata"] == {"name": "demo-ns-m", "namespace": argocd.NAMESPACE}
    assert spec["source"]["path"] == "demo/ns/m" and spec["destination"]["namespace"] == "ns"
    assert spec["syncPolicy"]["syncOptions"] == ["ServerSideApply=true"]
    assert any(s.startswith("committed ") and "Application argocd/demo-ns-m syncs it" in s for s in said), said


def test_argo_cd_never_creating_the_object_is_said_with_its_own_message(repo, monkeypatch):
    monkeypatch.setattr(demo_gitops.time, "sleep", lambda s: None)
    monkeypatch.setattr(demo_gitops, "SYNC_WAIT_S", 0.05)
    custom = FakeCustom(appears_after=None, app_status={
        "sync": {"status": "OutOfSync"}, "health": {"status": "Missing"},
        "operationState": {"phase": "Failed", "message": 'TPUFinetune "m" is invalid: spec.topology: Invalid value'}})
    with pytest.raises(demo_gitops.GitopsError, match=r"Argo CD did not create ns/m within .*sync OutOfSync, "
                                                      r"operation Failed: TPUFinetune \"m\" is invalid: spec.topology"):
        demo_gitops.apply(custom, _cluster(repo), MANIFEST, "ns", lambda s: None)


def test_argo_cds_view_is_printed_when_it_changes_with_the_reason_when_out_of_sync():
    custom, said = FakeCustom(appears_after=0), []
    custom.app = {"metadata": {"name": "a"}}
    view = demo_gitops.ArgoView(custom, "a", said.append)
    for sync, health, message in (("OutOfSync", "Missing", "bad topology"), ("Synced", "Progressing", ""),
                                  ("Synced", "Progressing", ""), ("Synced", "Healthy", "")):
        custom.app_status = {"sync": {"status": sync}, "health": {"status": health},
                             "operationState": {"message": message}}
        view.poll()
    assert view.history == [("OutOfSync", "Missing"), ("Synced", "Progressing"), ("Synced", "Healthy")]
    assert said == ["  Argo CD: OutOfSync, Missing (bad topology)", "  Argo CD: Synced, Progressing",
                    "  Argo CD: Synced, Healthy"]
