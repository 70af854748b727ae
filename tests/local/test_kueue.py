"""tpuft_local.kueue, pure: Kueue's Configuration for the host process, its webhooks pointed at
it (only the kept ones), and the queue objects `tpuft cluster up` makes (one slice of quota per
TPU pool, flavors with the pools' own node labels)."""
from __future__ import annotations

import base64

import yaml

from tpuft.api import gke
from tpuft_local import kueue, pools


def test_configuration_enables_the_ray_integrations_and_our_webhook_listener(tmp_path):
    cfg = kueue.configuration("10.0.0.1", 9443, tmp_path, 8081)
    assert cfg["integrations"]["frameworks"] == ["ray.io/raycluster", "ray.io/rayjob"]
    assert cfg["webhook"] == {"host": "10.0.0.1", "port": 9443, "certDir": str(tmp_path)}
    assert cfg["internalCertManagement"] == {"enable": False} and cfg["leaderElection"] == {"leaderElect": False}
    assert cfg["manageJobsWithoutQueueName"] is False   # unlabelled RayJobs and RayClusters are left alone
    assert cfg["health"]["healthProbeBindAddress"].startswith("127.0.0.1:")


MANIFESTS = """
apiVersion: admissionregistration.k8s.io/v1
kind: MutatingWebhookConfiguration
metadata: {name: mutating-webhook-configuration}
webhooks:
- {name: mjob.kb.io, clientConfig: {service: {name: webhook-service, namespace: system, path: /mutate-batch-v1-job}},
   admissionReviewVersions: [v1], sideEffects: None, failurePolicy: Fail}
- {name: mraycluster.kb.io, clientConfig: {service: {name: webhook-service, namespace: system,
   path: /mutate-ray-io-v1-raycluster}}, admissionReviewVersions: [v1], sideEffects: None, failurePolicy: Fail}
- {name: mrayservice.kb.io, clientConfig: {service: {name: webhook-service, namespace: system,
   path: /mutate-ray-io-v1-rayservice}}, admissionReviewVersions: [v1], sideEffects: None, failurePolicy: Fail}
---
apiVersion: admissionregistration.k8s.io/v1
kind: ValidatingWebhookConfiguration
metadata: {name: validating-webhook-configuration}
webhooks:
- {name: vworkload.kb.io, clientConfig: {service: {name: webhook-service, namespace: system,
   path: /validate-kueue-x-k8s-io-v1beta2-workload}}, admissionReviewVersions: [v1], sideEffects: None}
- {name: vpod.kb.io, clientConfig: {service: {name: webhook-service, namespace: system, path: /validate--v1-pod}},
   admissionReviewVersions: [v1], sideEffects: None}
"""


def test_only_kueues_own_and_rays_webhooks_are_kept_each_sent_to_the_host_process(tmp_path):
    manifests = tmp_path / "manifests.yaml"
    manifests.write_text(MANIFESTS)
    mutating, validating = kueue.webhook_configurations(manifests, "https://10.0.0.1:9443", b"CA")
    # batch/Job, Pod and RayService are not integrations here: their webhooks would refuse every Job
    assert [h["name"] for h in mutating["webhooks"]] == ["mraycluster.kb.io"]
    assert [h["name"] for h in validating["webhooks"]] == ["vworkload.kb.io"]
    hook = mutating["webhooks"][0]
    assert hook["clientConfig"] == {"url": "https://10.0.0.1:9443/mutate-ray-io-v1-raycluster",
                                    "caBundle": base64.b64encode(b"CA").decode()}
    assert hook["failurePolicy"] == "Fail" and mutating["metadata"]["name"].startswith("tpuft-kueue-")


