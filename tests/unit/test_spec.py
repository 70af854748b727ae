"""Parsing a TPUFinetune: the issue's minimum spec as written, defaults, and every problem by field path."""
import pytest
import yaml

from tests.factories import DELETE, MINIMUM, with_
from tpuft.api import constants as c
from tpuft.api import kuberay
from tpuft.api import spec as spec_mod
from tpuft.api.spec import MAX_NAME_LENGTH, Lora, ServeReplicas, SpecError, parse


def test_minimum_spec_is_accepted_exactly_as_written():
    t = parse(MINIMUM)
    s = t.spec
    assert (t.meta.name, t.meta.namespace) == ("gemma4-dolly", "default")
    assert (s.accelerator, s.slice.topology, s.slices, s.num_workers) == ("v6e", "4x4", 1, 16)
    assert (s.dataset.name, s.dataset.split) == ("databricks/databricks-dolly-15k", "train[:1024]")
    assert (s.training.epochs, s.training.batch_size_per_device, s.training.max_seq_length) == (3, 4, 512)
    assert s.training.learning_rate == 2.0e-5
    assert s.hf_token_secret == spec_mod.SecretKeyRef("hf-secret", "hf_api_token")
    assert (s.verification.enabled, s.verification.timeout_seconds, s.provisioning_timeout_seconds) == (True, 600, 1800)


def test_defaults_match_the_documented_ones():
    doc = yaml.safe_load("""
    metadata: {name: x}
    spec: {accelerator: tpu7x, topology: 2x2x2, image: i, model: m, dataset: {name: d}, checkpoint: {storagePath: /ckpt}}
    """)
    s = parse(doc).spec
    assert s.slices == 1 and s.dataset.split == "train"
    assert (s.training.epochs, s.training.batch_size_per_device, s.training.max_seq_length) == (3, 4, 512)
    assert s.training.packing is True and s.verification.enabled is True
    assert (s.verification.timeout_seconds, s.provisioning_timeout_seconds) == (600, 1800)
    assert s.hf_token_secret is None and s.suspend is False
    assert s.num_workers == 16  # 8 chips x 2 chiplets
    assert s.training.framework == "torch"


def test_lora_is_parsed_with_its_defaults_and_the_export_merge():
    t = parse(with_("spec.training", {"method": "lora"})).spec.training
    assert (t.method, t.lora) == ("lora", Lora(rank=16, alpha=32, dropout=0.05, target_modules=()))
    doc = with_("spec.training", {"method": "lora", "lora": {"rank": 8, "alpha": 16, "dropout": 0,
                                                             "targetModules": ["q_proj", "v_proj"]}})
    got = parse(with_("spec.export", {"merge": True}, base=doc)).spec
    assert got.training.lora == Lora(rank=8, alpha=16, dropout=0.0, target_modules=("q_proj", "v_proj"))
    assert got.export.merge and parse(MINIMUM).spec.training.lora is None


def test_jax_framework_is_parsed():
    assert parse(with_("spec.training", {"framework": "jax"})).spec.training.framework == "jax"


def test_lora_on_jax_is_parsed():
    t = parse(with_("spec.training", {"method": "lora", "framework": "jax"})).spec.training
    assert (t.method, t.framework, t.lora) == ("lora", "jax", Lora())


@pytest.mark.parametrize("spelling", ["TPU-V6E", "tpu-v6e-slice", "V6E", "trillium"])
def test_ray_and_gke_spellings_are_accepted(spelling):
    assert parse(with_("spec.accelerator", spelling)).spec.accelerator == "v6e"


