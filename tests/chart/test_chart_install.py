"""`helm install` of the chart into the real local control plane (etcd + kube-apiserver +
kube-controller-manager from tests/conftest.py). No kubelet runs, so the operator pod never
starts: the assertions are on the objects the API server stored and on what RBAC lets the
operator's ServiceAccount do (`kubectl auth can-i`, and real creates while impersonating it).
"""
from __future__ import annotations

import json

import pytest
import yaml

from tests.chart.helmlib import CHART

pytestmark = pytest.mark.integration  # the real local control plane (tests/conftest.py)

CRD = "tpufinetunes.tpufinetune.dev"


def _install(helm_cli, tmp_path, release: str, ns: str, values: dict) -> str:
    """helm install; returns its output (which ends with the rendered NOTES.txt)."""
    f = tmp_path / f"{release}-values.yaml"
    f.write_text(yaml.safe_dump(values))
    return helm_cli("install", release, str(CHART), "--namespace", ns, "--values", str(f)).stdout


def can_i(kubectl, verb: str, resource: str, sa: str, ns: str | None, subresource: str | None = None) -> bool:
    args = ["auth", "can-i", verb, resource, f"--as={sa}"]
    args += ["-n", ns] if ns else ["--all-namespaces"]
    if subresource:
        args.append(f"--subresource={subresource}")
    proc = kubectl(*args)
    answer = proc.stdout.strip()
    assert answer in ("yes", "no"), f"kubectl {' '.join(args)}: {proc.stdout}{proc.stderr}"
    return answer == "yes"


def _get(kubectl, *args) -> dict:
    return json.loads(kubectl("get", *args, "-o", "json", check=True).stdout)


def _role_for_workload(ns: str, cr: str, extra_rule: dict | None = None) -> str:
    """The Role+RoleBinding the operator creates per TPUFinetune (workload identity)."""
    rules = [{"apiGroups": ["tpufinetune.dev"], "resources": ["tpufinetunes/status"],
              "resourceNames": [cr], "verbs": ["get", "patch"]}]
    if extra_rule:
        rules.append(extra_rule)
    docs = [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": f"{cr}-workload", "namespace": ns}},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
         "metadata": {"name": f"{cr}-workload", "namespace": ns}, "rules": rules},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
         "metadata": {"name": f"{cr}-workload", "namespace": ns},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": f"{cr}-workload"},
         "subjects": [{"kind": "ServiceAccount", "name": f"{cr}-workload", "namespace": ns}]},
    ]
    return yaml.safe_dump_all(docs)


def _assert_deployment(dep: dict, args: list[str]) -> None:
    spec = dep["spec"]
    assert spec["replicas"] == 1
    assert spec["strategy"]["type"] == "Recreate"
    pod = spec["template"]["spec"]
    assert pod["automountServiceAccountToken"] is True
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    (c,) = pod["containers"]
    assert c["args"] == args
    sc = c["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert sc["runAsNonRoot"] is True and sc["runAsUser"] == 65532
    for probe in ("livenessProbe", "readinessProbe"):
        assert c[probe]["httpGet"]["path"] == "/healthz"
    assert {p["name"]: p["containerPort"] for p in c["ports"]}["healthz"] == 8080
    assert any(m["mountPath"] == "/tmp" for m in c["volumeMounts"])


def test_install_cluster_wide(helm_cli, kubectl, namespace, extra_namespace, tmp_path):
    release = f"op-{namespace[-6:]}"
    out = _install(helm_cli, tmp_path, release, namespace, {})
    try:
        assert "kubectl get tft -n default -w" in out.split("NOTES:", 1)[1]
        fullname = f"{release}-tpufinetune-operator"
        _assert_deployment(_get(kubectl, "deployment", fullname, "-n", namespace), ["--all-namespaces"])
        assert _get(kubectl, "serviceaccount", fullname, "-n", namespace)["metadata"]["name"] == fullname
        assert _get(kubectl, "crd", CRD)["metadata"]["name"] == CRD

        sa = f"system:serviceaccount:{namespace}:{fullname}"
        other = extra_namespace("other")
        for ns in (namespace, other, None):
            assert not can_i(kubectl, "get", "secrets", sa, ns)
            assert not can_i(kubectl, "list", "secrets", sa, ns)
            assert not can_i(kubectl, "watch", "secrets", sa, ns)
            assert can_i(kubectl, "create", "rayclusters.ray.io", sa, ns)
            assert can_i(kubectl, "delete", "rayjobs.ray.io", sa, ns)
            assert can_i(kubectl, "watch", "tpufinetunes.tpufinetune.dev", sa, ns)
            assert can_i(kubectl, "patch", "tpufinetunes.tpufinetune.dev", sa, ns, subresource="status")
            assert not can_i(kubectl, "delete", "tpufinetunes.tpufinetune.dev", sa, ns)
            assert not can_i(kubectl, "update", "tpufinetunes.tpufinetune.dev", sa, ns)
            assert not can_i(kubectl, "patch", "tpufinetunes.tpufinetune.dev", sa, ns)  # spec/metadata are the user's
            assert not can_i(kubectl, "get", "configmaps", sa, ns)
            assert not can_i(kubectl, "create", "pods", sa, ns)
        assert can_i(kubectl, "watch", "customresourcedefinitions.apiextensions.k8s.io", sa, None)
        assert not can_i(kubectl, "create", "clusterroles.rbac.authorization.k8s.io", sa, None)
        assert not can_i(kubectl, "create", "clusterrolebindings.rbac.authorization.k8s.io", sa, None)
        assert not can_i(kubectl, "impersonate", "serviceaccounts", sa, other)

        # The per-CR workload identity: allowed, because the operator holds what it grants.
        kubectl("apply", "-f", "-", f"--as={sa}", "-n", other, input=_role_for_workload(other, "demo"), check=True)
        # ...but it cannot hand out anything it does not hold (RBAC escalation prevention).
        proc = kubectl("apply", "-f", "-", f"--as={sa}", "-n", other, input=_role_for_workload(
            other, "greedy", {"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"]}))
        assert proc.returncode != 0 and "not currently held" in proc.stderr, proc.stderr
    finally:
        helm_cli("uninstall", release, "--namespace", namespace, check=False)
    assert kubectl("get", "clusterrole", f"{release}-tpufinetune-operator").returncode != 0, "uninstall left RBAC"


