"""The CRD: generated from the catalog and spec defaults; the committed file must match."""
import yaml

from tests.paths import REPO
from tpuft import catalog, crd
from tpuft.constants import Phase
from tpuft.spec import DEFAULTS, STORAGE_PATH
from tpuft_workload.report import TRAINING_KEYS, VERIFICATION_KEYS


def test_committed_crd_matches_the_generator():
    committed = (REPO / "crds" / "tpufinetune.yaml").read_text()
    assert committed == crd.render(), "crds/tpufinetune.yaml is stale: python -m tpuft.crd > crds/tpufinetune.yaml"


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
    assert schema_defaults == {k: v for k, v in DEFAULTS.items() if k in schema_defaults}
    assert set(schema_defaults) == set(DEFAULTS)


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
    assert cols == {"Phase", "Accelerator", "Topology", "Loss", "Age"}
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

