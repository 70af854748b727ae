"""tpuft_local.demo_objects without a cluster: replacing an earlier object of the same name, which
`tpuft demo` and `tpuft demo --gitops` both do first. (The demo itself on the real cluster:
tests/cluster/test_demo.py.)"""
from __future__ import annotations

import pytest
from kubernetes.client.rest import ApiException

from tpuft_local import demo_objects


class Objects:
    """The CustomObjectsApi calls delete_previous makes: an object that is gone after `reads_left`
    reads once deleted; `refuse` answers the delete with that HTTP status."""

    def __init__(self, exists: bool, reads_left: int = 2, refuse: int | None = None):
        self.exists, self.reads_left, self.refuse, self.deleted = exists, reads_left, refuse, False

    def delete_namespaced_custom_object(self, group, version, namespace, plural, name):
        if self.refuse:
            raise ApiException(status=self.refuse, reason="Forbidden")
        if not self.exists:
            raise ApiException(status=404)
        self.deleted = True

    def get_namespaced_custom_object(self, group, version, namespace, plural, name):
        self.reads_left -= 1
        if self.reads_left < 0:
            raise ApiException(status=404)
        return {"metadata": {"name": name}}


@pytest.fixture(autouse=True)
def no_sleep(monkeypatch):
    monkeypatch.setattr(demo_objects.time, "sleep", lambda s: None)


def test_an_earlier_object_is_deleted_and_waited_for():
    objects, said = Objects(exists=True), []
    demo_objects.delete_previous(objects, "ns", "m", said.append)
    assert objects.deleted and objects.reads_left < 0   # read until it was gone
    assert said == ["deleted the previous ns/m; waiting for it to go"]


def test_nothing_to_replace_says_nothing():
    said = []
    demo_objects.delete_previous(Objects(exists=False), "ns", "m", said.append)
    assert said == []


def test_a_refused_delete_names_the_object_and_the_reason():
    with pytest.raises(demo_objects.DemoError, match="cannot replace ns/m: Forbidden"):
        demo_objects.delete_previous(Objects(exists=True, refuse=403), "ns", "m", print)
