"""Pure translation: golden files per example, GKE's tutorial manifests, KubeRay's own schemas,
and one focused test per option."""

import copy
import functools
import json
import shlex

import jsonschema
import pytest
import yaml

from tests.paths import EXAMPLES, GOLDEN, NETWORK_POLICY_OPENAPI, kuberay_crd
from tests.gke_tutorial import missing_from, tutorial_rayclusters
from tests.factories import MINIMUM, with_
from tpuft.controller import builders
from tpuft.api import catalog
from tpuft.api.constants import SERVE_API_KEY_ENV, SERVE_DEPLOYMENT_NAME, ServeArg
from tpuft.api.spec import parse

EXAMPLE_FILES = sorted(EXAMPLES.glob("*.yaml"))


def render(doc) -> list[dict]:
    return builders.build_children(parse(doc))


def example_docs(path) -> list[dict]:
    """An example's TPUFinetunes: one, or several (a base and the fine-tunes publishing to it)."""
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def render_example(path) -> list[dict]:
    return [child for doc in example_docs(path) for child in render(doc)]


def by_kind(children, kind):
    return [c for c in children if c["kind"] == kind]


# What the API server adds before the operator sees an object: the UID, which names the run's
# checkpoint directory and the children's ownerReferences.
GOLDEN_UID = "0d5e4f2a-7b1c-4e8d-9a36-5f0c2b7e1d49"


@pytest.mark.parametrize("path", EXAMPLE_FILES, ids=lambda p: p.name)
def test_golden(path, request):
    """Rendered children are byte-stable; regenerate with TPUFT_UPDATE_GOLDEN=1."""
    import os

    docs = example_docs(path)
    for doc in docs:
        doc["metadata"]["uid"] = GOLDEN_UID
    out = yaml.safe_dump_all([child for doc in docs for child in render(doc)], sort_keys=False, width=120)
    golden = GOLDEN / path.name
    if os.environ.get("TPUFT_UPDATE_GOLDEN"):
        golden.write_text(out)
    assert golden.exists(), f"no golden for {path.name}: run TPUFT_UPDATE_GOLDEN=1 pytest {request.node.nodeid}"
    assert out == golden.read_text(), f"{path.name} renders differently from {golden}; if intended, regenerate"


@pytest.mark.parametrize("example,group", [("v6e-4x4.yaml", "v6e-16"), ("tpu7x-2x2x2.yaml", "tpu7x-16")])
def test_every_field_the_gke_tutorial_sets_is_present_with_its_value(example, group):
    tutorial = tutorial_rayclusters()[group]
    ours = by_kind(render(yaml.safe_load((EXAMPLES / example).read_text())), "RayCluster")[0]
    tutorial["metadata"].pop("name")  # our names derive from the TPUFinetune
    for c in tutorial["spec"]["headGroupSpec"]["template"]["spec"]["containers"] + \
            tutorial["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"]:
        c.pop("image")  # ${IMAGE_URI} in the tutorial
    assert missing_from(tutorial, ours) == []


@functools.cache   # one validator per CRD for the session: building and first use cost seconds
def _crd_validator(name):
    crd = kuberay_crd(name)
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return jsonschema.Draft4Validator(schema)


@pytest.mark.parametrize("path", EXAMPLE_FILES, ids=lambda p: p.name)
def test_children_validate_against_kuberay_v170_schemas(path):
    validators = {"RayCluster": _crd_validator("ray.io_rayclusters.yaml"),
                  "RayJob": _crd_validator("ray.io_rayjobs.yaml")}
    children = render_example(path)
    checked = 0
    for child in children:
        if child["kind"] in validators:
            errors = [f"{'.'.join(map(str, e.path))}: {e.message}" for e in validators[child["kind"]].iter_errors(child)]
            assert errors == [], f"{child['kind']} {child['metadata']['name']}"
            checked += 1
    assert checked == len(by_kind(children, "RayCluster")) + len(by_kind(children, "RayJob")) >= 2


def test_schema_validator_catches_a_wrong_type():
    """Guard that the validation above can fail: numOfHosts as a string is rejected."""
    cluster = by_kind(render(MINIMUM), "RayCluster")[0]
    cluster["spec"]["workerGroupSpecs"][0]["numOfHosts"] = "4"
    assert list(_crd_validator("ray.io_rayclusters.yaml").iter_errors(cluster))


def worker_group(children):
    return by_kind(children, "RayCluster")[0]["spec"]["workerGroupSpecs"][0]


def worker_container(children):
    return worker_group(children)["template"]["spec"]["containers"][0]