def test_install_namespaced(helm_cli, kubectl, namespace, extra_namespace, tmp_path):
    team_a, team_b, outside = extra_namespace("a"), extra_namespace("b"), extra_namespace("x")
    release = f"op-{namespace[-6:]}"
    out = _install(helm_cli, tmp_path, release, namespace, {"watchNamespaces": [team_a, team_b], "logLevel": "warning"})
    try:
        notes = out.split("NOTES:", 1)[1]
        assert f"kubectl apply -n {team_a} -f examples/" in notes
        assert f"kubectl get tft -n {team_a} -w" in notes
        assert "argocd/health.lua" in notes
        fullname = f"{release}-tpufinetune-operator"
        _assert_deployment(_get(kubectl, "deployment", fullname, "-n", namespace),
                           [f"--namespace={team_a}", f"--namespace={team_b}", "--quiet"])
        for ns in (team_a, team_b):
            assert _get(kubectl, "role", fullname, "-n", ns)["rules"]
            assert _get(kubectl, "rolebinding", fullname, "-n", ns)["roleRef"]["kind"] == "Role"
        assert kubectl("get", "clusterrole", fullname).returncode != 0, "namespaced mode has no application ClusterRole"

        sa = f"system:serviceaccount:{namespace}:{fullname}"
        for ns in (team_a, team_b):
            assert can_i(kubectl, "create", "rayclusters.ray.io", sa, ns)
            assert can_i(kubectl, "patch", "tpufinetunes.tpufinetune.dev", sa, ns, subresource="status")
            assert not can_i(kubectl, "get", "secrets", sa, ns)
        for ns in (namespace, outside, None):
            assert not can_i(kubectl, "create", "rayclusters.ray.io", sa, ns)
            assert not can_i(kubectl, "get", "secrets", sa, ns)
            assert not can_i(kubectl, "list", "tpufinetunes.tpufinetune.dev", sa, ns)
        # kopf's read-only framework needs, cluster-wide
        assert can_i(kubectl, "list", "namespaces", sa, None)
        assert can_i(kubectl, "watch", "customresourcedefinitions.apiextensions.k8s.io", sa, None)
        assert not can_i(kubectl, "delete", "namespaces", sa, None)

        kubectl("apply", "-f", "-", f"--as={sa}", "-n", team_a, input=_role_for_workload(team_a, "demo"), check=True)
        proc = kubectl("apply", "-f", "-", f"--as={sa}", "-n", outside, input=_role_for_workload(outside, "demo"))
        assert proc.returncode != 0 and "forbidden" in proc.stderr.lower(), proc.stderr
    finally:
        helm_cli("uninstall", release, "--namespace", namespace, check=False)
