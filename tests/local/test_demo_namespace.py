"""`tpuft demo --namespace NS` with an object queued to Kueue (`--rehearse-tpu --flex-start`), pure:
the LocalQueue its label names is made in NS on the local cluster, the same object `tpuft cluster up`
makes in tpuft-demo, and looked up elsewhere, a missing one refused with the reason instead of a run
Queued for good."""
from __future__ import annotations

import argparse

import pytest
from kubernetes.client.rest import ApiException

from tpuft.api import kueue as kueue_names
from tpuft_local import demo, kueue, pools
from tpuft_local.demo_objects import DEMO_NAMESPACE, DemoError


class LocalQueues:
    """The CustomObjectsApi calls _ensure_local_queue makes; `answer` is the HTTP status of the call
    (None: it succeeds)."""

    def __init__(self, answer: int | None = None):
        self.answer, self.created, self.read = answer, [], []

    def create_namespaced_custom_object(self, group, version, namespace, plural, body):
        assert (group, version, plural) == (kueue_names.KUEUE_GROUP, kueue_names.KUEUE_VERSION, "localqueues")
        self.created.append((namespace, body))
        if self.answer:
            raise ApiException(status=self.answer, reason="Conflict" if self.answer == 409 else "NotFound")

    def get_namespaced_custom_object(self, group, version, namespace, plural, name):
        assert (group, version, plural) == (kueue_names.KUEUE_GROUP, kueue_names.KUEUE_VERSION, "localqueues")
        self.read.append((namespace, name))
        if self.answer:
            raise ApiException(status=self.answer, reason="Forbidden" if self.answer == 403 else "NotFound")
        return {}


def _flex_start_manifest(namespace: str = "bars-flex") -> dict:
    p = argparse.ArgumentParser()
    demo.add_demo_arguments(p)
    manifest = demo._manifest(p.parse_args(["--rehearse-tpu", "--flex-start", "--namespace", namespace]))
    manifest["metadata"]["namespace"] = namespace
    return manifest


def _cluster_ups_local_queues(namespace: str) -> list[dict]:
    """The LocalQueues `tpuft cluster up` makes (tpuft_local.cluster: queue_objects, flex_start_objects,
    tas_objects for the first v6e pool)."""
    pool = pools.DEFAULT_POOLS[0]
    objs = [*kueue.queue_objects(pools.DEFAULT_POOLS, namespace), *kueue.flex_start_objects(pool, namespace),
            *kueue.tas_objects(pool, namespace)]
    return [o for o in objs if o["kind"] == "LocalQueue"]


def test_the_demos_local_queues_are_the_ones_cluster_up_makes_in_the_demo_namespace():
    made = _cluster_ups_local_queues(DEMO_NAMESPACE)
    assert [o["metadata"]["name"] for o in made] == list(kueue.DEMO_LOCAL_QUEUES) == ["local", "flex-start", "tas"]
    assert made == [kueue.demo_local_queue(DEMO_NAMESPACE, name) for name in kueue.DEMO_LOCAL_QUEUES]


def test_a_flex_start_rehearsal_in_another_namespace_makes_its_local_queue_there(capsys):
    api = LocalQueues()
    demo._ensure_local_queue(api, _flex_start_manifest(), "bars-flex", demo.Clock(), local_cluster=True)
    expected = next(o for o in _cluster_ups_local_queues("bars-flex") if o["metadata"]["name"] == kueue.FLEX_START)
    assert api.created == [("bars-flex", expected)]
    assert expected["spec"] == {"clusterQueue": "flex-start"}
    assert "created LocalQueue bars-flex/flex-start" in capsys.readouterr().out


def test_a_local_queue_already_there_is_kept():
    api = LocalQueues(answer=409)
    demo._ensure_local_queue(api, _flex_start_manifest(), "bars-flex", demo.Clock(), local_cluster=True)
    assert len(api.created) == 1


def test_an_object_with_no_queue_label_needs_no_local_queue():
    p = argparse.ArgumentParser()
    demo.add_demo_arguments(p)
    api = LocalQueues()
    demo._ensure_local_queue(api, demo._manifest(p.parse_args(["--rehearse-tpu"])), "bars", demo.Clock(), True)
    assert api.created == api.read == []


def test_a_local_cluster_without_kueue_is_said():
    with pytest.raises(DemoError, match=r"cannot create LocalQueue bars-flex/flex-start .*Kueue's API is not served"):
        demo._ensure_local_queue(LocalQueues(answer=404), _flex_start_manifest(), "bars-flex", demo.Clock(), True)


def test_another_clusters_missing_local_queue_is_refused_with_the_reason():
    api = LocalQueues(answer=404)
    with pytest.raises(DemoError) as e:
        demo._ensure_local_queue(api, _flex_start_manifest(), "bars-flex", demo.Clock(), local_cluster=False)
    assert api.created == [] and api.read == [("bars-flex", "flex-start")]
    assert ("LocalQueue bars-flex/flex-start (the object's label kueue.x-k8s.io/queue-name) does not exist, and Kueue "
            "would keep the run Queued until it does: create it in bars-flex") in str(e.value)


def test_a_queue_the_local_cluster_does_not_make_is_looked_up_and_the_local_ones_named():
    manifest = _flex_start_manifest()
    manifest["metadata"]["labels"][kueue_names.KUEUE_QUEUE_LABEL] = "team-a"
    api = LocalQueues(answer=404)
    with pytest.raises(DemoError, match=r"the local cluster's queues: local, flex-start, tas"):
        demo._ensure_local_queue(api, manifest, "bars-flex", demo.Clock(), local_cluster=True)
    assert api.created == [] and api.read == [("bars-flex", "team-a")]


def test_a_refused_read_names_the_queue_and_the_reason():
    with pytest.raises(DemoError, match=r"cannot read LocalQueue bars-flex/flex-start .*: Forbidden"):
        demo._ensure_local_queue(LocalQueues(answer=403), _flex_start_manifest(), "bars-flex", demo.Clock(), False)