def head_container(children):
    return by_kind(children, "RayCluster")[0]["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]


def env_names(container):
    return [e["name"] for e in container.get("env", [])]


@pytest.mark.parametrize("acc,topo,hosts,chips", [("v6e", "4x4", 4, "4"), ("v6e", "16x16", 64, "4"),
                                                    ("v6e", "2x4", 1, "8"), ("tpu7x", "2x2x4", 4, "4"),
                                                    ("v5p", "4x4x4", 16, "4")])
def test_num_of_hosts_and_tpu_per_host_from_topology(acc, topo, hosts, chips):
    ch = render(with_("spec.topology", topo, with_("spec.accelerator", acc)))
    g = worker_group(ch)
    assert g["numOfHosts"] == hosts
    res = worker_container(ch)["resources"]
    assert res["limits"]["google.com/tpu"] == res["requests"]["google.com/tpu"] == chips
    sel = g["template"]["spec"]["nodeSelector"]
    assert sel["cloud.google.com/gke-tpu-topology"] == topo


def test_tpu7x_chiplet_settings_on_head_and_workers():
    ch = render(with_("spec.topology", "2x2x2", with_("spec.accelerator", "TPU-V7X")))
    assert worker_group(ch)["resources"] == {"TPU": "8"}
    for c in (head_container(ch), worker_container(ch)):
        assert {"name": "RAY_TPU_RESOURCE_PER_CHIP", "value": "2"} in c["env"]


def test_v6e_has_no_chiplet_settings():
    ch = render(MINIMUM)
    assert "resources" not in worker_group(ch)
    assert "RAY_TPU_RESOURCE_PER_CHIP" not in env_names(worker_container(ch)) + env_names(head_container(ch))


def test_slices_become_replicas_of_one_group():
    g = worker_group(render(with_("spec.slices", 3)))
    assert (g["replicas"], g["minReplicas"], g["maxReplicas"], g["numOfHosts"]) == (3, 3, 3, 4)


def test_cpu_mode_has_plain_cpu_workers():
    doc = with_("spec.topology", "3", with_("spec.accelerator", "cpu"))
    ch = render(doc)
    g, w = worker_group(ch), worker_container(ch)
    assert (g["replicas"], g["numOfHosts"], g["groupName"]) == (3, 1, "cpu-workers")
    assert "google.com/tpu" not in w["resources"]["limits"]
    assert "nodeSelector" not in g["template"]["spec"]


def test_head_runs_no_tasks_and_exposes_ray_ports():
    cluster = by_kind(render(MINIMUM), "RayCluster")[0]
    assert cluster["spec"]["headGroupSpec"]["rayStartParams"] == {"num-cpus": "0"}
    ports = {p["name"]: p["containerPort"] for p in head_container(render(MINIMUM))["ports"]}
    assert ports == {"gcs": 6379, "dashboard": 8265, "client": 10001}


def test_hf_token_only_by_secret_reference():
    ch = render(MINIMUM)
    for c in (head_container(ch), worker_container(ch)):
        hf = [e for e in c["env"] if e["name"] == "HF_TOKEN"]
        assert hf == [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf-secret", "key": "hf_api_token"}}}]
    assert "HF_TOKEN" not in env_names(worker_container(render(with_("spec.hfTokenSecret", None))))


def test_shm_is_in_memory_and_sized_per_generation_or_override():
    v = worker_group(render(MINIMUM))["template"]["spec"]["volumes"][0]
    assert v["emptyDir"] == {"medium": "Memory", "sizeLimit": "100Gi"}
    v7 = worker_group(render(with_("spec.topology", "2x2x2", with_("spec.accelerator", "tpu7x"))))
    assert v7["template"]["spec"]["volumes"][0]["emptyDir"]["sizeLimit"] == "128Gi"
    over = worker_group(render(with_("spec.resources", {"shmSize": "64Gi"})))
    assert over["template"]["spec"]["volumes"][0]["emptyDir"]["sizeLimit"] == "64Gi"


@pytest.mark.parametrize("acc,topo", [("v4", "2x2x2"), ("v5e", "4x4"), ("v5p", "2x2x1"), ("v6e", "4x4"),
                                      ("tpu7x", "2x2x2"), ("cpu", "2")])
def test_default_pod_sizes_come_from_the_catalog(acc, topo):
    ch = render(with_("spec.topology", topo, with_("spec.accelerator", acc)))
    s = catalog.resolve_slice(acc, topo)
    w, head = worker_container(ch)["resources"], head_container(ch)["resources"]
    assert (w["limits"]["cpu"], w["limits"]["memory"]) == (s.worker_pod.cpu, s.worker_pod.memory)
    assert (head["limits"]["cpu"], head["limits"]["memory"]) == (s.head_pod.cpu, s.head_pod.memory)
    assert worker_group(ch)["template"]["spec"]["volumes"][0]["emptyDir"]["sizeLimit"] == s.worker_pod.shm


def test_resource_overrides_keep_tpu_count():
    w = worker_container(render(with_("spec.resources", {"worker": {"limits": {"cpu": "100", "memory": "300Gi"}}})))
    assert w["resources"]["limits"] == {"cpu": "100", "memory": "300Gi", "google.com/tpu": "4"}
    assert w["resources"]["requests"] == w["resources"]["limits"]  # one side moves the other


def test_a_request_override_alone_never_exceeds_the_limit():
    head = head_container(render(with_("spec.resources", {"head": {"requests": {"cpu": "100"}}})))
    assert head["resources"]["requests"]["cpu"] == head["resources"]["limits"]["cpu"] == "100"
    both = worker_container(render(with_("spec.resources", {"worker": {
        "requests": {"cpu": "32"}, "limits": {"cpu": "64", "ephemeral-storage": "100Gi"}}})))
    assert both["resources"]["requests"]["cpu"] == "32" and both["resources"]["limits"]["cpu"] == "64"
    assert both["resources"]["requests"]["ephemeral-storage"] == "100Gi"


def test_spot_reservation_and_extra_selectors_never_override_topology():
    spot = worker_group(render(with_("spec.scheduling", {"spot": True})))["template"]["spec"]["nodeSelector"]
    assert spot["cloud.google.com/gke-spot"] == "true"
    res = worker_group(render(with_("spec.scheduling", {"reservation": "r1", "nodeSelector": {
        "cloud.google.com/gke-tpu-topology": "2x2", "pool": "a"}})))["template"]["spec"]
    assert res["nodeSelector"]["cloud.google.com/reservation-name"] == "r1"
    assert res["nodeSelector"]["cloud.google.com/gke-tpu-topology"] == "4x4"
    assert res["nodeSelector"]["pool"] == "a"


FLEX = {"provisioning": "flexStart", "maxRunDurationSeconds": 86400}


def test_flex_start_selects_and_tolerates_gkes_queued_provisioning_nodes_and_passes_the_run_duration():
    ch = render(with_("spec.scheduling", {**FLEX, "tolerations": [{"key": "a", "operator": "Exists"}]}))
    pod = worker_group(ch)["template"]["spec"]
    assert pod["nodeSelector"]["cloud.google.com/gke-flex-start"] == "true"
    assert pod["nodeSelector"]["cloud.google.com/gke-tpu-topology"] == "4x4"   # the topology still wins
    assert pod["tolerations"] == [{"key": "a", "operator": "Exists"},
                                  {"key": "cloud.google.com/gke-queued", "operator": "Exists", "effect": "NoSchedule"}]
    cluster = by_kind(ch, "RayCluster")[0]
    assert cluster["metadata"]["annotations"]["provreq.kueue.x-k8s.io/maxRunDurationSeconds"] == "86400"
    head = cluster["spec"]["headGroupSpec"]["template"]["spec"]
    assert "cloud.google.com/gke-flex-start" not in head.get("nodeSelector", {})   # the head is a CPU pod
    plain = render(MINIMUM)
    assert "cloud.google.com/gke-flex-start" not in worker_group(plain)["template"]["spec"]["nodeSelector"]
    assert "tolerations" not in worker_group(plain)["template"]["spec"]
    assert "annotations" not in by_kind(plain, "RayCluster")[0]["metadata"]


def test_flex_start_without_a_run_duration_leaves_gkes_default():
    cluster = by_kind(render(with_("spec.scheduling", {"provisioning": "flexStart"})), "RayCluster")[0]
    assert "annotations" not in cluster["metadata"]


def _queued(doc: dict) -> dict:
    doc = copy.deepcopy(doc)
    doc["metadata"]["labels"] = {"kueue.x-k8s.io/queue-name": "flex"}
    return doc


def test_topology_aware_one_slice_is_one_pod_set_on_one_node_pool():
    doc = _queued(with_("spec.scheduling", {"topologyAware": True}))
    groups = by_kind(render(doc), "RayCluster")[0]["spec"]["workerGroupSpecs"]
    assert [(g["groupName"], g["replicas"], g["numOfHosts"]) for g in groups] == [("v6e-16", 1, 4)]
    annotations = groups[0]["template"]["metadata"].get("annotations", {})
    assert {k: v for k, v in annotations.items() if k.startswith("kueue.x-k8s.io/podset")} == {
        "kueue.x-k8s.io/podset-required-topology": "cloud.google.com/gke-nodepool"}
    # Kueue's TAS node controller judges the node's taints by the template (not the admitted pod)
    assert {"key": "google.com/tpu", "operator": "Exists", "effect": "NoSchedule"} in groups[0]["template"]["spec"][
        "tolerations"]


def test_topology_aware_slices_are_a_worker_group_each_named_as_the_webhook_names_replicas():
    """Kueue places pod sets, not KubeRay replicas: each slice its own group (one pod set on one node
    pool), TPU_NAME as the TPU webhook would name replica i of one group, the rest of the group the same."""
    plain = by_kind(render(_queued(with_("spec.slices", 3, MINIMUM))), "RayCluster")[0]["spec"]["workerGroupSpecs"]
    doc = _queued(with_("spec.slices", 3, with_("spec.scheduling", {"topologyAware": True})))
    groups = by_kind(render(doc), "RayCluster")[0]["spec"]["workerGroupSpecs"]
    assert [(g["groupName"], g["replicas"], g["minReplicas"], g["maxReplicas"], g["numOfHosts"]) for g in groups] == [
        (f"v6e-16-s{i}", 1, 1, 1, 4) for i in range(3)]
    assert [(plain[0]["replicas"], plain[0]["numOfHosts"])] == [(3, 4)]
    for i, group in enumerate(groups):
        annotations = group["template"]["metadata"]["annotations"]
        assert annotations["kueue.x-k8s.io/podset-required-topology"] == "cloud.google.com/gke-nodepool"
        assert not [k for k in annotations if k.startswith("kueue.x-k8s.io/podset-slice")]
        env = group["template"]["spec"]["containers"][0]["env"]
        assert [e["value"] for e in env if e["name"] == "TPU_NAME"] == [f"v6e-16-{i}"]
        assert _without_tpu_name(group) == _without_tpu_name(groups[0])


def _without_tpu_name(group: dict) -> dict:
    """A worker group's pod spec, its worker container's TPU_NAME left out."""
    spec = copy.deepcopy(group["template"]["spec"])
    spec["containers"][0]["env"] = [e for e in spec["containers"][0]["env"] if e["name"] != "TPU_NAME"]
    return spec


@pytest.mark.parametrize("doc", [
    with_("spec.scheduling", {"topologyAware": True}),                                  # no queue label: no Kueue
    _queued(MINIMUM),                                                                  # not asked
    _queued(with_("spec.topology", "2x2", with_("spec.scheduling", {"topologyAware": True}))),   # one host
], ids=["unqueued", "not-asked", "single-host"])
def test_no_topology_annotations_where_kueue_would_not_place_by_them(doc):
    annotations = worker_group(render(doc))["template"]["metadata"].get("annotations", {})
    assert not [k for k in annotations if k.startswith("kueue.x-k8s.io/podset")]


def test_jobs_select_the_cluster_and_carry_deadlines():
    ch = render(MINIMUM)
    cluster = by_kind(ch, "RayCluster")[0]["metadata"]["name"]
    verify, train = by_kind(ch, "RayJob")
    for j in (verify, train):
        assert j["spec"]["clusterSelector"] == {"ray.io/cluster": cluster}
        assert j["spec"]["preRunningDeadlineSeconds"] == 1800
        assert "backoffLimit" not in j["spec"] and "suspend" not in j["spec"]  # invalid with clusterSelector
        env = yaml.safe_load(j["spec"]["runtimeEnvYAML"])["env_vars"]
        assert env == {"TPUFT_NAMESPACE": "default", "TPUFT_NAME": "gemma4-dolly"}
    assert verify["spec"]["activeDeadlineSeconds"] == 600 + builders.VERIFY_DEADLINE_GRACE_SECONDS
    run_dir = "gs://my-bucket/ray_train_torchtpu/default-gemma4-dolly"   # no UID: a rendered file has none
    verify_argv = shlex.split(verify["spec"]["entrypoint"])
    assert verify_argv[:4] == ["python", "-m", "tpuft_workload", "verify"]
    assert verify_argv[4:] == ["--spec", _flag(verify_argv, "--spec"), "--run-name", "default-gemma4-dolly",
                               "--log-file", f"{run_dir}/logs/verify.log"]   # the storage it checks first
    document = _document(MINIMUM)
    assert json.loads(_flag(verify_argv, "--spec")) == document   # one document for both jobs
    assert (document["accelerator"], document["topology"], document["slices"]) == ("v6e", "4x4", 1)
    assert document["verification"] == {"timeoutSeconds": 600}
    assert _flag(_train_args(MINIMUM), "--log-file") == f"{run_dir}/logs/train.log"   # tpuft logs reads them there
    assert document["model"] == "google/gemma-4-E2B-it"
    assert "'" + _flag(_train_args(MINIMUM), "--spec") + "'" in train["spec"]["entrypoint"]  # shell-quoted
    assert _document(with_("spec.training.packing", False))["training"]["packing"] is False
    assert "format" not in document["dataset"]   # the suffix or the hub says
    parquet = _document(with_("spec.dataset", {"name": "gs://b/dolly", "format": "parquet"}))["dataset"]
    assert parquet == {"name": "gs://b/dolly", "split": "train", "format": "parquet", "overlong": "truncate"}


def test_submitters_are_small_tokenless_and_labelled_as_the_run():
    """KubeRay's default submitter asks 500m; ours 100m (two runs' submitters no longer push a third
    run's pods off a 2-core node), mounts no API token and carries the run's labels."""
    ch = render(MINIMUM)
    image = by_kind(ch, "RayCluster")[0]["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["image"]
    for job in by_kind(ch, "RayJob"):
        tmpl = job["spec"]["submitterPodTemplate"]
        (container,) = tmpl["spec"]["containers"]
        assert container["name"] == "ray-job-submitter" and container["image"] == image
        assert "command" not in container   # KubeRay fills in `ray job submit ...`
        assert container["resources"]["requests"]["cpu"] == "100m"
        assert tmpl["spec"]["restartPolicy"] == "Never" and tmpl["spec"]["automountServiceAccountToken"] is False
        assert tmpl["metadata"]["labels"] == job["metadata"]["labels"]


def test_verification_disabled_renders_no_verify_job():
    jobs = by_kind(render(with_("spec.verification", {"enabled": False})), "RayJob")
    assert [j["metadata"]["name"] for j in jobs] == ["gemma4-dolly-train"]


def test_names_fit_and_owner_references_are_set():
    doc = with_("metadata", {"name": "a" * 40, "namespace": "ns", "uid": "u-1"})
    for child in render(doc):
        assert len(child["metadata"]["name"]) <= 63 - len("-head-svc") - 1
        assert child["metadata"]["ownerReferences"] == [{
            "apiVersion": "tpufinetune.dev/v1alpha1", "kind": "TPUFinetune", "name": "a" * 40,
            "uid": "u-1", "controller": True}]
        assert child["metadata"]["labels"]["tpufinetune.dev/name"] == "a" * 40


def _train_args(doc) -> list[str]:
    return shlex.split(by_kind(render(doc), "RayJob")[-1]["spec"]["entrypoint"])


def _flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def _document(doc) -> dict:
    """The run document the training RayJob's entrypoint carries (--spec)."""
    return json.loads(_flag(_train_args(doc), "--spec"))


def _workload_run(doc):
    """The training entrypoint, read back by the workload's own CLI: (its Command, its Target)."""
    from tpuft_workload import __main__ as workload_cli

    return workload_cli.parse_args(_train_args(doc)[3:])


def test_run_directory_belongs_to_one_object():
    """Same name and storagePath, two objects (delete and re-create): two run directories; the
    same object (a retry, a restart: same UID) always the same one."""
    first = with_("metadata", {"name": "demo", "namespace": "ns", "uid": "uid-first"})
    again = with_("metadata", {"name": "demo", "namespace": "ns", "uid": "uid-second"})
    assert _flag(_train_args(first), "--run-name") == "ns-demo-uid-first"
    assert _flag(_train_args(again), "--run-name") == "ns-demo-uid-second"
    assert _document(first)["checkpoint"] == _document(again)["checkpoint"]
    retry = builders.build_train_job(parse(first), attempt=2)["spec"]["entrypoint"]
    assert "--run-name ns-demo-uid-first " in retry
    assert builders.run_name(parse(with_("metadata", {"name": "demo", "namespace": "ns"}))) == "ns-demo"  # offline


def test_resume_from_is_passed_to_the_workload_only_when_set():
    assert "resumeFrom" not in _document(MINIMUM)["checkpoint"]
    uri = "gs://my-bucket/ray_train_torchtpu/default-gemma4-dolly-uid-1/checkpoint_step_0000099"
    assert _workload_run(with_("spec.checkpoint.resumeFrom", uri))[0].run.checkpoint.resume_from == uri


def test_workload_identity_may_only_patch_its_own_status():
    sa, role, binding = builders.build_workload_identity(parse(MINIMUM))
    assert role["rules"] == [{"apiGroups": ["tpufinetune.dev"], "resources": ["tpufinetunes/status"],
                              "resourceNames": ["gemma4-dolly"], "verbs": ["get", "patch"]}]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa["metadata"]["name"], "namespace": "default"}]
    pods = by_kind(render(MINIMUM), "RayCluster")[0]["spec"]
    assert pods["headGroupSpec"]["template"]["spec"]["serviceAccountName"] == sa["metadata"]["name"]


def _ray_pod_templates(children: list[dict]) -> list[dict]:
    cluster = by_kind(children, "RayCluster")[0]["spec"]
    return [cluster["headGroupSpec"]["template"], *(g["template"] for g in cluster["workerGroupSpecs"])]


def test_an_existing_service_account_is_bound_and_used_but_never_created():
    children = render(with_("spec.serviceAccountName", "team-ksa"))
    assert by_kind(children, "ServiceAccount") == []    # not the operator's to create, change or delete
    [binding] = by_kind(children, "RoleBinding")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "team-ksa", "namespace": "default"}]
    assert binding["roleRef"]["name"] == by_kind(children, "Role")[0]["metadata"]["name"] == "gemma4-dolly-workload"
    assert {t["spec"]["serviceAccountName"] for t in _ray_pod_templates(children)} == {"team-ksa"}


