"""`helm lint` and `helm template` of charts/tpufinetune-operator: what the chart renders."""
from __future__ import annotations

import json
import re

import pytest
import yaml

from tests.chart.helmlib import CHART, RELEASE, RELEASE_NAMESPACE, run_helm

FULLNAME = f"{RELEASE}-tpufinetune-operator"

NAMESPACED_VALUES = {
    "watchNamespaces": ["team-a", "team-b"],
    "logLevel": "debug",
    "metrics": {"enabled": True, "port": 9191, "service": {"enabled": True},
                "serviceMonitor": {"enabled": True, "labels": {"release": "prom"}, "interval": "15s"}},
    "image": {"repository": "example.com/tpuft/operator", "tag": "1.2.3", "pullPolicy": "Always"},
    "imagePullSecrets": [{"name": "regcred"}],
    "nodeSelector": {"kubernetes.io/os": "linux"},
    "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "ops", "effect": "NoSchedule"}],
    "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["system"]}]}]}}},
    "priorityClassName": "system-cluster-critical",
    "podAnnotations": {"example.com/a": "b"},
    "podLabels": {"team": "ml"},
    "serviceAccount": {"name": "custom-sa", "annotations": {"iam.gke.io/gcp-service-account": "op@p.iam.gserviceaccount.com"}},
}


# --- lint --------------------------------------------------------------------------------

@pytest.mark.parametrize("values", [None, NAMESPACED_VALUES], ids=["defaults", "namespaced-metrics"])
def test_helm_lint_strict(helm, tmp_path, values):
    args = ["lint", "--strict", str(CHART), "--namespace", RELEASE_NAMESPACE]
    if values:
        f = tmp_path / "v.yaml"
        f.write_text(yaml.safe_dump(values))
        args += ["--values", str(f)]
    proc = run_helm(helm, *args)
    assert "0 chart(s) failed" in proc.stdout, proc.stdout


# Kubernetes-native objects in values.yaml: their fields are Kubernetes' own and the
# comment on the parent key documents the block.
NATIVE_BLOCKS = {"resources", "livenessProbe", "readinessProbe", "podSecurityContext", "securityContext"}


def test_every_values_key_is_documented():
    """Each key in values.yaml has its own comment (the line above, or inline), except the
    fields inside Kubernetes-native blocks, which the block's comment covers."""
    lines = (CHART / "values.yaml").read_text().splitlines()
    undocumented = []
    parents: list[tuple[int, str]] = []  # (indent, key) of the enclosing keys
    for i, line in enumerate(lines):
        m = re.match(r"^(\s*)([A-Za-z][\w.-]*):", line)
        if not m:
            continue
        indent, key = len(m.group(1)), m.group(2)
        while parents and parents[-1][0] >= indent:
            parents.pop()
        prev = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        documented = prev.startswith("#") or "#" in line.split(":", 1)[1]
        in_native = any(p in NATIVE_BLOCKS for _, p in parents)
        if not documented and not in_native:
            undocumented.append(".".join([p for _, p in parents] + [key]))
        parents.append((indent, key))
    assert not undocumented, f"values.yaml keys without a comment: {undocumented}"


# --- default values: cluster-wide ------------------------------------------------------

def test_defaults_render_expected_objects(render):
    objs = render()
    kinds = sorted((o["kind"], o["metadata"]["name"]) for o in objs)
    assert kinds == sorted([
        ("ServiceAccount", FULLNAME),
        ("ClusterRole", FULLNAME),
        ("ClusterRoleBinding", FULLNAME),
        ("ClusterRole", f"{FULLNAME}-framework"),
        ("ClusterRoleBinding", f"{FULLNAME}-framework"),
        ("Deployment", FULLNAME),
    ])
    assert not objs.kinds("Role") and not objs.kinds("RoleBinding")
    assert not objs.kinds("Service") and not objs.kinds("ServiceMonitor")
    for o in objs:
        if o["kind"] not in ("ClusterRole", "ClusterRoleBinding"):
            assert o["metadata"]["namespace"] == RELEASE_NAMESPACE, o["metadata"]


def test_deployment_single_replica_recreate(render):
    d = render().deployment
    assert d["spec"]["replicas"] == 1
    assert d["spec"]["strategy"] == {"type": "Recreate"}
    sel = d["spec"]["selector"]["matchLabels"]
    labels = d["spec"]["template"]["metadata"]["labels"]
    assert sel.items() <= labels.items()


