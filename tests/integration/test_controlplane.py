"""The local control plane is real: readyz, kubectl, RBAC, TokenRequest, garbage collection,
KubeRay CRDs with schema enforcement, and the `tpuft cluster` CLI lifecycle."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml

from tpuft_local import toolchain
from tests.paths import KUBERAY_REF
from tests.waiting import wait_until




def test_readyz_and_kubectl(control_plane, kubectl):
    assert control_plane.server_url.startswith("https://127.0.0.1:")
    assert kubectl("get", "--raw", "/readyz", check=True).stdout.strip() == "ok"
    version = json.loads(kubectl("version", "-o", "json", check=True).stdout)
    assert version["serverVersion"]["gitVersion"] == toolchain.K8S_VERSION
    assert "default" in kubectl("get", "namespaces", "-o", "name", check=True).stdout


def test_a_streaming_list_is_refused_at_once_so_clients_list_and_watch(kubectl):
    """etcd 3.5.1 cannot serve WatchList's streaming lists; the API server runs with the gate off
    (controlplane.APISERVER_FEATURE_GATES) and refuses one outright. With the gate on it accepted the
    watch and ended it with an error, and KWOK's client-go asked again and again: its simulated pods
    started and went 20-40 s late."""
    res = kubectl("get", "--raw", "/api/v1/namespaces/default/pods?watch=1&sendInitialEvents=true"
                  "&resourceVersionMatch=NotOlderThan&allowWatchBookmarks=true", timeout=30)
    assert res.returncode != 0 and "sendInitialEvents" in res.stderr, (res.stdout[-500:], res.stderr[-500:])


def test_all_tools_are_cached_and_run():
    paths = toolchain.ensure_tools()
    for tool, path in paths.items():
        assert os.access(path, os.X_OK), (tool, path)
    helm = subprocess.run([paths["helm"], "version", "--short"], capture_output=True, text=True)
    assert helm.returncode == 0 and helm.stdout.startswith(toolchain.HELM_VERSION), helm


def test_rbac_fresh_serviceaccount_cannot_list_secrets(namespace, kubectl):
    kubectl("create", "serviceaccount", "sa", "-n", namespace, check=True)
    as_sa = f"--as=system:serviceaccount:{namespace}:sa"
    res = kubectl("auth", "can-i", "list", "secrets", "-n", namespace, as_sa)
    assert (res.returncode, res.stdout.strip()) == (1, "no"), res
    assert kubectl("auth", "can-i", "list", "secrets", "-n", namespace).stdout.strip() == "yes"
    # A Role + RoleBinding grants it: RBAC is really evaluated.
    kubectl("create", "role", "read-secrets", "--verb=list", "--resource=secrets", "-n", namespace, check=True)
    kubectl("create", "rolebinding", "sa-reads", "--role=read-secrets", f"--serviceaccount={namespace}:sa",
            "-n", namespace, check=True)
    wait_until(lambda: kubectl("auth", "can-i", "list", "secrets", "-n", namespace, as_sa).returncode == 0,
               timeout=30, what="the RoleBinding to take effect")


def test_serviceaccount_token_authenticates(namespace, kubectl, control_plane, tmp_path):
    kubectl("create", "serviceaccount", "robot", "-n", namespace, check=True)
    token = kubectl("create", "token", "robot", "-n", namespace, "--duration=10m", check=True).stdout.strip()
    assert token.count(".") == 2  # a JWT from the TokenRequest API
    # A kubeconfig carrying only the token (no admin client cert).
    kc = tmp_path / "robot.kubeconfig"
    kc.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "c", "cluster": {"server": control_plane.server_url,
                                               "certificate-authority": str(control_plane.pki / "ca.crt")}}],
        "users": [{"name": "robot", "user": {"token": token}}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "robot"}}]}))
    who = kubectl(f"--kubeconfig={kc}", "auth", "whoami", "-o", "json", check=True)
    assert json.loads(who.stdout)["status"]["userInfo"]["username"] == f"system:serviceaccount:{namespace}:robot"
    denied = kubectl(f"--kubeconfig={kc}", "get", "secrets", "-n", namespace)
    assert denied.returncode != 0 and "forbidden" in denied.stderr.lower(), denied


def test_garbage_collection_deletes_dependents(namespace, kube_api):
    from kubernetes import client
    from kubernetes.client.rest import ApiException

    core = client.CoreV1Api(kube_api)
    owner = core.create_namespaced_config_map(namespace, {"metadata": {"name": "owner"}})
    ref = {"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": owner.metadata.uid}
    core.create_namespaced_config_map(namespace, {"metadata": {"name": "child", "ownerReferences": [ref]}})
    core.delete_namespaced_config_map("owner", namespace)

    def child_gone():
        try:
            core.read_namespaced_config_map("child", namespace)
            return False
        except ApiException as e:
            assert e.status == 404, e
            return True

    wait_until(child_gone, timeout=60, what="the garbage collector to delete the dependent ConfigMap")


def test_kuberay_crds_established(kubectl):
    for crd in ("rayclusters.ray.io", "rayjobs.ray.io"):
        res = kubectl("get", "crd", crd, "-o", 'jsonpath={.status.conditions[?(@.type=="Established")].status}')
        assert res.stdout == "True", res


def test_raycluster_sample_accepted_by_server_dry_run(namespace, kubectl):
    sample = KUBERAY_REF / "sample.ray-cluster.tpu-v6e-16-multihost.yaml"
    res = kubectl("apply", "--dry-run=server", "-n", namespace, "-f", str(sample))
    assert res.returncode == 0, res.stderr
    assert "created (server dry run)" in res.stdout
    # ...and the schema is really enforced: a malformed one is rejected.
    bad = yaml.safe_load(sample.read_text())
    bad["spec"]["workerGroupSpecs"][0]["replicas"] = "sixteen"
    res = kubectl("apply", "--dry-run=server", "-n", namespace, "-f", "-", input=yaml.safe_dump(bad))
    assert res.returncode != 0 and "replicas" in res.stderr, res


@pytest.mark.parametrize("tool", ["kubectl", "helm"])
def test_cli_path_prints_binary(tool):
    res = subprocess.run([sys.executable, "-m", "tpuft.cli", "cluster", "path", tool],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and res.stdout.strip() == toolchain.tool_path(tool), res