BAD = [
    ("spec.accelerator", "v9", "spec.accelerator", "unknown accelerator"),
    ("spec.accelerator", DELETE, "spec.accelerator", "must be one of"),
    ("spec.topology", "2x2x2", "spec.topology", "2D"),
    ("spec.topology", "16", "spec.topology", "2D"),
    ("spec.topology", DELETE, "spec.topology", "must be a string"),
    ("spec.slices", 0, "spec.slices", "Invalid value: 0: spec.slices in body should be greater than or equal to 1"),
    ("spec.slices", "2", "spec.slices", 'Invalid value: "string": spec.slices in body must be of type integer: "string"'),
    ("spec.slices", True, "spec.slices", "must be of type integer: \"boolean\""),
    ("spec.image", DELETE, "spec.image", "Required value"),
    ("spec.image", "", "spec.image", "should be at least 1 chars long"),
    ("spec.image", "img; rm -rf /", "spec.image", "shell characters"),
    ("spec.imagePullPolicy", "Sometimes", "spec.imagePullPolicy", 'Unsupported value: "Sometimes": supported values: "Always", "IfNotPresent", "Never"'),
    ("spec.model", DELETE, "spec.model", "Required value"),
    ("spec.model", "google/gemma $(curl x)", "spec.model", "shell characters"),
    ("spec.model", 42, "spec.model", "must be of type string"),
    ("spec.dataset", DELETE, "spec.dataset", "is required"),
    ("spec.dataset", "dolly", "spec.dataset", "must be an object"),
    ("spec.dataset.name", DELETE, "spec.dataset.name", "Required value"),
    ("spec.dataset.split", "train`id`", "spec.dataset.split", "shell characters"),
    ("spec.dataset.format", "csv", "spec.dataset.format", 'supported values: "json", "parquet"'),
    ("spec.dataset.format", 3, "spec.dataset.format", "must be of type string"),
    ("spec.training.epochs", -1, "spec.training.epochs", "should be greater than or equal to 1"),
    ("spec.training.epochs", 1.5, "spec.training.epochs", "must be of type integer"),
    ("spec.training.batchSizePerDevice", 0, "spec.training.batchSizePerDevice", "should be greater than or equal to 1"),
    ("spec.training.maxSeqLength", 8, "spec.training.maxSeqLength", "should be greater than or equal to 16"),
    ("spec.training.learningRate", 0, "spec.training.learningRate", "should be greater than 0"),
    ("spec.training.learningRate", "fast", "spec.training.learningRate", "must be of type number"),
    ("spec.training.packing", "yes", "spec.training.packing", "must be of type boolean"),
    ("spec.training.maxJobRetries", 99, "spec.training.maxJobRetries", "should be less than or equal to 20"),
    ("spec.checkpoint", DELETE, "spec.checkpoint", "is required"),
    ("spec.checkpoint.storagePath", "my-bucket/path", "spec.checkpoint.storagePath", "gs://BUCKET/PATH"),
    ("spec.checkpoint.storagePath", "gs://", "spec.checkpoint.storagePath", "gs://BUCKET/PATH"),
    ("spec.checkpoint.storagePath", "relative/dir", "spec.checkpoint.storagePath", "absolute path"),
    ("spec.checkpoint.keep", 0, "spec.checkpoint.keep", "should be greater than or equal to 1"),
    ("spec.checkpoint.storagePath", "s3://bucket/run", "spec.checkpoint.storagePath", "s3:// is not supported"),
    ("spec.checkpoint.resumeFrom", "s3://bucket/run", "spec.checkpoint.resumeFrom", "copy the data to a gs:// bucket"),
    ("spec.checkpoint.resumeFrom", "relative/run", "spec.checkpoint.resumeFrom", "absolute path"),
    ("spec.checkpoint.resumeFrom", "https://example.com/ckpt", "spec.checkpoint.resumeFrom", "gs://BUCKET/PATH"),
    ("spec.checkpoint.resumeFrom", "gs://", "spec.checkpoint.resumeFrom", "gs://BUCKET/PATH"),
    ("spec.checkpoint.resumeFrom", "", "spec.checkpoint.resumeFrom", "should be at least 1 chars long"),
    ("spec.checkpoint.resumeFrom", 7, "spec.checkpoint.resumeFrom", "must be of type string"),
    ("spec.hfTokenSecret", {"name": "hf"}, "spec.hfTokenSecret.key", "Required value"),
    ("spec.hfTokenSecret", {"name": "Bad_Name", "key": "k"}, "spec.hfTokenSecret.name", "should match"),
    ("spec.serve", {"enabled": True, "image": "v:1", "apiKeySecret": {"key": "k"}}, "spec.serve.apiKeySecret.name",
     "Required value"),
    ("spec.serve", {"enabled": True, "image": "v:1", "apiKeySecret": {"name": "key", "key": "a/b"}},
     "spec.serve.apiKeySecret.key", "should match"),
    ("spec.serve", {"enabled": True, "image": "v:1", "apiKeySecret": {"name": "key", "key": ""}},
     "spec.serve.apiKeySecret.key", "should be at least 1 chars long"),
    ("spec.serve", {"enabled": False, "apiKeySecret": "key"}, "spec.serve.apiKeySecret", "must be an object"),
    ("spec.verification.timeoutSeconds", 1, "spec.verification.timeoutSeconds", "should be greater than or equal to 10"),
    ("spec.verification.enabled", "true", "spec.verification.enabled", "must be of type boolean"),
    ("spec.provisioningTimeoutSeconds", -5, "spec.provisioningTimeoutSeconds", "should be greater than or equal to 5"),
    ("spec.recovery.maxSliceReplacements", 21, "spec.recovery.maxSliceReplacements", "should be less than or equal to 20"),
    ("spec.recovery.maxSliceReplacements", "two", "spec.recovery.maxSliceReplacements", "integer"),
    ("spec.ttlSecondsAfterFinished", -1, "spec.ttlSecondsAfterFinished", "should be greater than or equal to 0"),
    ("spec.resources", {"worker": {"limits": {"google.com/tpu": "8"}}},
     "spec.resources.worker.limits.google.com/tpu", "derived from spec.topology"),
    ("spec.resources", {"head": {"requests": {"cpu": "lots"}}}, "spec.resources.head.requests.cpu", "quantity"),
    ("spec.resources", {"shmSize": "big"}, "spec.resources.shmSize", "should match"),
    ("spec.scheduling", {"spot": True, "reservation": "r1"}, "spec.scheduling", "mutually exclusive"),
    ("spec.scheduling", {"provisioning": "flexStart", "spot": True}, "spec.scheduling", "excludes spot and reservation"),
    ("spec.scheduling", {"provisioning": "flexStart", "reservation": "r1"}, "spec.scheduling", "excludes spot"),
    ("spec.scheduling", {"provisioning": "dws"}, "spec.scheduling.provisioning", "Unsupported value"),
    ("spec.scheduling", {"maxRunDurationSeconds": 3600}, "spec.scheduling", "flexStart only"),
    ("spec.scheduling", {"provisioning": "flexStart", "maxRunDurationSeconds": 8 * 86400},
     "spec.scheduling.maxRunDurationSeconds", "less than or equal to 604800"),
    ("spec.scheduling", {"nodeSelector": {"a": 1}}, "spec.scheduling.nodeSelector", "map of strings"),
    ("spec.scheduling", {"tolerations": "all"}, "spec.scheduling.tolerations", "list"),
    ("spec.scheduling", {"tolerations": [{"key": "a", "tolerationSeconds": "10"}]},
     "spec.scheduling.tolerations[0].tolerationSeconds", "must be of type integer"),
    ("spec.scheduling", {"tolerations": [{"key": 5}]}, "spec.scheduling.tolerations[0].key", "must be of type string"),
    ("spec.labels", ["a"], "spec.labels", "map of strings"),
    ("spec.env", [{"name": "1BAD"}], "spec.env[0].name", "should match"),
    ("spec.env", [{"name": "A", "value": "1", "valueFrom": {}}], "spec.env[0]", "not both"),
    ("spec.env", [{"name": "RAY_AUTH_MODE", "value": "disabled"}], "spec.env[0].name", "reserved"),
    ("spec.env", [{"name": "A", "value": "1"}, {"name": "RAY_AUTH_TOKEN", "value": "t"}], "spec.env[1].name",
     "reserved"),
    ("spec.env", [{"name": "TPUFT_SERVE_API_KEY", "value": "k"}], "spec.env[0].name", "spec.serve.apiKeySecret"),
    ("spec.env", [{"name": "TPU_NAME", "value": "mine"}], "spec.env[0].name", "names each slice"),
    ("spec.serve", {"enabled": True}, "spec.serve.image", "required with engine vllm"),
    ("spec.serve", {"enabled": True, "engine": "vllm"}, "spec.serve.image", "training image has no vLLM"),
    ("spec.serve", {"enabled": True, "engine": "tgi"}, "spec.serve.engine", 'supported values: "vllm", "transformers"'),
    ("spec.serve", {"enabled": True, "engine": "transformers", "topology": "3x3"}, "spec.serve.topology", "v6e"),
    ("spec.serve", {"enabled": True, "engine": "transformers", "accelerator": "v9"}, "spec.serve.accelerator",
     "unknown accelerator"),
    ("spec.serve", {"enabled": True, "engine": "transformers", "accelerator": "tpu7x"}, "spec.serve.topology", "3D"),
    ("spec.serve", {"enabled": True, "engine": "transformers", "replicas": 0}, "spec.serve.replicas", "between 1"),
    ("spec.serve", {"enabled": True, "engine": "transformers", "replicas": "2"}, "spec.serve.replicas", "integer"),
    ("spec.serve", {"enabled": True, "engine": "transformers", "replicas": {"min": 3, "max": 2}}, "spec.serve.replicas",
     "min (3) is above max (2)"),
    ("spec.serve", {"enabled": True, "engine": "transformers", "replicas": {"min": 0, "max": 2}},
     "spec.serve.replicas.min", "between 1"),
    ("spec.serve", {"enabled": True, "engine": "transformers", "replicas": {"min": 1, "max": 65}},
     "spec.serve.replicas.max", "between 1 and 64"),
    ("spec.serve", {"enabled": True, "engine": "transformers", "replicas": {"min": 2}}, "spec.serve.replicas",
     "max missing"),
    ("spec.serve", {"enabled": True, "engine": "transformers", "replicas": {"min": 1, "max": 2, "target": 1}},
     "spec.serve.replicas", "unknown key(s) target"),
    ("spec.serve", {"enabled": "yes"}, "spec.serve.enabled", "must be of type boolean"),
    ("spec.serve", {"enabled": False, "timeoutSeconds": 5}, "spec.serve.timeoutSeconds",
     "should be greater than or equal to 10"),
    ("spec.serve", {"enabled": True, "image": "vllm:1", "maxModelLength": 8}, "spec.serve.maxModelLength",
     "should be greater than or equal to 16"),
    ("spec.serve", {"enabled": True, "image": "vllm tpu"}, "spec.serve.image", "shell characters"),
    ("spec.serve", {"enabled": True, "image": "v:1", "resources": {"worker": {"limits": {"google.com/tpu": "4"}}}},
     "spec.serve.resources.worker.limits.google.com/tpu", "derived from spec.topology"),
    ("metadata.name", "x" * 41, "metadata.name", "at most 40"),
    ("metadata.name", "Bad_Name", "metadata.name", "DNS label"),
    ("metadata.name", DELETE, "metadata.name", "is required"),
    ("apiVersion", "tpufinetune.dev/v1", "apiVersion", "v1alpha1"),
    ("kind", "RayJob", "kind", "TPUFinetune"),
    ("spec", DELETE, "spec", "is required"),
    ("spec.training.framework", "flax", "spec.training.framework", 'supported values: "torch", "jax"'),
    ("spec.training.framework", 1, "spec.training.framework", "must be of type string"),
    ("spec.training", {"method": "qlora"}, "spec.training.method", 'supported values: "full", "lora"'),
    ("spec.training", {"lora": {"rank": 8}}, "spec.training.lora", "method is full"),
    ("spec.training", {"method": "lora", "lora": {"rank": 12}}, "spec.training.lora.rank", 'Unsupported value: 12: supported values: "1", "2", "4", "8", "16", "32", "64", "128", "256", "512", "1024"'),
    ("spec.training", {"method": "lora", "lora": {"rank": 2048}}, "spec.training.lora.rank", "Unsupported value: 2048"),
    ("spec.training", {"method": "lora", "lora": {"alpha": 0}}, "spec.training.lora.alpha", "should be greater than or equal to 1"),
    ("spec.training", {"method": "lora", "lora": {"dropout": 1}}, "spec.training.lora.dropout", "should be less than 1"),
    ("spec.training", {"method": "lora", "lora": {"targetModules": []}}, "spec.training.lora.targetModules",
     "non-empty list"),
    ("spec.training", {"method": "lora", "lora": {"targetModules": ["self_attn.q_proj"]}},
     "spec.training.lora.targetModules", "not a module name"),
    ("spec.training", {"method": "lora", "lora": {"targetModules": ["q_proj", "q_proj"]}},
     "spec.training.lora.targetModules", "more than once"),
    ("spec.export", {"merge": True}, "spec.export.merge", "set spec.training.method: lora"),
]