def test_service_account_annotations_go_on_the_runs_own_account_only():
    wi = {"iam.gke.io/gcp-service-account": "trainer@my-project.iam.gserviceaccount.com"}
    children = render(with_("spec.serviceAccountAnnotations", wi, with_("spec.annotations", {"note": "x"})))
    [sa] = by_kind(children, "ServiceAccount")
    assert sa["metadata"]["annotations"] == {"note": "x", **wi}
    others = [c for c in children if c["kind"] != "ServiceAccount"] + _ray_pod_templates(children)
    assert all("iam.gke.io/gcp-service-account" not in c["metadata"].get("annotations", {}) for c in others)


def test_ray_containers_know_their_service_account_and_namespace_from_the_pod():
    for template in _ray_pod_templates(render(MINIMUM)):
        env = {e["name"]: e.get("valueFrom") for e in template["spec"]["containers"][0]["env"]}
        assert env["TPUFT_SERVICE_ACCOUNT"] == {"fieldRef": {"fieldPath": "spec.serviceAccountName"}}
        assert env["TPUFT_SERVICE_ACCOUNT_NAMESPACE"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}


# The Cloud Storage FUSE CSI driver's volume attributes, as GKE documents them:
# https://cloud.google.com/kubernetes-engine/docs/reference/cloud-storage-fuse-csi-driver/volume-attr
GCSFUSE_VOLUME_ATTRIBUTES = {
    "bucketName", "mountOptions", "skipCSIBucketAccessCheck", "gcsfuseMetadataPrefetchOnMount", "fileCacheCapacity",
    "fileCacheForRangeRead", "metadataStatCacheCapacity", "metadataTypeCacheCapacity", "metadataCacheTTLSeconds",
    "gcsfuseLoggingSeverity", "disableMetrics", "enableCloudProfilerForSidecar"}


