"""Every RBAC rule the chart renders: no wildcards, nothing on Secrets, and exactly the
(apiGroup, resource, verb) set the operator needs, in both install modes."""
from __future__ import annotations

import itertools

import pytest

from tests.chart.helmlib import RELEASE, rbac_rules

FULLNAME = f"{RELEASE}-tpufinetune-operator"

# What the operator (handlers + kopf) does, per namespace it serves.
APPLICATION = {
    # its own CR: read only (no annotations, no finalizers, spec belongs to the user)
    ("tpufinetune.dev", "tpufinetunes"): {"get", "list", "watch"},
    # status; also granted onwards (get, patch) to each CR's workload ServiceAccount
    ("tpufinetune.dev", "tpufinetunes/status"): {"get", "patch"},
    # KubeRay children
    ("ray.io", "rayclusters"): {"get", "list", "watch", "create", "patch", "delete"},
    ("ray.io", "rayjobs"): {"get", "list", "watch", "create", "patch", "delete"},
    # the RayService serving the model (spec.serve): created, deleted, never patched
    ("ray.io", "rayservices"): {"get", "list", "watch", "create", "delete"},
    # events from kopf (core v1) and the handlers (either API)
    ("", "events"): {"create", "patch"},
    # a RayCluster's pods while its slice comes up (tpuft.controller.diagnosis; leftovers of a deleted object)
    ("", "pods"): {"list", "watch"},   # and watched: a lost host seen at once (tpuft.controller.hosts)
    ("events.k8s.io", "events"): {"create", "patch"},
    # per-CR workload identity (ServiceAccount + Role + RoleBinding)
    ("", "serviceaccounts"): {"get", "list", "watch", "create", "patch"},
    ("rbac.authorization.k8s.io", "roles"): {"get", "list", "watch", "create", "patch"},
    ("rbac.authorization.k8s.io", "rolebindings"): {"get", "list", "watch", "create", "patch"},
    # per-CR NetworkPolicy: created once, adopted (get) on a conflict, never patched or listed
    ("networking.k8s.io", "networkpolicies"): {"get", "create"},
    # Kueue's Workload of a queued RayCluster (its words in status): listed by job-uid label only
    ("kueue.x-k8s.io", "workloads"): {"list"},
    # Kueue's ProvisioningRequests (GKE flex-start), listed once Kueue rejects a queued run's check
    ("autoscaling.x-k8s.io", "provisioningrequests"): {"list"},
}
# kopf's own cluster-scoped needs (--standalone: no kopfpeerings).
FRAMEWORK = {
    ("apiextensions.k8s.io", "customresourcedefinitions"): {"list", "watch"},
}
FRAMEWORK_CLUSTER_WIDE = {
    **FRAMEWORK,
    ("", "nodes"): {"list", "watch"},   # rbac.nodePoolHints (default on): TPU node pools; a node lost or noticed
}
FRAMEWORK_NAMESPACED = {
    **FRAMEWORK,
    ("", "namespaces"): {"list", "watch"},
}

MODES = {
    "cluster-wide": {},
    "namespaced": {"watchNamespaces": ["team-a", "team-b"]},
    "metrics-on": {"metrics": {"service": {"enabled": True}, "serviceMonitor": {"enabled": True}}},
}


def flatten(rules: list[dict]) -> dict[tuple[str, str], set[str]]:
    out: dict[tuple[str, str], set[str]] = {}
    for r in rules:
        assert set(r) <= {"apiGroups", "resources", "verbs", "resourceNames"}, r
        assert "nonResourceURLs" not in r
        for g, res in itertools.product(r["apiGroups"], r["resources"]):
            out.setdefault((g, res), set()).update(r["verbs"])
    return out