@pytest.mark.parametrize("path,value,field,words", BAD, ids=[f"{b[0]}={b[1]!r}"[:60] for b in BAD])
def test_every_bad_field_is_reported_by_path(path, value, field, words):
    with pytest.raises(SpecError) as err:
        parse(with_(path, value))
    fields = {p.field: p.message for p in err.value.problems}
    assert field in fields, fields
    assert words in fields[field]


def test_all_problems_are_reported_in_one_pass_with_where():
    doc = with_("spec.training.epochs", 0, with_("spec.image", DELETE, with_("spec.topology", "3x3")))
    doc["metadata"]["namespace"] = "team-a"
    with pytest.raises(SpecError) as err:
        parse(doc)
    assert {p.field for p in err.value.problems} >= {"spec.topology", "spec.image", "spec.training.epochs"}
    assert str(err.value).startswith("team-a/gemma4-dolly: ")


# Every field that takes a gs:// URI (tpuft.api.spec.URI_FIELD); a query would be read as client options
# and the run's directory appended after it.
URI_FIELDS = ("spec.checkpoint.storagePath", "spec.checkpoint.resumeFrom", "spec.model", "spec.dataset.name",
              "spec.evaluation.name")


@pytest.mark.parametrize("path", URI_FIELDS)
@pytest.mark.parametrize("uri", ["gs://bucket/runs?endpoint_override=http://127.0.0.1:4443",
                                 "gs://bucket/runs#v2", "gs://bucket?x=1"])
