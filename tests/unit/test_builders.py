"""Pure translation: golden files per example, the seed's manifests, KubeRay's own schemas,
and one focused test per option."""

import functools
import shlex

import jsonschema
import pytest
import yaml

from tests.paths import EXAMPLES, GOLDEN, kuberay_crd
from tests.seed import missing_from, seed_rayclusters
from tests.factories import MINIMUM, with_
from tpuft import builders
from tpuft.spec import parse

EXAMPLE_FILES = sorted(EXAMPLES.glob("*.yaml"))


def render(doc) -> list[dict]:
    return builders.build_children(parse(doc))


def by_kind(children, kind):
    return [c for c in children if c["kind"] == kind]


# What the API server adds before the operator sees an object: the UID, which names the run's
# checkpoint directory and the children's ownerReferences.
GOLDEN_UID = "0d5e4f2a-7b1c-4e8d-9a36-5f0c2b7e1d49"


@pytest.mark.parametrize("path", EXAMPLE_FILES, ids=lambda p: p.name)
def test_golden(path, request):
    """Rendered children are byte-stable; regenerate with TPUFT_UPDATE_GOLDEN=1."""
    import os

    doc = yaml.safe_load(path.read_text())
    doc["metadata"]["uid"] = GOLDEN_UID
    out = yaml.safe_dump_all(render(doc), sort_keys=False, width=120)
    golden = GOLDEN / path.name
    if os.environ.get("TPUFT_UPDATE_GOLDEN"):
        golden.write_text(out)
    assert golden.exists(), f"no golden for {path.name}: run TPUFT_UPDATE_GOLDEN=1 pytest {request.node.nodeid}"
    assert out == golden.read_text(), f"{path.name} renders differently from {golden}; if intended, regenerate"


@pytest.mark.parametrize("example,group", [("v6e-4x4.yaml", "v6e-16"), ("tpu7x-2x2x2.yaml", "tpu7x-16")])
def test_every_field_the_seed_sets_is_present_with_the_seeds_value(example, group):
    seed = seed_rayclusters()[group]
    ours = by_kind(render(yaml.safe_load((EXAMPLES / example).read_text())), "RayCluster")[0]
    seed["metadata"].pop("name")  # our names derive from the TPUFinetune
    for c in seed["spec"]["headGroupSpec"]["template"]["spec"]["containers"] + \
            seed["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"]:
        c.pop("image")  # ${IMAGE_URI} in the seed
    assert missing_from(seed, ours) == []


@functools.cache   # one validator per CRD for the session: building and first use cost seconds
def _crd_validator(name):
    crd = kuberay_crd(name)
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return jsonschema.Draft4Validator(schema)


@pytest.mark.parametrize("path", EXAMPLE_FILES, ids=lambda p: p.name)
def test_children_validate_against_kuberay_v170_schemas(path):
    validators = {"RayCluster": _crd_validator("ray.io_rayclusters.yaml"),
                  "RayJob": _crd_validator("ray.io_rayjobs.yaml")}
    children = render(yaml.safe_load(path.read_text()))
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
    assert verify["spec"]["entrypoint"] == ("python -m tpuft_workload verify --accelerator v6e --topology 4x4 "
                                            "--slices 1 --timeout-seconds 600")
    assert "--model google/gemma-4-E2B-it" in train["spec"]["entrypoint"]
    assert "'train[:1024]'" in train["spec"]["entrypoint"]  # shell-quoted
    assert "--no-packing" in by_kind(render(with_("spec.training.packing", False)), "RayJob")[1]["spec"]["entrypoint"]
    assert "--dataset-format" not in train["spec"]["entrypoint"]   # the suffix or the hub says
    parquet = by_kind(render(with_("spec.dataset", {"name": "gs://b/dolly", "format": "parquet"})), "RayJob")[1]
    assert "--dataset gs://b/dolly --dataset-split train " in parquet["spec"]["entrypoint"]
    assert parquet["spec"]["entrypoint"].endswith(" --dataset-format parquet")


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


def test_run_directory_belongs_to_one_object():
    """Same name and storagePath, two objects (delete and re-create): two run directories; the
    same object (a retry, a restart: same UID) always the same one."""
    first = with_("metadata", {"name": "demo", "namespace": "ns", "uid": "uid-first"})
    again = with_("metadata", {"name": "demo", "namespace": "ns", "uid": "uid-second"})
    assert _flag(_train_args(first), "--run-name") == "ns-demo-uid-first"
    assert _flag(_train_args(again), "--run-name") == "ns-demo-uid-second"
    assert _flag(_train_args(first), "--storage-path") == _flag(_train_args(again), "--storage-path")
    retry = builders.build_train_job(parse(first), attempt=2)["spec"]["entrypoint"]
    assert "--run-name ns-demo-uid-first " in retry
    assert builders.run_name(parse(with_("metadata", {"name": "demo", "namespace": "ns"}))) == "ns-demo"  # offline


def test_resume_from_is_passed_to_the_workload_only_when_set():
    assert "--resume-from" not in _train_args(MINIMUM)
    uri = "gs://my-bucket/ray_train_torchtpu/default-gemma4-dolly-uid-1/checkpoint_step_0000099"
    args = _train_args(with_("spec.checkpoint.resumeFrom", uri))
    assert _flag(args, "--resume-from") == uri


def test_workload_identity_may_only_patch_its_own_status():
    sa, role, binding = builders.build_workload_identity(parse(MINIMUM))
    assert role["rules"] == [{"apiGroups": ["tpufinetune.dev"], "resources": ["tpufinetunes/status"],
                              "resourceNames": ["gemma4-dolly"], "verbs": ["get", "patch"]}]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa["metadata"]["name"], "namespace": "default"}]
    pods = by_kind(render(MINIMUM), "RayCluster")[0]["spec"]
    assert pods["headGroupSpec"]["template"]["spec"]["serviceAccountName"] == sa["metadata"]["name"]


def test_labels_annotations_and_kueue_queue_pass_through():
    doc = with_("spec.labels", {"team": "ml", "tpufinetune.dev/name": "spoof"},
                with_("spec.annotations", {"note": "x"},
                      with_("metadata.labels", {"kueue.x-k8s.io/queue-name": "tpu-queue"})))
    cluster = by_kind(render(doc), "RayCluster")[0]
    assert cluster["metadata"]["labels"]["team"] == "ml"
    assert cluster["metadata"]["labels"]["tpufinetune.dev/name"] == "gemma4-dolly"  # ours win
    assert cluster["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "tpu-queue"
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
    assert argv[:4] == ["python", "-m", "tpuft_workload", "train"] and _flag(argv, "--framework") == "jax"
    args, target = workload_cli.parse_args(argv[3:])
    assert args.framework == "jax" and target.jax_workers == hosts < target.world_size
    assert list(_crd_validator("ray.io_rayjobs.yaml").iter_errors(job)) == []


def test_torch_entrypoint_is_unchanged_by_the_framework_field():
    assert "--framework" not in _train_args(MINIMUM)
    assert _train_args(with_("spec.training", {"framework": "torch"})) == _train_args(MINIMUM)


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
    # The line seed 004 says is always forgotten: without it the app sits in DEPLOYING forever.
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
