"""The CRD: generated from the catalog and spec defaults; the committed file must match."""
import yaml

from tests.paths import REPO
import pytest

from tpuft.api import catalog, crd
from tpuft.api import constants as c
from tpuft.api.constants import Phase
from tpuft.api.status import OWNED_KEYS
from tpuft.api.spec import DEFAULTS, PRESENT_DEFAULTS, SHELL_SAFE, STORAGE_PATH, UNSAFE
from tpuft_workload.report import TRAINING_KEYS, VERIFICATION_KEYS


def test_committed_crd_matches_the_generator():
    committed = (REPO / "crds" / "tpufinetune.yaml").read_text()
    assert committed == crd.render(), "crds/tpufinetune.yaml is stale: python -m tpuft.api.crd > crds/tpufinetune.yaml"


def _walk(schema, path="spec"):
    yield path, schema
    for k, v in (schema.get("properties") or {}).items():
        yield from _walk(v, f"{path}.{k}")


def test_every_spec_field_has_a_description_for_kubectl_explain():
    spec = crd.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    missing = [p for p, s in _walk(spec) if not s.get("description")]
    assert missing == []


def test_defaults_in_schema_match_the_parser():
    spec = crd.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    schema_defaults = {p[len("spec."):]: s["default"] for p, s in _walk(spec) if "default" in s and s["default"] != {}}
    # spec.training.lora's own defaults apply once the object is there (the API server defaults
    # nothing inside an absent object without a default of its own), as spec.publish's and
    # spec.serve.adapters': PRESENT_DEFAULTS, not DEFAULTS.
    assert schema_defaults == {**DEFAULTS, **PRESENT_DEFAULTS}


def test_every_generation_has_a_topology_rule_and_every_spelling_is_in_the_enum():
    spec = crd.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    rules = " ".join(r["rule"] for r in spec["x-kubernetes-validations"])
    for g in catalog.GENERATIONS:
        assert all(f"'{t}'" in rules for t in g.topologies)
    assert set(catalog.accepted_spellings()) <= {s.lower() for s in spec["properties"]["accelerator"]["enum"]}


def test_status_phases_columns_and_short_name():
    doc = yaml.safe_load(crd.render())
    v = doc["spec"]["versions"][0]
    assert v["subresources"] == {"status": {}}
    assert v["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]["phase"]["enum"] == [p.value for p in Phase]
    cols = {c["name"] for c in v["additionalPrinterColumns"] if not c.get("priority")}
    assert cols == {"Phase", "Accelerator", "Topology", "Loss", "Adapters", "Age"}
    wide = {c["name"]: c["jsonPath"] for c in v["additionalPrinterColumns"] if c.get("priority") == 1}
    assert wide["Framework"] == ".spec.training.framework"   # kubectl get -o wide
    assert doc["spec"]["names"]["shortNames"] == ["tft"]


def test_status_keys_the_workload_writes_are_in_the_status_schema():
    """The API server prunes unknown status fields silently: every key the workload reports is declared."""
    status = crd.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]
    assert set(status["training"]["properties"]) == set(TRAINING_KEYS)
    assert set(status["verification"]["properties"]) == set(VERIFICATION_KEYS)


def test_resume_from_admission_rule_is_the_parsers_pattern():
    ck = crd.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["checkpoint"]
    rf = ck["properties"]["resumeFrom"]
    assert rf["x-kubernetes-validations"][0]["rule"] == f"self.matches(r'{STORAGE_PATH.pattern}')"
    assert (rf["minLength"], rf["maxLength"]) == (1, 1024) and "resumeFrom" not in ck["required"]



def _spec_properties() -> dict:
    return crd.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]


@pytest.mark.parametrize("field,reserved", [("labels", c.RESERVED_LABELS), ("annotations", c.RESERVED_ANNOTATIONS)])
def test_reserved_keys_admission_rule_is_the_parsers_list(field, reserved):
    """The CEL rule refuses exactly the keys and prefixes tpuft.api.spec refuses (one list, tpuft.api.constants)."""
    rules = _spec_properties()[field]["x-kubernetes-validations"]
    (rule,) = [r["rule"] for r in rules if "startsWith" in r["rule"]]
    keys = ", ".join(repr(k) for k, _ in reserved.keys)
    prefixes = " && ".join(f"!k.startsWith({p!r})" for p, _ in reserved.prefixes)
    assert rule == f"self.all(k, !(k in [{keys}]) && {prefixes})"


def test_serve_api_key_secret_mirrors_hf_token_secret_with_an_optional_key():
    props = _spec_properties()
    hf, api = props["hfTokenSecret"], props["serve"]["properties"]["apiKeySecret"]
    assert hf["properties"]["name"] == api["properties"]["name"]
    assert {k: v for k, v in hf["properties"]["key"].items() if k != "description"} == \
           {k: v for k, v in api["properties"]["key"].items() if k != "description"}
    assert (hf["required"], api["required"]) == (["name", "key"], ["name"])
    assert "default" not in api["properties"]["key"]   # the parser's: the server defaults nothing in an optional object


def test_goodput_and_history_are_declared_from_the_constants():
    """The API server would prune them silently otherwise; the history's bound is the workload's."""
    status = crd.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]
    assert set(status["goodput"]["properties"]) == {k.key for k in c.GoodputCause} | {c.GOODPUT_TOTAL, c.GOODPUT_RATIO}
    history = status["training"]["properties"][c.TrainingStatus.HISTORY.value]
    assert history["maxItems"] == c.HISTORY_MAX_POINTS
    assert set(history["items"]["properties"]) == {p.value for p in c.HistoryPoint}
    assert "goodput" in OWNED_KEYS   # the operator's to write (and to keep across reconciles)


def test_descriptions_restate_the_catalogs_facts():
    """The prose is generated from the catalog: every generation named, the shm defaults its table's."""
    props = _spec_properties()
    for g in catalog.GENERATIONS:
        assert g.name in props["accelerator"]["description"] and g.name in props["topology"]["description"]
        if g.worker.from_reference:
            assert f"{g.worker.shm} {g.name}" in props["resources"]["properties"]["shmSize"]["description"]
    assert props["topology"]["maxLength"] == catalog.MAX_TOPOLOGY_LENGTH


def test_image_pull_policy_is_the_constants_enum():
    assert _spec_properties()["imagePullPolicy"]["enum"] == [p.value for p in c.ImagePullPolicy]


@pytest.mark.parametrize("path", ["image", "model", "dataset.name", "dataset.split", "serve.image"])
def test_shell_safe_fields_use_the_parsers_character_class(path):
    node = {"properties": _spec_properties()}
    for key in path.split("."):
        node = node["properties"][key]
    assert node["x-kubernetes-validations"][0]["rule"] == f"self.matches(r'''{SHELL_SAFE.pattern}''')"


@pytest.mark.parametrize("text", ["gs://b/p", "org/model-1.5", "train[:1024]", "a b", "x;y", "$(id)", "a'b", "a\\b"])
def test_shell_safe_pattern_refuses_exactly_what_the_parser_does(text):
    assert bool(SHELL_SAFE.fullmatch(text)) == (not UNSAFE.search(text))