@pytest.mark.parametrize("mode", MODES)
def test_no_wildcards_no_secrets_no_escalation(render, mode):
    objs = render(MODES[mode])
    rules = rbac_rules(objs)
    assert rules, "no RBAC rendered"
    for key, rs in rules.items():
        for r in rs:
            for field in ("apiGroups", "resources", "verbs", "resourceNames"):
                for item in r.get(field, []):
                    assert "*" not in item, f"wildcard in {key}: {r}"
            for res in r["resources"]:
                assert res.split("/")[0] not in {"secrets", "configmaps"}, f"{key}: {r}"
                if res.startswith("nodes"):   # node pool hints, lost nodes, maintenance notices: read, never touch
                    assert res == "nodes" and set(r["verbs"]) == {"list", "watch"}, f"{key}: {r}"
                if res.startswith("pods"):   # read, never touch, never exec
                    assert res == "pods" and set(r["verbs"]) == {"list", "watch"}, f"{key}: {r}"
            # verbs that would let it grant or impersonate beyond what it holds
            assert not {"escalate", "bind", "impersonate"} & set(r["verbs"]), f"{key}: {r}"
            # no blanket update/delete on its own CR (spec belongs to the user / GitOps)
            if "tpufinetunes" in r["resources"]:
                assert not {"update", "delete", "create", "deletecollection"} & set(r["verbs"]), r


def test_cluster_wide_exact_rules(render):
    rules = rbac_rules(render())
    assert set(rules) == {("ClusterRole", FULLNAME, ""), ("ClusterRole", f"{FULLNAME}-framework", "")}
    assert flatten(rules[("ClusterRole", FULLNAME, "")]) == APPLICATION
    assert flatten(rules[("ClusterRole", f"{FULLNAME}-framework", "")]) == FRAMEWORK_CLUSTER_WIDE


def test_node_pool_hints_can_be_turned_off(render):
    rules = rbac_rules(render({"rbac": {"nodePoolHints": False}}))
    assert flatten(rules[("ClusterRole", f"{FULLNAME}-framework", "")]) == FRAMEWORK


def test_namespaced_exact_rules(render):
    rules = rbac_rules(render(MODES["namespaced"]))
    assert set(rules) == {
        ("Role", FULLNAME, "team-a"),
        ("Role", FULLNAME, "team-b"),
        ("ClusterRole", f"{FULLNAME}-framework", ""),
    }
    assert flatten(rules[("Role", FULLNAME, "team-a")]) == APPLICATION
    assert flatten(rules[("Role", FULLNAME, "team-b")]) == APPLICATION
    assert flatten(rules[("ClusterRole", f"{FULLNAME}-framework", "")]) == FRAMEWORK_NAMESPACED


def test_operator_holds_what_it_grants_to_workloads(render):
    """RBAC escalation prevention: the operator can create a Role granting get+patch on
    tpufinetunes/status only if it holds those itself, in the same scope."""
    for mode in ("cluster-wide", "namespaced"):
        for key, rs in rbac_rules(render(MODES[mode])).items():
            if key[1] != FULLNAME:
                continue
            flat = flatten(rs)
            assert {"get", "patch"} <= flat[("tpufinetune.dev", "tpufinetunes/status")]
            assert {"create", "patch"} <= flat[("rbac.authorization.k8s.io", "roles")]
            assert {"create", "patch"} <= flat[("rbac.authorization.k8s.io", "rolebindings")]


def test_bindings_point_at_the_operator_service_account(render):
    for mode, values in MODES.items():
        objs = render(values)
        sa = objs.one("ServiceAccount")["metadata"]
        for b in objs.kinds("RoleBinding") + objs.kinds("ClusterRoleBinding"):
            assert b["subjects"] == [{"kind": "ServiceAccount", "name": sa["name"], "namespace": sa["namespace"]}], mode
            target = objs.one(b["roleRef"]["kind"], b["roleRef"]["name"], b["metadata"].get("namespace"))
            assert target["metadata"]["name"] == b["metadata"]["name"]


def test_every_child_kind_the_operator_watches_is_granted_what_the_reconciler_does(render):
    """A child kind added to tpuft.controller.observed.CHILD_KINDS (a table row plus its builder) needs its RBAC
    row too: kopf lists and watches it for the index, the reconciler GETs what the index lacks,
    creates it and deletes it."""
    from tpuft.controller.observed import CHILD_KINDS

    granted = flatten(rbac_rules(render())[("ClusterRole", FULLNAME, "")])
    for kind in CHILD_KINDS:
        verbs = granted.get((kind.group, kind.plural), set())
        assert {"get", "list", "watch", "create", "delete"} <= verbs, (kind.kind, verbs)