def test_the_cluster_queue_holds_exactly_one_slice_of_each_tpu_pool():
    objs = kueue.queue_objects(pools.DEFAULT_POOLS, "tpuft-demo")
    by_kind = {}
    for o in objs:
        by_kind.setdefault(o["kind"], []).append(o)
    cq = by_kind["ClusterQueue"][0]
    assert cq["metadata"]["name"] == "local" and cq["spec"]["preemption"] == {"withinClusterQueue": "LowerPriority"}
    group = cq["spec"]["resourceGroups"][0]
    tpu = {f["name"]: next(r["nominalQuota"] for r in f["resources"] if r["name"] == gke.TPU_RESOURCE)
           for f in group["flavors"]}
    assert tpu == {"cpu": 0, "v6e-4x4": 16, "tpu7x-2x2x2": 8}
    assert [f["name"] for f in group["flavors"]][0] == "cpu"   # a head (no chips) takes the CPU flavor first
    flavors = {f["metadata"]["name"]: f["spec"] for f in by_kind["ResourceFlavor"]}
    for pool in pools.DEFAULT_POOLS:
        assert flavors[pool.name]["nodeLabels"] == dict(pool.slice.node_selector)   # one source: the catalog
        assert flavors[pool.name]["tolerations"][0]["key"] == gke.TPU_RESOURCE
    assert flavors["cpu"] == {}   # no node labels: CPU pods are placed as without Kueue
    lq = by_kind["LocalQueue"][0]
    assert (lq["metadata"]["namespace"], lq["spec"]["clusterQueue"]) == ("tpuft-demo", "local")
    yaml.safe_dump_all(objs)   # plain data


def test_a_tpu_flavors_cpu_and_memory_cover_its_pools_hosts():
    pool = pools.DEFAULT_POOLS[0]
    node = pools.tpu_nodes(pool)[0]["status"]["allocatable"]
    cq = next(o for o in kueue.queue_objects([pool]) if o["kind"] == "ClusterQueue")
    flavor = next(f for f in cq["spec"]["resourceGroups"][0]["flavors"] if f["name"] == pool.name)
    got = {r["name"]: r["nominalQuota"] for r in flavor["resources"]}
    hosts = pool.slice.hosts
    assert got["cpu"] == f"{int(node['cpu'][:-1]) * hosts}m" and got["memory"] == f"{int(node['memory'][:-2]) * hosts}Mi"


def test_the_charts_gke_example_has_the_local_queues_shape_and_the_catalogs_labels():
    from tests.paths import REPO
    docs = list(yaml.safe_load_all((REPO / "charts" / "tpufinetune-operator" / "kueue" / "gke-queues.yaml").read_text()))
    local = {o["kind"]: o for o in kueue.queue_objects([pools.DEFAULT_POOLS[0]])}
    flavor = next(d for d in docs if d["kind"] == "ResourceFlavor" and d["metadata"]["name"] == "v6e-4x4")
    assert flavor["spec"]["nodeLabels"] == dict(pools.DEFAULT_POOLS[0].slice.node_selector)
    cq = next(d for d in docs if d["kind"] == "ClusterQueue")
    group, local_group = cq["spec"]["resourceGroups"][0], local["ClusterQueue"]["spec"]["resourceGroups"][0]
    assert group["coveredResources"] == local_group["coveredResources"]
    assert [f["name"] for f in group["flavors"]] == [f["name"] for f in local_group["flavors"]]
    assert cq["spec"]["preemption"] == local["ClusterQueue"]["spec"]["preemption"]
    chips = next(r for r in group["flavors"][1]["resources"] if r["name"] == gke.TPU_RESOURCE)["nominalQuota"]
    assert chips == pools.DEFAULT_POOLS[0].slice.chips_per_host * pools.DEFAULT_POOLS[0].slice.hosts   # one slice


def test_kueue_runs_with_a_private_etc_holding_its_metrics_cert_path(tmp_path):
    argv = kueue.private_etc(tmp_path / "etc", tmp_path / "certs")
    assert argv[:5] == ["unshare", "--mount", "--propagation", "private", "--"]
    script = argv[-1]
    assert f"upperdir={tmp_path / 'etc' / 'upper'}" in script and "lowerdir=/etc" in script
    assert f"ln -sfn {tmp_path / 'certs'} {kueue.METRICS_CERT_DIR}" in script and script.endswith('exec "$0" "$@"')


def test_rbac_is_kueues_own_roles_bound_to_its_user(tmp_path):
    (tmp_path / "role.yaml").write_text(yaml.safe_dump({
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole", "metadata": {"name": "manager-role"},
        "rules": [{"apiGroups": ["ray.io"], "resources": ["rayclusters"], "verbs": ["get", "update"]}]}))
    (tmp_path / "manager_secrets_role.yaml").write_text(yaml.safe_dump({
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
        "metadata": {"name": "manager-secrets-role", "namespace": "system"},
        "rules": [{"apiGroups": [""], "resources": ["secrets"], "verbs": ["get", "list", "watch", "update"]}]}))
    role, binding, secrets, secrets_binding = kueue.rbac(tmp_path)
    assert role["rules"][0]["resources"] == ["rayclusters"] and role["kind"] == "ClusterRole"
    assert secrets["kind"] == "Role" and secrets["metadata"]["namespace"] == kueue.NAMESPACE   # only its own namespace
    for b, r in ((binding, role), (secrets_binding, secrets)):
        assert b["roleRef"]["name"] == r["metadata"]["name"] and b["subjects"][0]["name"] == kueue.USER