def test_a_gs_uri_with_a_query_or_fragment_is_refused_naming_the_field(path, uri):
    doc = with_("spec.evaluation", {"split": "test"}) if path.startswith("spec.evaluation") else MINIMUM
    with pytest.raises(SpecError) as err:
        parse(with_(path, uri, base=doc))
    assert [(p.field, "takes no query (?...) or fragment (#...)" in p.message) for p in err.value.problems] == [
        (path, True)]


@pytest.mark.parametrize("path", URI_FIELDS)
def test_an_s3_uri_is_refused_saying_what_to_use_instead(path):
    doc = with_("spec.evaluation", {"split": "test"}) if path.startswith("spec.evaluation") else MINIMUM
    with pytest.raises(SpecError) as err:
        parse(with_(path, "s3://bucket/run", base=doc))
    assert [p.field for p in err.value.problems] == [path] and "copy the data to a gs:// bucket" in str(err.value)


@pytest.mark.parametrize("path", URI_FIELDS)
def test_a_plain_gs_uri_and_a_question_mark_outside_one_are_accepted(path):
    doc = with_("spec.evaluation", {"split": "test"}) if path.startswith("spec.evaluation") else MINIMUM
    parse(with_(path, "gs://bucket/runs/a_b-c.d", base=doc))
    if path not in ("spec.checkpoint.storagePath", "spec.checkpoint.resumeFrom"):   # not a gs:// URI: not ours
        parse(with_(path, "org/data?v", base=doc))


