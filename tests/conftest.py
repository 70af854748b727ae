"""Shared fixtures: a real local Kubernetes control plane (etcd + kube-apiserver +
kube-controller-manager, see local/tpuft_local/controlplane.py), started once per test session
in a temporary folder (separate from any `tpuft cluster up` instance) and only when a test
asks for one of these fixtures. Our CRDs (crds/*.yaml) and the KubeRay v1.7.0 RayCluster and
RayJob CRDs are installed and Established before the first test runs.

Fixtures:
  control_plane  session  tpuft_local.controlplane.ControlPlane (.server_url, .kubeconfig, .install_crds, ...)
  kubeconfig     session  str: path of an admin kubeconfig (system:masters)
  kube_api       session  kubernetes.client.ApiClient configured from it
  kubectl        session  kubectl(*args, check=False, input=None, timeout=120) -> CompletedProcess (text)
  namespace      function str: a fresh namespace (its `default` ServiceAccount exists); deleted after

and, from tests/gcs_fixtures.py, a real GCS API and the GKE metadata server's token path on loopback
(fake_gcs, gcs_metadata, gcs).

A missing toolchain or a failed build fails the session loudly; nothing is skipped.
Tests under tests/integration/, and any test using a control plane, get the `integration`
marker (`pytest -m "not integration"` runs the rest).
"""
from __future__ import annotations

import contextlib
import re
import subprocess
import time
import uuid
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
pytest_plugins = ["tests.cluster_fixtures",  # local_cluster, cluster_api, cluster_kubectl, cluster_ns
                  "tests.gcs_fixtures"]     # fake_gcs, gcs_metadata, gcs: gs:// against a real GCS API


def pytest_collection_modifyitems(config, items):
    for item in items:
        uses_cluster = "control_plane" in getattr(item, "fixturenames", ())
        if uses_cluster or "integration" in Path(str(item.fspath)).parts:
            item.add_marker(pytest.mark.integration)


@contextlib.contextmanager
def _running_control_plane(state_dir):
    """Start a control plane in state_dir with our and KubeRay's CRDs; stop it afterwards."""
    from tpuft_local.controlplane import ControlPlane, default_crd_paths

    cp = ControlPlane(state_dir, die_with_parent=True, fast_etcd=True)
    try:
        cp.start()
        cp.install_crds(default_crd_paths())
        yield cp
    finally:
        cp.stop(quiet=True)


@pytest.fixture(scope="session")
def control_plane(tmp_path_factory):
    with _running_control_plane(tmp_path_factory.mktemp("controlplane")) as cp:
        yield cp


@pytest.fixture(scope="session")
def kubeconfig(control_plane) -> str:
    return str(control_plane.kubeconfig)


@pytest.fixture(scope="session")
def kube_api(kubeconfig):
    from kubernetes import config

    api = config.new_client_from_config(config_file=kubeconfig)
    yield api
    api.close()


@pytest.fixture(scope="session")
def kubectl(control_plane):
    def run(*args, check: bool = False, input: str | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
        return control_plane.kubectl(*args, check=check, input=input, timeout=timeout)

    return run


@pytest.fixture
def namespace(request, kubectl):
    base = re.sub(r"[^a-z0-9-]+", "-", request.node.name.lower()).strip("-")[:40].strip("-") or "test"
    name = f"{base}-{uuid.uuid4().hex[:6]}"
    kubectl("create", "namespace", name, check=True)
    # Pods can only be created once the serviceaccount controller has made `default`.
    deadline = time.monotonic() + 90  # generous: a loaded 2-core machine
    while kubectl("get", "serviceaccount", "default", "-n", name).returncode != 0:
        assert time.monotonic() < deadline, f"serviceaccount default never appeared in namespace {name}"
        time.sleep(0.2)
    yield name
    kubectl("delete", "namespace", name, "--wait=false", "--ignore-not-found")
