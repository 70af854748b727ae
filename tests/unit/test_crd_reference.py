"""docs/reference/api.md: generated from the CRD; the committed page must match, and hold every field."""
import re

from tests.paths import REPO
from tpuft.api import crd, crd_reference

PAGE = REPO / "docs" / "reference" / "api.md"


def test_committed_reference_matches_the_generator():
    assert PAGE.read_text() == crd_reference.render(), \
        "docs/reference/api.md is stale: python -m tpuft.api.crd_reference > docs/reference/api.md"


def _fields(schema: dict) -> int:
    """Every property below schema, through nested objects, array items and map values."""
    n = 0
    for prop in (schema.get("properties") or {}).values():
        n += 1 + _fields(prop)
        for key in ("items", "additionalProperties"):
            if isinstance(prop.get(key), dict):
                n += _fields(prop[key])
    return n


def test_every_field_of_metadata_spec_and_status_has_a_row():
    root = crd.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    rows = re.findall(r"^\| `[^`]+`( \(required\))? \|", crd_reference.render(), re.M)
    assert len(rows) == sum(_fields(root["properties"][top]) for top in ("metadata", "spec", "status"))


def test_a_pattern_with_a_pipe_stays_one_table_cell():
    page = crd_reference.render()
    assert "`^[0-9]+(\\.[0-9]+)?(m|k|Ki|Mi|Gi|Ti|Pi|M|G|T|P|E|Ei)?$`" in page   # Python-Markdown keeps code spans whole