def test_the_gcsfuse_example_mounts_a_documented_volume_on_every_ray_pod_and_asks_for_the_sidecar():
    children = render(yaml.safe_load((EXAMPLES / "gke-gcsfuse.yaml").read_text()))
    for template in _ray_pod_templates(children):
        [volume] = [v for v in template["spec"]["volumes"] if v["name"] == builders.CHECKPOINT_VOLUME]
        csi = volume["csi"]
        assert csi["driver"] == "gcsfuse.csi.storage.gke.io" and set(csi["volumeAttributes"]) <= GCSFUSE_VOLUME_ATTRIBUTES
        # GKE's form: comma-separated, no spaces; a config field as section:key:value
        options = csi["volumeAttributes"]["mountOptions"].split(",")
        assert all(o and " " not in o for o in options) and "implicit-dirs" in options
        assert template["metadata"]["annotations"] == {"gke-gcsfuse/volumes": "true"}   # else no sidecar, no mount
    assert all("gke-gcsfuse/volumes" not in c["metadata"].get("annotations", {}) for c in children)   # pods only


def test_no_gcsfuse_annotation_without_a_gcsfuse_volume():
    pvc = with_("spec.checkpoint", {"storagePath": "/ckpt", "volume": {"persistentVolumeClaim": {"claimName": "f"}}})
    assert all("annotations" not in t["metadata"] for t in _ray_pod_templates(render(pvc)))


