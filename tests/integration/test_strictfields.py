"""The real kube-apiserver refuses the same misspelt fields `tpuft validate` refuses (strict field
validation, kubectl's default), naming the same path; what it accepts, offline accepts too."""
from __future__ import annotations

import json
import uuid

import pytest
import yaml
from kubernetes import client

from tests.factories import MINIMUM, UNKNOWN_FIELDS, with_, with_unknown
from tests.paths import EXAMPLES
from tpuft.cli import strictfields
from tpuft.api.constants import GROUP, PLURAL, VERSION


@pytest.fixture(scope="module")
def ns(kubectl):
    name = f"strict-{uuid.uuid4().hex[:6]}"
    kubectl("create", "namespace", name, check=True)
    yield name
    kubectl("delete", "namespace", name, "--wait=false", "--ignore-not-found")


@pytest.fixture(scope="module")
def objects(kube_api):
    return client.CustomObjectsApi(kube_api)


def server_unknown(objects, ns, doc) -> list[str]:
    """The unknown fields the server names for a strict dry-run create ([] if it accepts)."""
    try:
        objects.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, doc, dry_run="All",
                                                field_validation="Strict")
        return []
    except client.ApiException as e:
        message = json.loads(e.body).get("message", "")
        assert e.status == 400 and "unknown field" in message, (e.status, message)
        # strict decoding error: unknown field "spec.trainng", unknown field "spec.x"
        return sorted(part.split('"')[1] for part in message.split("unknown field ")[1:])


CASES = [pytest.param(with_unknown(parent, key, value), f"{parent}.{key}", id=rid)
         for rid, parent, key, value, _ in UNKNOWN_FIELDS] + [
    pytest.param(with_("spec.scheduling", {"tolerations": [{"keyy": "k"}]}), "spec.scheduling.tolerations[0].keyy",
                 id="toleration-item"),
    pytest.param(with_("spec.env", [{"name": "A", "valueFrom": {"secretKeyref": {"name": "s", "key": "k"}}}]),
                 "spec.env[0].valueFrom.secretKeyref", id="env-valueFrom-source"),
]


@pytest.mark.parametrize("doc,path", CASES)
def test_server_and_offline_refuse_the_same_unknown_field(objects, ns, doc, path):
    assert server_unknown(objects, ns, doc) == [path]
    assert [p.field for p in strictfields.unknown_fields(doc)] == [path]


@pytest.mark.parametrize("doc", [
    MINIMUM,
    with_("spec.env", [{"name": "A", "value": "1", "extra": True}]),
    with_("spec.resources", {"head": {"requests": {"example.com/widget": "1"}}}),
    *[d for p in sorted(EXAMPLES.glob("*.yaml")) for d in yaml.safe_load_all(p.read_text())],
], ids=["minimum", "env-item-extra", "resource-names",
        *[f"{p.name}:{d['metadata']['name']}" for p in sorted(EXAMPLES.glob("*.yaml"))
          for d in yaml.safe_load_all(p.read_text())]])
def test_server_and_offline_accept_the_same_documents(objects, ns, doc):
    assert server_unknown(objects, ns, doc) == []
    assert strictfields.unknown_fields(doc) == []


def test_kubectl_default_validation_refuses_a_misspelt_field(kubectl, ns):
    doc = with_unknown("spec", "trainng", {"epochs": 1})
    res = kubectl("apply", "--dry-run=server", "-n", ns, "-f", "-", input=yaml.safe_dump(doc))
    assert res.returncode != 0 and 'unknown field "spec.trainng"' in res.stderr, res.stderr