def test_service_account_name_and_its_annotations_are_one_or_the_other():
    both = with_("spec.serviceAccountName", "team-ksa", with_("spec.serviceAccountAnnotations", {"a": "b"}))
    with pytest.raises(SpecError) as err:
        parse(both)
    assert [p.field for p in err.value.problems] == ["spec.serviceAccountAnnotations"]
    assert "annotate it yourself" in str(err.value)
    assert parse(with_("spec.serviceAccountName", "team-ksa")).spec.service_account_name == "team-ksa"


@pytest.mark.parametrize("path,value,message", [
    ("spec.serviceAccountName", "Team_KSA", "should match"),
    ("spec.serviceAccountAnnotations", {"bad key!": "x"}, "qualified names"),
    ("spec.serviceAccountAnnotations", ["x"], "map of strings"),
])
def test_service_account_fields_are_refused_naming_the_field(path, value, message):
    with pytest.raises(SpecError) as err:
        parse(with_(path, value))
    assert [p.field for p in err.value.problems] == [path] and message in str(err.value)


def test_parsed_types_are_frozen():
    t = parse(MINIMUM)
    with pytest.raises(AttributeError):
        t.spec.slices = 2  # type: ignore[misc]


@pytest.mark.parametrize("uri", ["gs://my-bucket/ckpt/default-demo-uid/checkpoint_step_0000099",
                                 "/mnt/ckpt/default-demo-uid"])
def test_resume_from_accepts_what_the_storage_layer_reads(uri):
    assert parse(with_("spec.checkpoint.resumeFrom", uri)).spec.checkpoint.resume_from == uri
    assert parse(MINIMUM).spec.checkpoint.resume_from is None



@pytest.mark.parametrize("volume,message", [
    ({"emptyDir": {}}, "must name exactly one volume source of persistentVolumeClaim, csi, nfs, hostPath"),
    ({"hostPath": {"path": "/x"}, "nfs": {"server": "s", "path": "/"}}, "exactly one volume source"),
    ({"hostPath": "/x"}, "spec.checkpoint.volume.hostPath: must be an object"),
    ("pvc", "exactly one volume source"),
])
def test_checkpoint_volume_refusals_name_the_field(volume, message):
    with pytest.raises(SpecError) as err:
        parse(with_("spec.checkpoint.volume", volume))
    assert message in str(err.value)