def test_labels_annotations_and_kueue_queue_pass_through():
    doc = with_("spec.labels", {"team": "ml"},
                with_("spec.annotations", {"note": "x"},
                      with_("metadata.labels", {"kueue.x-k8s.io/queue-name": "tpu-queue",
                                                "kueue.x-k8s.io/priority-class": "high"})))
    cluster = by_kind(render(doc), "RayCluster")[0]
    assert cluster["metadata"]["labels"]["team"] == "ml"
    assert cluster["metadata"]["labels"]["tpufinetune.dev/name"] == "gemma4-dolly"  # ours (spec.labels may not set it)
    assert cluster["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "tpu-queue"
    assert cluster["metadata"]["labels"]["kueue.x-k8s.io/priority-class"] == "high"   # Kueue's priority
    assert all("kueue.x-k8s.io/queue-name" not in j["metadata"].get("labels", {})   # only the RayCluster is queued
               for j in by_kind(render(doc), "RayJob"))
    assert cluster["metadata"]["annotations"] == {"note": "x"}
    assert cluster["spec"]["workerGroupSpecs"][0]["template"]["metadata"]["annotations"] == {"note": "x"}


def test_suspend_suspends_the_cluster():
    assert by_kind(render(with_("spec.suspend", True)), "RayCluster")[0]["spec"]["suspend"] is True
    assert "suspend" not in by_kind(render(MINIMUM), "RayCluster")[0]["spec"]


def test_yaml_has_no_aliases():
    text = yaml.safe_dump_all(render(MINIMUM))
    assert "&id" not in text and "*id" not in text


def test_checkpoint_volume_is_mounted_at_storage_path_on_head_and_workers():
    doc = with_("spec.checkpoint.storagePath", "/mnt/ckpt")
    doc = with_("spec.checkpoint.volume", {"persistentVolumeClaim": {"claimName": "filestore"}}, base=doc)
    rc = builders.build_raycluster(parse(doc))
    for pod in (rc["spec"]["headGroupSpec"]["template"]["spec"], rc["spec"]["workerGroupSpecs"][0]["template"]["spec"]):
        assert {"name": "checkpoints", "persistentVolumeClaim": {"claimName": "filestore"}} in pod["volumes"]
        assert {"name": "checkpoints", "mountPath": "/mnt/ckpt"} in pod["containers"][0]["volumeMounts"]


def test_no_checkpoint_volume_without_the_field():
    rc = builders.build_raycluster(parse(MINIMUM))
    head = rc["spec"]["headGroupSpec"]["template"]["spec"]
    assert "volumes" not in head and "volumeMounts" not in head["containers"][0]


@pytest.mark.parametrize("example,hosts", [("v6e-4x4.yaml", 4), ("tpu7x-2x2x2.yaml", 2)])
def test_jax_training_job_runs_one_jax_worker_per_host(example, hosts):
    """framework jax: the training RayJob's entrypoint, read back by the workload's own CLI, runs
    JaxTrainer with one worker per host (torch: one per device), and the job is schema-valid."""
    from tpuft_workload import __main__ as workload_cli

    doc = yaml.safe_load((EXAMPLES / example).read_text())
    doc["spec"].setdefault("training", {})["framework"] = "jax"
    job = by_kind(render(doc), "RayJob")[-1]
    argv = shlex.split(job["spec"]["entrypoint"])
    assert argv[:4] == ["python", "-m", "tpuft_workload", "train"]
    command, target = workload_cli.parse_args(argv[3:])
    assert command.run.training.framework == "jax" and target.jax_workers == hosts < target.world_size
    assert list(_crd_validator("ray.io_rayjobs.yaml").iter_errors(job)) == []


def test_torch_entrypoint_is_unchanged_by_the_framework_field():
    assert _document(MINIMUM)["training"]["framework"] == "torch"
    assert _train_args(with_("spec.training", {"framework": "torch"})) == _train_args(MINIMUM)
    assert _train_args(with_("spec.training", {"method": "full"})) == _train_args(MINIMUM)


LORA = {"method": "lora", "lora": {"rank": 8, "alpha": 16, "targetModules": ["q_proj", "v_proj"]}}


def test_lora_settings_reach_the_workload_as_its_own_cli_reads_them():
    run = _workload_run(with_("spec.training", LORA))[0].run
    lora = run.training.lora
    assert (run.training.method, lora.rank, lora.alpha, lora.dropout) == ("lora", 8, 16, 0.05)
    assert list(lora.target_modules) == ["q_proj", "v_proj"] and not run.export.merge
    merged = with_("spec.export", {"merge": True}, base=with_("spec.training", LORA))
    assert _workload_run(merged)[0].run.export.merge


def test_the_record_layout_reaches_the_workload_as_its_own_cli_reads_it():
    assert "type" not in _document(MINIMUM)["dataset"]
    doc = with_("spec.dataset", {"name": "gs://b/qa.jsonl", "type": "promptCompletion", "overlong": "drop",
                                 "columns": {"prompt": "question", "completion": "answer"}})
    dataset = _workload_run(doc)[0].run.dataset
    assert (dataset.type, dataset.overlong) == ("promptCompletion", "drop")
    assert dataset.columns == (("completion", "answer"), ("prompt", "question"))


@pytest.mark.parametrize("engine,merged", [("vllm", True), ("transformers", False)])
def test_a_lora_run_is_served_as_its_engine_loads_it(engine, merged):
    """transformers serves the adapter folder on its base; vLLM serves the merged weights, which
    the run then always writes (one model per object: docs/lora.md)."""
    doc = with_("spec.serve", {"enabled": True, "image": "vllm:1", "engine": engine},
                base=with_("spec.training", LORA))
    assert _document(doc)["export"]["merge"] is merged
    app = yaml.safe_load(by_kind(render(doc), "RayService")[0]["spec"]["serveConfigV2"])["applications"][0]
    source = (app["args"]["llm_configs"][0]["model_loading_config"]["model_source"] if engine == "vllm"
              else app["args"][ServeArg.MODEL_SOURCE.value])
    assert source.endswith("/export-merged" if merged else "/export"), source


# --- the RayService (spec.serve) ----------------------------------------------------------------------
def serving(example: str, **serve) -> dict:
    doc = yaml.safe_load((EXAMPLES / example).read_text())
    doc["spec"]["serve"] = {"enabled": True, "image": "REGISTRY/vllm-tpu:latest", **serve}
    return doc


def rayservice(doc) -> dict:
    return by_kind(render(doc), "RayService")[0]


def serve_config(svc) -> dict:
    return yaml.safe_load(svc["spec"]["serveConfigV2"])["applications"][0]


SERVE_SHAPES = [("v6e-4x4.yaml", {}, "TPU-V6E", "4x4", 4, "4", 16),
                ("tpu7x-2x2x2.yaml", {}, "TPU-V7X", "2x2x2", 2, "4", 16),
                ("v6e-4x4.yaml", {"topology": "2x4"}, "TPU-V6E", "2x4", 1, "8", 8)]


@pytest.mark.parametrize("example,serve,acc_type,topology,hosts,chips,devices", SERVE_SHAPES,
                         ids=[f"{s[0]}-{s[3]}" for s in SERVE_SHAPES])
def test_the_rayservice_validates_and_its_llm_config_reserves_the_whole_slice(example, serve, acc_type, topology,
                                                                              hosts, chips, devices):
    svc = rayservice(serving(example, **serve))
    errors = [f"{'.'.join(map(str, e.path))}: {e.message}"
              for e in _crd_validator("ray.io_rayservices.yaml").iter_errors(svc)]
    assert errors == []
    app = serve_config(svc)
    assert app["import_path"] == "ray.serve.llm:build_openai_app"
    llm = app["args"]["llm_configs"][0]
    # The slice topology line, the one easily forgotten: without it the app sits in DEPLOYING forever.
    assert llm["accelerator_type"] == acc_type and llm["accelerator_config"] == {"kind": "tpu", "topology": topology}
    assert llm["engine_kwargs"]["tensor_parallel_size"] == devices
    group = svc["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]
    assert group["numOfHosts"] == hosts
    assert group["template"]["spec"]["containers"][0]["resources"]["limits"]["google.com/tpu"] == chips
    assert group["template"]["spec"]["nodeSelector"]["cloud.google.com/gke-tpu-topology"] == topology
    assert ("runtime_env" in llm) is (hosts > 1)


def test_tpu7x_serving_cluster_has_the_chiplet_settings_like_training():
    svc = rayservice(serving("tpu7x-2x2x2.yaml"))
    group = svc["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]
    assert group["resources"] == {"TPU": "8"}
    for tmpl in (group["template"], svc["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]):
        assert {"name": "RAY_TPU_RESOURCE_PER_CHIP", "value": "2"} in tmpl["spec"]["containers"][0]["env"]


def test_serving_pods_take_the_serve_image_the_hf_token_by_reference_and_no_api_token():
    svc = rayservice(serving("v6e-4x4.yaml"))
    cluster = svc["spec"]["rayClusterConfig"]
    for tmpl in (cluster["headGroupSpec"]["template"], cluster["workerGroupSpecs"][0]["template"]):
        container = tmpl["spec"]["containers"][0]
        assert container["image"] == "REGISTRY/vllm-tpu:latest"
        assert tmpl["spec"]["automountServiceAccountToken"] is False
        assert tmpl["metadata"]["labels"]["tpufinetune.dev/component"] == "serve"
        hf = [e for e in container.get("env", []) if e["name"] == "HF_TOKEN"]
        assert all("value" not in e and e["valueFrom"]["secretKeyRef"] for e in hf)
    worker = cluster["workerGroupSpecs"][0]["template"]["spec"]
    shm = next(v for v in worker["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"]["medium"] == "Memory"


def test_replicas_are_slices_of_the_serve_shape():
    svc = rayservice(serving("v6e-4x4.yaml", replicas=3))
    assert svc["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["replicas"] == 3
    assert serve_config(svc)["args"]["llm_configs"][0]["deployment_config"] == {"num_replicas": 3}


# (example, serve, Serve's replica config, worker group (replicas, minReplicas, maxReplicas, numOfHosts), autoscaled)
SERVE_SCALING = [
    ("v6e-4x4.yaml", {"replicas": 2}, {"num_replicas": 2}, (2, 2, 2, 4), False),
    ("v6e-4x4.yaml", {"replicas": {"min": 2, "max": 2}}, {"num_replicas": 2}, (2, 2, 2, 4), False),
    # one group replica is one whole 4-host slice: Serve's max replicas is the group's max slices
    ("v6e-4x4.yaml", {"replicas": {"min": 1, "max": 3}}, {"autoscaling_config": {"min_replicas": 1, "max_replicas": 3}},
     (1, 1, 3, 4), True),
    ("tpu7x-2x2x2.yaml", {"replicas": {"min": 2, "max": 5}},
     {"autoscaling_config": {"min_replicas": 2, "max_replicas": 5}}, (2, 2, 5, 2), True),
    ("v6e-4x4.yaml", {"topology": "2x4", "replicas": {"min": 1, "max": 2}},
     {"autoscaling_config": {"min_replicas": 1, "max_replicas": 2}}, (1, 1, 2, 1), True),
]


@pytest.mark.parametrize("example,serve,deployment,group_sizes,autoscaled", SERVE_SCALING,
                         ids=[f"{s[0]}-{s[1]['replicas']}" for s in SERVE_SCALING])
def test_autoscaled_replicas_become_serves_autoscaling_config_and_whole_slices(example, serve, deployment,
                                                                              group_sizes, autoscaled):
    svc = rayservice(serving(example, **serve))
    assert [e.message for e in _crd_validator("ray.io_rayservices.yaml").iter_errors(svc)] == []
    assert serve_config(svc)["args"]["llm_configs"][0]["deployment_config"] == deployment
    cluster = svc["spec"]["rayClusterConfig"]
    (group,) = cluster["workerGroupSpecs"]
    assert (group["replicas"], group["minReplicas"], group["maxReplicas"], group["numOfHosts"]) == group_sizes
    assert cluster["enableInTreeAutoscaling"] is autoscaled
    # the autoscaler sidecar KubeRay adds to the head needs its ServiceAccount token; workers never do
    assert cluster["headGroupSpec"]["template"]["spec"]["automountServiceAccountToken"] is autoscaled
    assert group["template"]["spec"]["automountServiceAccountToken"] is False


def test_the_transformers_engine_scales_its_deployment_and_cpu_workers_per_slice():
    doc = yaml.safe_load((EXAMPLES / "local-cpu.yaml").read_text())
    doc["spec"]["serve"] = {"enabled": True, "topology": "2", "replicas": {"min": 1, "max": 3}}
    svc = rayservice(doc)
    assert serve_config(svc)["deployments"] == [{"name": SERVE_DEPLOYMENT_NAME, "autoscaling_config": {"min_replicas": 1,
                                                                                        "max_replicas": 3}}]
    (group,) = svc["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    # a cpu "slice" of 2 is 2 one-host workers
    assert (group["replicas"], group["minReplicas"], group["maxReplicas"], group["numOfHosts"]) == (2, 2, 6, 1)
    fixed = rayservice({**doc, "spec": {**doc["spec"], "serve": {**doc["spec"]["serve"], "replicas": 2}}})
    assert serve_config(fixed)["deployments"] == [{"name": SERVE_DEPLOYMENT_NAME, "num_replicas": 2}]


def test_the_transformers_engine_serves_the_export_with_the_training_image_on_cpu():
    doc = yaml.safe_load((EXAMPLES / "local-cpu.yaml").read_text())
    doc["spec"]["serve"] = {"enabled": True, "topology": "1", "maxModelLength": 256}
    doc["metadata"]["uid"] = "u-1"
    svc = rayservice(doc)
    app = serve_config(svc)
    assert app["import_path"] == "tpuft_workload.serve:build_app" and app["route_prefix"] == "/"
    assert app["args"] == {"model_source": "/tmp/tpuft-checkpoints/default-local-cpu-u-1/export",
                           "model_id": "local-cpu", "max_model_len": 256}
    cluster = svc["spec"]["rayClusterConfig"]
    assert cluster["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["image"] == doc["spec"]["image"]
    mounts = cluster["headGroupSpec"]["template"]["spec"]["containers"][0]["volumeMounts"]
    assert {"mountPath": "/tmp/tpuft-checkpoints", "name": "checkpoints"} in mounts   # the export is read there


def test_no_rayservice_without_serve():
    assert by_kind(render(MINIMUM), "RayService") == []


# --- security: token auth, hardening, the serve API key, the NetworkPolicy --------------------------------
def _with_serving(path) -> list[dict]:
    """The example's children as written, serving enabled where it is not already (so every example
    renders a RayService too)."""
    docs = example_docs(path)
    for doc in docs:
        if not (doc["spec"].get("serve") or {}).get("enabled"):
            doc["spec"]["serve"] = {"enabled": True, "image": "REGISTRY/vllm-tpu:latest"}
    return [child for doc in docs for child in render(doc)]


def _ray_clusters(children) -> list[tuple[str, dict]]:
    """(kind, RayClusterSpec) of every Ray cluster rendered: the RayCluster's and the RayService's."""
    return [(x["kind"], x["spec"]) for x in by_kind(children, "RayCluster")] + \
           [(x["kind"], x["spec"]["rayClusterConfig"]) for x in by_kind(children, "RayService")]


def _pod_templates(cluster_spec) -> list[dict]:
    return [cluster_spec["headGroupSpec"]["template"], *(g["template"] for g in cluster_spec["workerGroupSpecs"])]


@pytest.mark.parametrize("path", EXAMPLE_FILES, ids=lambda p: p.name)
def test_every_ray_cluster_has_token_auth_and_rayjobs_none(path):
    """KubeRay v1.6.2 then makes the token Secret and sets the Ray containers' (and, from the selected
    RayCluster, the submitters') RAY_AUTH_* env; a clusterSelector RayJob needs nothing itself."""
    children = _with_serving(path)
    clusters = _ray_clusters(children)
    assert {k for k, _ in clusters} == {"RayCluster", "RayService"}
    for kind, spec in clusters:
        assert spec["authOptions"] == {"mode": "token"}, kind
    for job in by_kind(children, "RayJob"):
        assert "authOptions" not in yaml.safe_dump(job["spec"])


@pytest.mark.parametrize("path", EXAMPLE_FILES, ids=lambda p: p.name)
def test_every_ray_pod_is_hardened_and_only_training_pods_keep_the_token(path):
    children = _with_serving(path)
    for kind, spec in _ray_clusters(children):
        for tmpl in _pod_templates(spec):
            pod = tmpl["spec"]
            assert pod["securityContext"] == {"seccompProfile": {"type": "RuntimeDefault"}}
            for container in pod["containers"]:
                assert container["securityContext"] == {"allowPrivilegeEscalation": False,
                                                        "capabilities": {"drop": ["ALL"]}}
            assert "runAsNonRoot" not in yaml.safe_dump(pod)   # the workload image runs as root
            # training: the driver (head) and rank 0 (a worker) patch the status; serving calls no API
            assert pod.get("automountServiceAccountToken", True) is (kind == "RayCluster")


PRESTOP = ["python", "-m", "tpuft_workload.preemption", "--timeout-seconds", "285"]


@pytest.mark.parametrize("path", EXAMPLE_FILES, ids=lambda p: p.name)
@pytest.mark.parametrize("kind,hook,grace", [("RayCluster", PRESTOP, 300), ("RayService", None, None)])
def test_training_pods_stop_at_a_checkpoint_within_their_grace_period(path, kind, hook, grace):
    """Training head and workers: a preStop hook that SIGTERMs the pod's Ray Train workers and waits,
    15 s inside the pod's grace period (then the runtime signals `ray start`). Serving: neither."""
    from tpuft.api import constants as c

    assert c.PRESTOP_WAIT_SECONDS + 15 == c.TRAINING_TERMINATION_GRACE_SECONDS
    spec = dict(_ray_clusters(_with_serving(path)))[kind]
    for tmpl in _pod_templates(spec):
        pod = tmpl["spec"]
        assert pod.get("terminationGracePeriodSeconds") == grace
        for container in pod["containers"]:
            got = container.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command")
            assert got == hook, container["name"]


def test_the_prestop_hook_is_a_module_the_workload_image_runs():
    import importlib.util

    assert PRESTOP[2] == f"{builders.WORKLOAD_MODULE}.preemption"
    assert importlib.util.find_spec(PRESTOP[2]) is not None or importlib.util.find_spec("ray") is None


def test_serve_api_key_reaches_the_serving_containers_only_by_reference():
    doc = serving("v6e-4x4.yaml", apiKeySecret={"name": "chat-key"})
    ref = {"name": SERVE_API_KEY_ENV, "valueFrom": {"secretKeyRef": {"name": "chat-key", "key": "api-key"}}}
    children = render(doc)
    for kind, spec in _ray_clusters(children):
        for tmpl in _pod_templates(spec):
            env = tmpl["spec"]["containers"][0].get("env", [])
            assert (ref in env) is (kind == "RayService")
            assert [e for e in env if e["name"] == SERVE_API_KEY_ENV] in ([ref], [])
    other = rayservice(serving("v6e-4x4.yaml", apiKeySecret={"name": "chat-key", "key": "token"}))
    env = other["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["env"]
    assert {"name": SERVE_API_KEY_ENV, "valueFrom": {"secretKeyRef": {"name": "chat-key", "key": "token"}}} in env
    assert SERVE_API_KEY_ENV not in yaml.safe_dump(rayservice(serving("v6e-4x4.yaml")))


@functools.cache
def _network_policy_validator():
    """Kubernetes v1.35.3's own NetworkPolicy schema (tests/data), made strict the way the API server's
    strict field validation is: an object with properties admits no other field."""
    doc = json.loads(NETWORK_POLICY_OPENAPI.read_text())

    def strict(node):
        if isinstance(node, dict):
            if "properties" in node and "additionalProperties" not in node:
                node["additionalProperties"] = False
            for v in node.values():
                strict(v)
        elif isinstance(node, list):
            for v in node:
                strict(v)
    strict(doc)
    schema = {**doc, "$ref": "#/components/schemas/io.k8s.api.networking.v1.NetworkPolicy"}
    return jsonschema.Draft7Validator(schema)


def _policy_errors(policy) -> list[str]:
    return [f"{'.'.join(map(str, e.path))}: {e.message}" for e in _network_policy_validator().iter_errors(policy)]


@pytest.mark.parametrize("path", EXAMPLE_FILES, ids=lambda p: p.name)
def test_network_policy_validates_against_the_kubernetes_schema(path):
    policies = by_kind(render_example(path), "NetworkPolicy")
    assert len(policies) == len(example_docs(path)) and all(_policy_errors(p) == [] for p in policies)


def test_network_policy_validator_catches_a_misspelt_field():
    policy = builders.build_network_policy(parse(MINIMUM))
    policy["spec"]["ingress"][0]["form"] = policy["spec"]["ingress"][0].pop("from")
    policy["spec"]["ingress"][1]["ports"][0]["port"] = [8265]
    assert len(_policy_errors(policy)) == 2


def test_network_policy_admits_the_run_kuberay_prometheus_and_serve_clients_only():
    tft = parse(MINIMUM)
    policy = builders.build_network_policy(tft)
    assert policy["metadata"]["name"] == "gemma4-dolly-ray-ingress"
    own = {"matchLabels": {"tpufinetune.dev/name": "gemma4-dolly"}}
    spec = policy["spec"]
    assert spec["podSelector"] == own and spec["policyTypes"] == ["Ingress"]
    same_run, dashboard, metrics = spec["ingress"]
    assert same_run == {"from": [{"podSelector": own}]}   # every port: Ray uses many
    assert dashboard == {"from": [{"namespaceSelector": {}, "podSelector": {
        "matchLabels": {"app.kubernetes.io/component": "kuberay-operator"}}}],
        "ports": [{"protocol": "TCP", "port": 8265}]}
    # the PodMonitor's Prometheus, in a namespace of its own: Ray's metrics port only
    assert metrics == {"from": [{"namespaceSelector": {}}], "ports": [{"protocol": "TCP", "port": 8080}]}
    served = builders.build_network_policy(parse(serving("v6e-4x4.yaml")))["spec"]["ingress"][-1]
    assert served == {"from": [{"podSelector": {}}], "ports": [{"protocol": "TCP", "port": 8000}]}


def test_every_pod_the_policy_must_admit_carries_the_runs_label():
    """Ray pods (training and serving) and the RayJobs' submitters: the same-run rule is what lets a
    submitter reach its head's dashboard."""
    children = _with_serving(EXAMPLES / "v6e-4x4.yaml")
    (policy,) = by_kind(children, "NetworkPolicy")
    selector = policy["spec"]["podSelector"]["matchLabels"]
    templates = [t for _, spec in _ray_clusters(children) for t in _pod_templates(spec)]
    templates += [j["spec"]["submitterPodTemplate"] for j in by_kind(children, "RayJob")]
    assert len(templates) == 6
    for tmpl in templates:
        assert selector.items() <= tmpl["metadata"]["labels"].items()


def test_submitter_pods_are_hardened_like_the_ray_pods():
    for job in by_kind(render(MINIMUM), "RayJob"):
        pod = job["spec"]["submitterPodTemplate"]["spec"]
        assert pod["securityContext"] == {"seccompProfile": {"type": "RuntimeDefault"}}
        assert pod["containers"][0]["securityContext"] == {"allowPrivilegeEscalation": False,
                                                           "capabilities": {"drop": ["ALL"]}}


# --- adapters on a shared base (spec.serve.adapters, spec.publish) --------------------------------------
ADAPTERS_EXAMPLE = EXAMPLES / "adapters-on-a-base.yaml"


def _adapters_doc(name: str) -> dict:
    return next(d for d in example_docs(ADAPTERS_EXAMPLE) if d["metadata"]["name"] == name)


def test_a_base_renders_no_training_cluster_and_serves_its_model_with_room_for_adapters():
    base = _adapters_doc("tiny-chat")
    base["metadata"]["uid"] = GOLDEN_UID
    children = render(base)
    assert {c["kind"] for c in children} == {"ServiceAccount", "Role", "RoleBinding", "NetworkPolicy", "RayService"}
    args = serve_config(by_kind(children, "RayService")[0])["args"]
    root = f"/tmp/tpuft-checkpoints/default-tiny-chat-{GOLDEN_UID}/adapters"
    assert args[ServeArg.MODEL_SOURCE.value] == "builtin:tiny-chat"
    assert args[ServeArg.ADAPTERS_ROOT.value] == root == builders.adapters_root(parse(base))
    assert args[ServeArg.MAX_ADAPTERS.value] == 4


def test_no_adapter_args_without_serve_adapters():
    args = serve_config(by_kind(render(yaml.safe_load((EXAMPLES / "local-cpu.yaml").read_text())),
                                "RayService")[0])["args"]
    assert ServeArg.ADAPTERS_ROOT.value not in args and ServeArg.MAX_ADAPTERS.value not in args


def _vllm_base() -> dict:
    doc = serving("v6e-4x4.yaml", adapters={"maxPerReplica": 16, "maxRank": 32})
    doc["spec"]["training"] = {"method": "none"}
    doc["spec"].pop("dataset")
    doc["metadata"]["uid"] = GOLDEN_UID
    return doc


def test_a_vllm_base_renders_ray_serve_llms_lora_config_and_vllms_lora_engine_kwargs():
    svc = rayservice(_vllm_base())
    assert [e.message for e in _crd_validator("ray.io_rayservices.yaml").iter_errors(svc)] == []
    llm = serve_config(svc)["args"]["llm_configs"][0]
    root = f"gs://my-bucket/ray_train_torchtpu/default-gemma4-dolly-{GOLDEN_UID}/adapters"
    assert llm["lora_config"] == {"dynamic_lora_loading_path": root, "max_num_adapters_per_replica": 16}
    assert llm["engine_kwargs"]["enable_lora"] is True and llm["engine_kwargs"]["max_lora_rank"] == 32
    assert llm["model_loading_config"] == {"model_id": "gemma4-dolly", "model_source": "google/gemma-4-E2B-it"}


def test_the_vllm_lora_config_is_one_rays_llm_config_accepts():
    """Ray 2.60's own pydantic model (where the test venv has Ray): the field names as Ray spells them."""
    llm_config = pytest.importorskip("ray.llm._internal.serve.core.configs.llm_config")
    rendered = serve_config(rayservice(_vllm_base()))["args"]["llm_configs"][0]
    config = llm_config.LLMConfig(**rendered)
    assert config.lora_config.dynamic_lora_loading_path == rendered["lora_config"]["dynamic_lora_loading_path"]
    assert config.lora_config.max_num_adapters_per_replica == 16
    with pytest.raises(ValueError):   # a misspelt field is refused, so the check above can fail
        llm_config.LoraConfig(**{**rendered["lora_config"], "max_adapters_per_replica": 16})


def _fine_tune() -> object:
    doc = _adapters_doc("facts-lora")
    doc["metadata"]["uid"] = "uid-facts"
    return parse(doc)


def test_the_publish_job_runs_on_the_bases_serving_cluster_with_the_contracts_arguments():
    ft = _fine_tune()
    job = builders.build_publish_job(ft, "tiny-chat", "tiny-chat-serve-raycluster-abcde", "/ck/base/adapters",
                                     "/ck/ft/export", 1.25, ft.spec.eval_set)
    assert [e.message for e in _crd_validator("ray.io_rayjobs.yaml").iter_errors(job)] == []
    assert job["metadata"]["name"] == "facts-lora-publish"
    assert job["metadata"]["labels"]["tpufinetune.dev/name"] == "facts-lora"   # the fine-tune's child
    assert job["spec"]["clusterSelector"] == {"ray.io/cluster": "tiny-chat-serve-raycluster-abcde"}
    # the submitter reaches the base's head: the base's NetworkPolicy admits its own name label
    assert job["spec"]["submitterPodTemplate"]["metadata"]["labels"]["tpufinetune.dev/name"] == "tiny-chat"
    assert shlex.split(job["spec"]["entrypoint"]) == [
        "python", "-m", "tpuft_workload", "publish", "--export", "/ck/ft/export", "--adapters-root",
        "/ck/base/adapters", "--name", "facts", "--source", "default/facts-lora", "--uid", "uid-facts",
        "--eval-set", "split:builtin:made-up-facts[train[24:]]", "--eval-loss", "1.25"]


def test_the_unpublish_job_names_the_adapter_and_the_uid_it_may_remove():
    base = _adapters_doc("tiny-chat")
    base["metadata"]["uid"] = GOLDEN_UID
    job = builders.build_unpublish_job(parse(base), "tiny-chat-serve-raycluster-abcde", "facts", "uid-facts")
    assert [e.message for e in _crd_validator("ray.io_rayjobs.yaml").iter_errors(job)] == []
    assert job["metadata"]["name"] == builders.unpublish_job_name("tiny-chat", "facts", "uid-facts")
    assert job["spec"]["clusterSelector"] == {"ray.io/cluster": "tiny-chat-serve-raycluster-abcde"}
    assert shlex.split(job["spec"]["entrypoint"]) == [
        "python", "-m", "tpuft_workload", "unpublish", "--adapters-root",
        f"/tmp/tpuft-checkpoints/default-tiny-chat-{GOLDEN_UID}/adapters", "--name", "facts", "--uid", "uid-facts"]
    longest = builders.unpublish_job_name("a" * 40, "b" * 63, "u")
    assert len(longest) <= 63 and longest != builders.unpublish_job_name("a" * 40, "b" * 63, "v")
