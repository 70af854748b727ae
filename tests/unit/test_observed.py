"""tpuft.observed's table of child kinds (CHILD_KINDS): each row's field is an Observed field,
the status.children keys it reads are in the CRD's status schema, and the liveness rule."""
from __future__ import annotations

import dataclasses

from tpuft import constants as c
from tpuft import crd
from tpuft.kube import CUSTOM
from tpuft.observed import CHILD_KINDS, ClusterObs, IndexedChild, JobObs, Observed, ServiceObs, live


def test_each_child_kind_observes_a_field_of_observed_named_in_the_crds_status_children():
    schema = crd.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    children = schema["properties"]["status"]["properties"]["children"]["properties"]
    fields = {f.name for f in dataclasses.fields(Observed)}
    for kind in CHILD_KINDS:
        assert kind.field in fields and set(kind.expected) <= set(children), kind.kind
        assert CUSTOM[kind.kind] == (kind.group, kind.version, kind.plural)   # the API calls use the same resource
    assert len({k.kind for k in CHILD_KINDS}) == len({k.field for k in CHILD_KINDS}) == len(CHILD_KINDS)


def test_live_children_are_ours_not_deleting_and_not_deleted_by_us():
    entries = [IndexedChild("a", owner_uid="u-1"), IndexedChild("b", deleting=True), IndexedChild("c", owner_uid="u-0"),
               IndexedChild("d"), IndexedChild("e")]
    assert list(live(entries, c.RAYJOB_KIND, "u-1", {(c.RAYJOB_KIND, "e"), (c.RAYCLUSTER_KIND, "d")})) == ["a", "d"]


def test_each_row_turns_what_was_found_into_its_field():
    rows = {k.kind: k for k in CHILD_KINDS}
    cluster = IndexedChild("ft-ray", {"state": "ready"}, suspend=True, generation=2, uid="rc-1")
    assert rows[c.RAYCLUSTER_KIND].observe({"ft-ray": cluster}, ("ft-ray",)) == \
        ClusterObs("ft-ray", {"state": "ready"}, True, 2, "rc-1")
    assert rows[c.RAYCLUSTER_KIND].observe({"ft-ray": cluster}, (None,)) is None          # none expected
    assert rows[c.RAYCLUSTER_KIND].observe({}, ("ft-ray",)) is None                       # expected, absent
    found = {"ft-verify": IndexedChild("ft-verify", {"jobStatus": "SUCCEEDED"}), "ft-old": IndexedChild("ft-old")}
    assert rows[c.RAYJOB_KIND].observe(found, ("ft-verify", None)) == {   # every live one, expected or not
        "ft-verify": JobObs("ft-verify", {"jobStatus": "SUCCEEDED"}), "ft-old": JobObs("ft-old")}
    service = IndexedChild("ft-serve", {"x": 1})
    assert rows[c.RAYSERVICE_KIND].observe({"ft-serve": service}, ("ft-serve",)) == ServiceObs("ft-serve", {"x": 1})