def test_checkpoint_volume_needs_a_path_storage():
    doc = with_("spec.checkpoint.volume", {"persistentVolumeClaim": {"claimName": "filestore"}})
    doc = with_("spec.checkpoint.storagePath", "gs://bucket/runs", base=doc)
    with pytest.raises(SpecError, match="storagePath, which must then be an absolute path"):
        parse(doc)


@pytest.mark.parametrize("replicas, want, fixed", [
    (None, ServeReplicas(1, 1), True),
    (3, ServeReplicas(3, 3), True),
    ({"min": 2, "max": 2}, ServeReplicas(2, 2), True),
    ({"min": 1, "max": 4}, ServeReplicas(1, 4), False),
])
def test_serve_replicas_are_a_number_or_min_and_max(replicas, want, fixed):
    serve = {"enabled": True, "image": "vllm-tpu:1", **({} if replicas is None else {"replicas": replicas})}
    got = parse(with_("spec.serve", serve)).spec.serve.replicas
    assert (got, got.fixed) == (want, fixed)


def test_serve_defaults_to_the_training_slice_and_the_engine_to_the_accelerator():
    tpu = parse(with_("spec.serve", {"enabled": True, "image": "vllm-tpu:1"})).spec.serve
    assert (tpu.slice.generation, tpu.slice.topology, tpu.engine.value, tpu.image) == ("v6e", "4x4", "vllm", "vllm-tpu:1")
    assert (tpu.replicas, tpu.timeout_seconds, tpu.max_model_length) == (ServeReplicas(1, 1), 1800, None)
    cpu_doc = with_("spec.topology", "2", with_("spec.accelerator", "cpu", with_("spec.serve", {"enabled": True})))
    cpu = parse(cpu_doc).spec.serve
    assert cpu.engine.value == "transformers" and cpu.image == MINIMUM["spec"]["image"]   # the training image
    other = parse(with_("spec.serve", {"enabled": True, "image": "v:1", "topology": "2x4"})).spec.serve
    assert (other.slice.topology, other.slice.hosts) == ("2x4", 1)


def test_a_disabled_or_absent_serve_section_serves_nothing():
    assert parse(MINIMUM).spec.serve is None
    assert parse(with_("spec.serve", {"enabled": False})).spec.serve is None   # no image needed to not serve


def test_max_model_length_is_checked_against_a_builtin_models_context():
    doc = with_("spec.model", "builtin:tiny-llama", with_("spec.serve", {"enabled": True, "image": "v:1",
                                                                         "maxModelLength": 8192}))
    with pytest.raises(SpecError, match="longer than builtin:tiny-llama's context"):
        parse(doc)


def test_every_rayservice_name_fits_kuberays_limit():
    """metadata.name is capped so that "{name}-serve" always fits KubeRay's 47 characters."""
    from tpuft.controller import builders
    longest = parse(with_("metadata.name", "x" * MAX_NAME_LENGTH, with_("spec.serve", {"enabled": True, "image": "v:1"})))
    assert len(builders.names(longest).service) <= kuberay.RAYSERVICE_MAX_NAME_LENGTH


def test_serve_api_key_secret_is_parsed_with_its_default_key():
    serve = {"enabled": True, "image": "v:1"}
    assert parse(with_("spec.serve", serve)).spec.serve.api_key_secret is None
    got = parse(with_("spec.serve", {**serve, "apiKeySecret": {"name": "chat-key"}})).spec.serve.api_key_secret
    assert got == spec_mod.SecretKeyRef("chat-key", c.SERVE_API_KEY_SECRET_KEY) == spec_mod.SecretKeyRef("chat-key", "api-key")
    null_key = {**serve, "apiKeySecret": {"name": "chat-key", "key": None}}
    assert parse(with_("spec.serve", null_key)).spec.serve.api_key_secret.key == "api-key"
    other = parse(with_("spec.serve", {**serve, "apiKeySecret": {"name": "chat-key", "key": "token"}}))
    assert other.spec.serve.api_key_secret == spec_mod.SecretKeyRef("chat-key", "token")


# Every reserved key and prefix (tpuft.api.constants, also the CRD's CEL rule: tests/unit/test_crd.py), with
# the map it is refused in. A prefix is tried with a name under it.
RESERVED = ([("labels", k) for k, _ in c.RESERVED_LABELS.keys]
            + [("labels", p + "x") for p, _ in c.RESERVED_LABELS.prefixes]
            + [("annotations", k) for k, _ in c.RESERVED_ANNOTATIONS.keys]
            + [("annotations", p + "x") for p, _ in c.RESERVED_ANNOTATIONS.prefixes])