def _kinds(objs: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for o in objs:
        out.setdefault(o["kind"], []).append(o)
    return out


def test_flex_start_is_a_provisioning_request_check_on_a_flavor_with_gkes_flex_start_labels():
    pool = pools.DEFAULT_POOLS[0]
    objs = _kinds(kueue.flex_start_objects(pool, "tpuft-demo"))
    flavor = objs["ResourceFlavor"][0]["spec"]
    assert flavor["nodeLabels"] == {**dict(pool.slice.node_selector), "cloud.google.com/gke-flex-start": "true"}
    assert {t["key"] for t in flavor["tolerations"]} == {"google.com/tpu", "cloud.google.com/gke-queued"}
    config = objs["ProvisioningRequestConfig"][0]["spec"]
    assert config == {"provisioningClassName": "queued-provisioning.gke.io", "managedResources": ["google.com/tpu"]}
    check = objs["AdmissionCheck"][0]
    assert check["spec"]["controllerName"] == "kueue.x-k8s.io/provisioning-request"
    assert check["spec"]["parameters"]["name"] == objs["ProvisioningRequestConfig"][0]["metadata"]["name"]
    cq = objs["ClusterQueue"][0]["spec"]
    assert cq["admissionChecksStrategy"]["admissionChecks"] == [
        {"name": check["metadata"]["name"], "onFlavors": [objs["ResourceFlavor"][0]["metadata"]["name"]]}]
    lq = objs["LocalQueue"][0]
    assert lq["spec"]["clusterQueue"] == objs["ClusterQueue"][0]["metadata"]["name"] == lq["metadata"]["name"]


def test_the_charts_gke_flex_start_example_has_the_local_shape():
    from tests.paths import REPO
    chart = _kinds(list(yaml.safe_load_all(
        (REPO / "charts" / "tpufinetune-operator" / "kueue" / "gke-flex-start.yaml").read_text())))
    pool = pools.DEFAULT_POOLS[0]
    local = _kinds(kueue.flex_start_objects(pool, "ml-team") + kueue.fallback_objects(pool, "ml-team"))
    for kind in ("ResourceFlavor", "ProvisioningRequestConfig", "AdmissionCheck", "LocalQueue"):
        assert [o["spec"] for o in chart[kind]] == [o["spec"] for o in local[kind]], kind
    assert [o["metadata"]["name"] for o in chart["ClusterQueue"]] == [kueue.FLEX_START, kueue.FALLBACK]
    for cq, local_cq in zip(chart["ClusterQueue"], local["ClusterQueue"], strict=True):   # flex-start, the fallback order
        assert cq["spec"]["admissionChecksStrategy"] == local_cq["spec"]["admissionChecksStrategy"]
        assert [f["name"] for f in cq["spec"]["resourceGroups"][0]["flavors"]] == \
            [f["name"] for f in local_cq["spec"]["resourceGroups"][0]["flavors"]]
    assert chart["Topology"][0]["spec"] == kueue.topology()["spec"]


def test_the_tas_queue_places_all_of_a_pools_slices_by_node_pool():
    pool = pools.DEFAULT_POOLS[0]   # v6e 4x4, two slices: two node pools
    objs = _kinds(kueue.tas_objects(pool, "tpuft-demo"))
    assert [lvl["nodeLabel"] for lvl in objs["Topology"][0]["spec"]["levels"]] == [
        "cloud.google.com/gke-nodepool", "kubernetes.io/hostname"]
    flavor = objs["ResourceFlavor"][0]["spec"]
    assert flavor["topologyName"] == objs["Topology"][0]["metadata"]["name"]
    assert flavor["nodeLabels"] == dict(pool.slice.node_selector)
    tpu = next(r["nominalQuota"] for r in objs["ClusterQueue"][0]["spec"]["resourceGroups"][0]["flavors"][1]["resources"]
               if r["name"] == gke.TPU_RESOURCE)
    assert tpu == pool.slice.chips_per_host * pool.slice.hosts * pool.slices
    assert {n["metadata"]["labels"][pools.POOL_LABEL] for n in pools.tpu_nodes(pool)} == {"v6e-4x4-0", "v6e-4x4-1"}