def test_deployment_security_context(render):
    objs = render()
    pod = objs.deployment["spec"]["template"]["spec"]
    c = objs.container
    psc, csc = pod["securityContext"], c["securityContext"]
    assert psc["runAsNonRoot"] is True
    assert psc["runAsUser"] == 65532 and psc["runAsGroup"] == 65532
    assert psc["seccompProfile"] == {"type": "RuntimeDefault"}
    assert csc["runAsNonRoot"] is True
    assert csc["readOnlyRootFilesystem"] is True
    assert csc["allowPrivilegeEscalation"] is False
    assert csc["privileged"] is False
    assert csc["capabilities"] == {"drop": ["ALL"]}
    assert csc["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["automountServiceAccountToken"] is True
    assert pod["serviceAccountName"] == FULLNAME
    # read-only root: /tmp is an emptyDir
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    vols = {v["name"]: v for v in pod["volumes"]}
    assert "emptyDir" in vols[mounts["/tmp"]]
    assert "hostNetwork" not in pod and "hostPID" not in pod


def test_deployment_probes_hit_kopf_liveness(render):
    c = render().container
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports["healthz"] == 8080
    for probe in ("livenessProbe", "readinessProbe"):
        get = c[probe]["httpGet"]
        assert get["path"] == "/healthz"
        assert get["port"] in ("healthz", 8080)
        assert c[probe]["periodSeconds"] > 0


def test_deployment_args_cluster_wide(render):
    c = render().container
    assert c["args"] == ["--all-namespaces"]
    assert "command" not in c, "the image's ENTRYPOINT (kopf run --standalone ...) must stay in charge"
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["TPUFT_LOG_LEVEL"] == "INFO"
    assert env["TPUFT_METRICS_PORT"] == "9090"
    assert c["image"] == "ghcr.io/tpufinetune/tpufinetune-operator:0.1.0"
    assert {p["name"]: p["containerPort"] for p in c["ports"]}["metrics"] == 9090


def test_metrics_disabled_sets_port_zero(render):
    c = render({"metrics": {"enabled": False}}).container
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["TPUFT_METRICS_PORT"] == "0"
    assert "metrics" not in {p["name"] for p in c["ports"]}


@pytest.mark.parametrize("level,flag", [("debug", ["--debug"]), ("info", []), ("warning", ["--quiet"])])
def test_log_level(render, level, flag):
    c = render({"logLevel": level}).container
    assert c["args"] == ["--all-namespaces", *flag]
    assert {e["name"]: e.get("value") for e in c["env"]}["TPUFT_LOG_LEVEL"] == level.upper()


def test_crds_included_only_with_include_crds(render):
    assert not render().kinds("CustomResourceDefinition")
    crd = render(None, "--include-crds").one("CustomResourceDefinition")
    assert crd["metadata"]["name"] == "tpufinetunes.tpufinetune.dev"
    assert crd["spec"]["names"]["shortNames"] == ["tft"]


# --- non-default values: namespaced, metrics on -----------------------------------------

def test_namespaced_mode_uses_roles(render):
    objs = render(NAMESPACED_VALUES)
    roles = objs.kinds("Role")
    bindings = objs.kinds("RoleBinding")
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["team-a", "team-b"]
    assert sorted(b["metadata"]["namespace"] for b in bindings) == ["team-a", "team-b"]
    for b in bindings:
        assert b["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": FULLNAME}
        assert b["subjects"] == [{"kind": "ServiceAccount", "name": "custom-sa", "namespace": RELEASE_NAMESPACE}]
    # The only cluster-scoped RBAC left is kopf's read-only framework role.
    assert [r["metadata"]["name"] for r in objs.kinds("ClusterRole")] == [f"{FULLNAME}-framework"]
    assert [b["roleRef"]["name"] for b in objs.kinds("ClusterRoleBinding")] == [f"{FULLNAME}-framework"]


def test_rbac_create_false_renders_no_rbac(render):
    objs = render({"rbac": {"create": False}})
    assert not [o for o in objs if o["kind"] in ("Role", "RoleBinding", "ClusterRole", "ClusterRoleBinding")]


def test_namespaced_args_and_settings(render):
    objs = render(NAMESPACED_VALUES)
    d = objs.deployment
    pod = d["spec"]["template"]["spec"]
    c = objs.container
    assert c["args"] == ["--namespace=team-a", "--namespace=team-b", "--debug"]
    assert "--all-namespaces" not in c["args"]
    assert d["spec"]["strategy"] == {"type": "Recreate"}
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["TPUFT_LOG_LEVEL"] == "DEBUG"
    assert env["TPUFT_METRICS_PORT"] == "9191"
    assert c["image"] == "example.com/tpuft/operator:1.2.3"
    assert c["imagePullPolicy"] == "Always"
    assert pod["imagePullSecrets"] == [{"name": "regcred"}]
    assert pod["nodeSelector"] == NAMESPACED_VALUES["nodeSelector"]
    assert pod["tolerations"] == NAMESPACED_VALUES["tolerations"]
    assert pod["affinity"] == NAMESPACED_VALUES["affinity"]
    assert pod["priorityClassName"] == "system-cluster-critical"
    assert pod["serviceAccountName"] == "custom-sa"
    meta = d["spec"]["template"]["metadata"]
    assert meta["annotations"] == {"example.com/a": "b"}
    assert meta["labels"]["team"] == "ml"
    assert "team" not in d["spec"]["selector"]["matchLabels"]
    sa = objs.one("ServiceAccount")
    assert sa["metadata"]["name"] == "custom-sa"
    assert sa["metadata"]["annotations"] == NAMESPACED_VALUES["serviceAccount"]["annotations"]


def test_metrics_service_and_servicemonitor(render):
    objs = render(NAMESPACED_VALUES)
    svc = objs.one("Service")
    assert svc["metadata"]["name"] == f"{FULLNAME}-metrics"
    assert svc["spec"]["ports"] == [{"name": "metrics", "port": 9090, "targetPort": "metrics", "protocol": "TCP"}]
    pod_labels = objs.deployment["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    sm = objs.one("ServiceMonitor")
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    assert sm["metadata"]["labels"]["release"] == "prom"
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert sm["spec"]["namespaceSelector"] == {"matchNames": [RELEASE_NAMESPACE]}
    assert sm["spec"]["endpoints"] == [{"port": "metrics", "path": "/metrics", "interval": "15s", "scrapeTimeout": "10s"}]
    ports = {p["name"]: p["containerPort"] for p in objs.container["ports"]}
    assert ports["metrics"] == 9191


def test_servicemonitor_alone_brings_its_service(render):
    objs = render({"metrics": {"serviceMonitor": {"enabled": True}}})
    assert objs.one("Service") and objs.one("ServiceMonitor")


def test_workload_pod_monitor_and_dashboard(render):
    """The training runs' gauges: a PodMonitor on the Ray pods of TPUFinetunes in the watched
    namespaces (every namespace cluster-wide), and the dashboard JSON verbatim in a ConfigMap."""
    on = {"workloadMetrics": {"podMonitor": {"enabled": True, "labels": {"release": "prom"}},
                              "grafanaDashboard": {"enabled": True}}}
    objs = render(on)
    pm = objs.one("PodMonitor")
    assert pm["apiVersion"] == "monitoring.coreos.com/v1" and pm["metadata"]["labels"]["release"] == "prom"
    assert pm["spec"]["namespaceSelector"] == {"any": True}
    assert pm["spec"]["selector"] == {"matchExpressions": [
        {"key": "tpufinetune.dev/name", "operator": "Exists"}, {"key": "ray.io/node-type", "operator": "Exists"}]}
    assert pm["spec"]["podMetricsEndpoints"] == [{"port": "metrics", "path": "/metrics", "interval": "30s",
                                                  "scrapeTimeout": "10s"}]
    cm = objs.one("ConfigMap", f"{FULLNAME}-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(cm["data"]["tpufinetune.json"]) == json.loads((CHART / "dashboards" / "tpufinetune.json").read_text())
    namespaced = render({**on, "watchNamespaces": ["team-a", "team-b"]}).one("PodMonitor")
    assert namespaced["spec"]["namespaceSelector"] == {"matchNames": ["team-a", "team-b"]}
    assert not render().kinds("PodMonitor") and not render().kinds("ConfigMap")   # off by default


BAD_VALUES = [
    # (values, message from values.schema.json, message from the templates' own checks or None)
    ({"watchNamespaces": ["Team_A"]}, "does not match pattern", "not a valid namespace name"),
    ({"watchNamespaces": ["a", "a"]}, "are equal", "listed twice"),
    ({"logLevel": "trace"}, "value must be one of", "logLevel must be one of"),
    ({"watchNamespace": ["a"]}, "additional properties 'watchNamespace' not allowed", None),
    ({"metrics": {"port": 8080}}, "/metrics/port", None),
    ({"image": {"pullPolicy": "Sometimes"}}, "/image/pullPolicy", None),
    ({"metrics": {"enabled": False, "service": {"enabled": True}}}, None, "need metrics.enabled=true"),
    ({"serviceAccount": {"create": False, "name": ""}}, None, "serviceAccount.name is required"),
]


@pytest.mark.parametrize("values,schema_msg,template_msg", BAD_VALUES,
                         ids=[json.dumps(v, separators=(",", ":")) for v, _, _ in BAD_VALUES])
def test_bad_values_fail_with_a_message(helm, tmp_path, values, schema_msg, template_msg):
    f = tmp_path / "v.yaml"
    f.write_text(yaml.safe_dump(values))
    proc = run_helm(helm, "template", RELEASE, str(CHART), "--values", str(f), check=False)
    assert proc.returncode != 0
    assert (schema_msg or template_msg) in proc.stderr, proc.stderr
    if template_msg:
        # the templates check too, for tools that skip the values schema
        proc = run_helm(helm, "template", RELEASE, str(CHART), "--values", str(f), "--skip-schema-validation",
                        check=False)
        assert proc.returncode != 0 and template_msg in proc.stderr, proc.stderr


def test_values_schema_covers_every_top_level_key():
    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert set(values) <= set(schema["properties"])
    assert schema["additionalProperties"] is False