@pytest.mark.parametrize("field,key", RESERVED, ids=[f"{f}:{k}" for f, k in RESERVED])
def test_reserved_label_and_annotation_keys_are_refused_by_path(field, key):
    with pytest.raises(SpecError) as err:
        parse(with_(f"spec.{field}", {"team": "ml", key: "v"}))
    (problem,) = err.value.problems
    assert problem.field == f"spec.{field}.{key}"
    assert problem.message.startswith("is reserved: ") and problem.message.endswith("; remove it")


@pytest.mark.parametrize("field,key", [("labels", "app.kubernetes.io/part-of"), ("labels", "kueue.x-k8s.io/queue-name"),
                                       ("annotations", "app.kubernetes.io/name"), ("labels", "ray.iox/a"),
                                       ("annotations", "example.com/ray.io"), ("labels", "tpufinetune.dev")])
def test_keys_near_the_reserved_ones_are_the_users(field, key):
    assert dict(getattr(parse(with_(f"spec.{field}", {key: "v"})).spec, field)) == {key: "v"}


def _evaluated(dataset: dict, evaluation: dict):
    return parse(with_("spec.evaluation", evaluation, with_("spec.dataset", dataset)))


def test_an_eval_set_that_is_the_training_set_is_refused_naming_both_splits_and_the_fix():
    """Eval loss, keepBest and early stopping on trained records measure memorisation: refused by the
    parser (the operator's admission and `tpuft validate` alike), with the split that fixes it."""
    with pytest.raises(SpecError) as e:
        _evaluated({"name": "d"}, {"split": "train[-200:]"})   # dataset.split defaults to train
    assert [str(p) for p in e.value.problems] == [
        "spec.evaluation.split: 'train[-200:]' reads records spec.dataset.split 'train' trains on (both of d): the "
        "eval loss, keepBest and early stopping would measure memorisation; use "
        "spec.dataset.split train[:-200] and spec.evaluation.split train[-200:], or hold records out with "
        "spec.evaluation.fraction"]
    with pytest.raises(SpecError) as e:   # the same dataset named, no split: all of its training records
        _evaluated({"name": "d", "split": "train[:1000]"}, {"name": "d"})
    assert [p.field for p in e.value.problems] == ["spec.evaluation.name"]
    assert e.value.problems[0].message.startswith("the same dataset with no split reads records spec.dataset.split "
                                                  "'train[:1000]' trains on (both of d)")
    with pytest.raises(SpecError, match=r"spec.evaluation.split: 'train\[10%:30%\]' reads records spec.dataset.split "
                                        r"'train\[:20%\]' trains on"):
        _evaluated({"name": "d", "split": "train[:20%]"}, {"split": "train[10%:30%]"})


@pytest.mark.parametrize("dataset, evaluation", [
    ({"name": "d", "split": "train[:-200]"}, {"split": "train[-200:]"}),
    ({"name": "d", "split": "train[:10%]"}, {"split": "train[10%:20%]"}),
    ({"name": "d"}, {"split": "test"}),
    ({"name": "d"}, {"name": "other", "split": "train"}),
    ({"name": "d"}, {"fraction": 0.1}),
])
def test_an_eval_set_apart_from_the_training_records_is_accepted_without_a_warning(dataset, evaluation):
    assert spec_mod.spec_warnings(_evaluated(dataset, evaluation).spec) == []


def test_an_overlap_the_spec_cannot_decide_is_a_warning_not_a_refusal():
    """Percent against a count, or counts from both ends: the split's size decides, which the spec
    does not say."""
    spec = _evaluated({"name": "d", "split": "train[:1000]"}, {"split": "train[-200:]"}).spec
    assert spec_mod.spec_warnings(spec) == [
        "warning: spec.evaluation.split: 'train[-200:]' may read records spec.dataset.split 'train[:1000]' trains on "
        "(both of d; it depends on the split's size, which the spec does not say): use "
        "spec.dataset.split train[:-200] and spec.evaluation.split train[-200:], or hold records out with "
        "spec.evaluation.fraction"]
    assert len(spec_mod.spec_warnings(_evaluated({"name": "d", "split": "train[:50%]"},
                                                 {"split": "train[-100:]"}).spec)) == 1


