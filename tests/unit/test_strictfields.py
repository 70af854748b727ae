"""Unknown fields are refused offline as the API server refuses them (strict field validation),
naming the full path and the nearest valid name; everything the schema admits stays valid."""
from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from tests.factories import MINIMUM, UNKNOWN_FIELDS, with_, with_unknown
from tests.paths import EXAMPLES, REPO
from tpuft.api import crd
from tpuft.cli import strictfields
from tpuft.api.spec import SpecError


@pytest.mark.parametrize("parent,key,value,near", [p[1:] for p in UNKNOWN_FIELDS], ids=[p[0] for p in UNKNOWN_FIELDS])
def test_unknown_field_is_named_with_the_nearest_valid_name(parent, key, value, near):
    doc = with_unknown(parent, key, value)
    problems = strictfields.unknown_fields(doc)
    assert [p.field for p in problems] == [f"{parent}.{key}"]
    assert problems[0].message == f"unknown field; did you mean {near}?"
    with pytest.raises(SpecError) as err:
        strictfields.parse_strict(doc)
    assert f"{parent}.{key}" in [p.field for p in err.value.problems]


@pytest.mark.parametrize("doc,path", [
    (with_("spec.scheduling", {"tolerations": [{"key": "k"}, {"keyy": "k"}]}), "spec.scheduling.tolerations[1].keyy"),
    (with_("spec.env", [{"name": "A", "valueFrom": {"secretKeyref": {"name": "s", "key": "k"}}}]),
     "spec.env[0].valueFrom.secretKeyref"),
    (with_("spec.resources", {"worker": {"limits": {"cpu": "1"}, "limit": {}}}), "spec.resources.worker.limit"),
    (with_("status", {"phsae": "Training"}), "status.phsae"),
    (with_("status", {"training": {"los": 1.0}}), "status.training.los"),
], ids=["toleration-item", "env-valueFrom-source", "resources-worker", "status", "status-training"])
def test_unknown_fields_inside_lists_maps_and_status(doc, path):
    assert [p.field for p in strictfields.unknown_fields(doc)] == [path]


def test_every_problem_is_reported_in_one_pass():
    doc = with_unknown("spec.training", "epoch", 3, with_("spec.topology", "2x2x2"))
    with pytest.raises(SpecError) as err:
        strictfields.parse_strict(doc)
    fields = [p.field for p in err.value.problems]
    assert "spec.training.epoch" in fields and "spec.topology" in fields


@pytest.mark.parametrize("doc", [
    MINIMUM,
    # free-form below the schema: map keys, env items and their sources (x-kubernetes-preserve-unknown-fields)
    with_("spec.labels", {"anything.example.com/x": "y"}),
    with_("spec.resources", {"head": {"requests": {"example.com/widget": "1"}}}),
    with_("spec.env", [{"name": "A", "value": "1", "extra": True},
                       {"name": "B", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name", "any": 1}}}]),
    with_("status", {"appliedSpec": {"whatever": {"nested": 1}}}),
    with_("metadata", {"name": "x", "namespace": "n", "labels": {}, "annotations": {}, "uid": "u",
                       "resourceVersion": "1", "generation": 2, "managedFields": [], "creationTimestamp": None}),
], ids=["minimum", "label-keys", "resource-names", "env-items", "applied-spec", "object-meta"])
def test_what_the_schema_admits_is_not_flagged(doc):
    assert strictfields.unknown_fields(doc) == []


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.name)
def test_examples_have_no_unknown_fields(path):
    for doc in yaml.safe_load_all(path.read_text()):   # one TPUFinetune, or a base and its fine-tunes
        assert strictfields.unknown_fields(doc) == []


def test_allowed_names_come_from_the_crd_schema():
    assert strictfields.schema() == crd.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    assert set(strictfields.schema()["properties"]["spec"]["properties"]) >= {"training", "checkpoint", "verification"}


def test_tpuft_validate_and_render_refuse_a_misspelt_field(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(with_unknown("spec", "trainng", {"epochs": 1})))
    for cmd in (["validate", str(bad)], ["render", str(bad)]):
        r = subprocess.run([sys.executable, "-m", "tpuft.cli", *cmd], capture_output=True, text=True, cwd=REPO,
                           timeout=120)
        assert r.returncode == 2, (cmd, r.stdout, r.stderr)
        assert "spec.trainng: unknown field; did you mean training?" in r.stderr, r.stderr
        assert "valid (" not in r.stdout and "Traceback" not in r.stderr