# --- adapters on a shared base: training.method none, spec.serve.adapters, spec.publish ----------------
def _base(**spec):
    doc = with_("spec.dataset", DELETE, with_("spec.training", {"method": "none"}))
    return with_("spec", {**doc["spec"], "serve": {"enabled": True, "image": "vllm:1", "adapters": {}}, **spec},
                 base=doc)


def _lora(**publish):
    return with_("spec.publish", {"to": "base", **publish},
                 with_("spec.evaluation", {"fraction": 0.1}, with_("spec.training", {"method": "lora"})))


def test_a_base_needs_no_dataset_and_takes_the_adapter_defaults():
    tft = parse(_base())
    assert not tft.spec.trains and tft.spec.serve.adapters == spec_mod.ServeAdapters(max_per_replica=8, max_rank=64)
    assert spec_mod.PRESENT_DEFAULTS["serve.adapters.maxPerReplica"] == 8


def test_a_lora_fine_tune_publishes_under_its_name_unless_it_gives_one():
    tft = parse(_lora())
    assert tft.spec.publish == spec_mod.Publish(to="base", adapter=None, when="ifBetter", margin=0.0)
    assert tft.adapter_name == "gemma4-dolly"
    assert parse(_lora(**{"as": "dolly", "when": "always", "margin": 0.5})).adapter_name == "dolly"


ADAPTER_REFUSALS = [
    (_lora(to="gemma4-dolly"), "spec.publish.to", "names this object itself"),
    (with_("spec.training", {"method": "full"}, _lora(when="always")), "spec.publish", "needs training.method lora"),
    (with_("spec.evaluation", DELETE, _lora()), "spec.publish.when", "give spec.evaluation, or set when: always"),
    (_lora(**{"as": "Not_A_Label"}), "spec.publish.as", "should match"),
    (_lora(margin=-1), "spec.publish.margin", "greater than or equal to 0"),
    (_lora(when="sometimes"), "spec.publish.when", "Unsupported value"),
    (with_("spec.serve", {"enabled": True, "image": "v", "adapters": {}}, _lora()), "spec.serve.adapters",
     "needs training.method none"),
    (_base(serve={"enabled": True, "image": "v", "adapters": {"maxPerReplica": 0}}),
     "spec.serve.adapters.maxPerReplica", "greater than or equal to 1"),
    (_base(serve={"enabled": True, "image": "v", "adapters": {"maxRank": 48}}), "spec.serve.adapters.maxRank",
     "Unsupported value"),
    (_base(serve={"enabled": False}), "spec.serve", "set serve.enabled true"),
    (_base(evaluation={"fraction": 0.1}), "spec.evaluation", "needs a run that trains"),
    (_base(checkpoint={"storagePath": "/mnt/ck", "volume": {"hostPath": {"path": "/mnt/ck"}}}),
     "spec.serve.adapters", "give a gs:// storagePath, or serve with engine transformers"),
    (with_("spec.dataset", DELETE), "spec.dataset", "is required"),
]


@pytest.mark.parametrize("doc,field,words", ADAPTER_REFUSALS, ids=[f"{r[1]}:{r[2]}"[:60] for r in ADAPTER_REFUSALS])
def test_adapter_refusals_name_the_field_and_what_to_do(doc, field, words):
    with pytest.raises(SpecError) as err:
        parse(doc)
    found = {p.field: p.message for p in err.value.problems}
    assert field in found and words in found[field], found


def test_the_parsers_adapter_rules_are_the_crds():
    """The CEL rules on spec and the parser say the same words (one source: spec.ADAPTER_RULES)."""
    from tpuft.api import crd

    rules = crd.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"][
        "x-kubernetes-validations"]
    assert all(rule in rules for rule in spec_mod.ADAPTER_RULES)
    messages = {m for _, _, m in ADAPTER_REFUSALS}
    for rule in spec_mod.ADAPTER_RULES:   # each rule's refusal is exercised above, in its own words
        assert any(words in rule["message"] for words in messages), rule["message"]


def test_the_eval_set_fingerprint_follows_the_spec():
    held_out = parse(_lora()).spec.eval_set
    assert held_out == "heldout:0.1:seed42:databricks/databricks-dolly-15k[train[:1024]]"
    reseeded = with_("spec.training.seed", 7, _lora())
    assert parse(reseeded).spec.eval_set != held_out
    split = with_("spec.evaluation", {"split": "test"}, _lora())
    assert parse(split).spec.eval_set == "split:databricks/databricks-dolly-15k[test]"
    assert parse(MINIMUM).spec.eval_set is None
