"""tpuft.controller.phases.serving, pure and on a fixed clock: the decisions of this phase group
(tests/unit/phases/clock.py drives an object there)."""
from __future__ import annotations

import pytest
from tpuft.api import constants as c
from tpuft.api.constants import Phase
from tpuft.controller import builders, observed, phases
from tpuft.controller.diagnosis import PodObs, Waiting
from tpuft.controller.observed import Observed

from tests.unit.phases.clock import (
    NAME,
    NS,
    SERVE_CPU,
    TUN,
    apply,
    at,
    cluster,
    cond,
    job,
    kinds,
    make,
    rayservice,
    run_to,
    training,
)


def served(t: float = 100, **spec) -> tuple[dict, builders.ChildNames, observed.Decision]:
    """A run that has just finished training with serving on (cpu: the transformers engine)."""
    o, n = training(accelerator="cpu", topology="2", serve=dict(SERVE_CPU), **spec)
    o["status"]["training"] = {"exportedModel": "gs://bucket/ck/run/export"}
    d = phases.decide(o, Observed(cluster(2, desired=2, provisioned=True),
                                  {n.train_job: job(n.train_job, "SUCCEEDED", "Complete")}), at(t), TUN)
    return apply(o, d), n, d


def test_training_success_with_serve_releases_the_training_slice_and_creates_the_rayservice():
    o, n, d = served()
    assert d.phase == "Serving" and d.status["reason"] == "Deploying"
    assert kinds(d) == [("delete", "RayCluster", n.cluster), ("create", "RayService", n.service)]
    body = d.actions[1].body
    assert "gs://bucket/ck/run/export" in body["spec"]["serveConfigV2"]   # what training reported it exported
    assert d.status["serving"]["service"] == f"{NAME}-serve-serve-svc" and d.status["serving"]["port"] == 8000
    assert d.status["serving"]["url"] == f"http://{NAME}-serve-serve-svc.{NS}.svc:8000"
    assert d.status["children"]["rayService"] == n.service
    assert cond(d, c.Condition.TRAINING_SUCCEEDED)["status"] == "True"
    assert cond(d, c.Condition.SERVING)["status"] == "False" and cond(d, c.Condition.READY)["status"] == "False"
    assert "completionTime" not in d.status   # Serving is not terminal


def test_serving_becomes_ready_when_the_app_is_running_and_writes_once():
    o, n, _ = served()
    d = phases.decide(o, Observed(service=rayservice("RUNNING", ready=True)), at(200), TUN)
    assert d.phase == "Serving" and d.status["reason"] == "Serving"
    assert cond(d, c.Condition.SERVING)["status"] == "True" and cond(d, c.Condition.READY)["status"] == "True"
    assert "notReadySince" not in d.status["serving"]
    assert d.patch["serving"]["notReadySince"] is None   # a merge patch removes a nested key by null only
    o = apply(o, d)
    assert "notReadySince" not in o["status"]["serving"]
    assert phases.decide(o, Observed(service=rayservice("RUNNING", ready=True)), at(300), TUN).patch is None
    assert not phases.wants_serve_pods(o)


@pytest.mark.parametrize("app,ready", [("DEPLOYING", None), ("RUNNING", False), ("DEPLOY_FAILED", False),
                                       ("UNHEALTHY", False), (None, None)])
def test_an_app_short_of_running_fails_serve_failed_at_the_bound_with_its_message(app, ready):
    o, n, _ = served(t=100)
    svc = rayservice(app, message="Deployment ChatDeployment: replica failed: model_source not found", ready=ready)
    early = phases.decide(o, Observed(service=svc), at(100 + 599), TUN)
    assert early.phase == "Serving" and early.requeue_after == pytest.approx(1)
    assert cond(early, c.Condition.READY)["status"] == "False"
    d = phases.decide(o, Observed(service=svc), at(100 + 600), TUN)
    assert d.phase == "Failed" and d.status["reason"] == "ServeFailed"
    assert "spec.serve.timeoutSeconds (600s)" in d.status["message"]
    if app:
        assert f"app llm {app}" in d.status["message"]
        assert "model_source not found" in d.status["message"]


def test_the_pending_clusters_app_status_is_read_before_there_is_an_active_one():
    o, _, _ = served()
    d = phases.decide(o, Observed(service=rayservice("DEPLOYING", "waiting for replicas", side="pending")), at(150), TUN)
    assert "app llm DEPLOYING: waiting for replicas" in d.status["message"]


def test_a_serving_pods_image_error_is_in_status_with_one_event():
    o, n, _ = served()
    assert phases.wants_serve_pods(o)
    pod = PodObs(name=f"{n.service}-raycluster-x-head", waiting=(
        Waiting("ray-head", "nope:1", "ErrImagePull", 'failed to pull "nope:1": not found'),))
    d = phases.decide(o, Observed(service=rayservice("NOT_STARTED"), pods=(pod,)), at(150), TUN)
    assert "ErrImagePull" in d.status["message"] and "nope:1" in d.status["message"]
    assert [e.reason for e in d.events if e.reason == c.Reason.SLICE_BLOCKED] == [c.Reason.SLICE_BLOCKED]
    o = apply(o, d)
    again = phases.decide(o, Observed(service=rayservice("NOT_STARTED"), pods=(pod,)), at(160), TUN)
    assert [e for e in again.events if e.reason == c.Reason.SLICE_BLOCKED] == []


def test_an_app_that_stops_running_gets_a_fresh_timeout_from_then():
    o, _, _ = served(t=100)
    o = apply(o, phases.decide(o, Observed(service=rayservice("RUNNING", ready=True)), at(200), TUN))
    o = apply(o, phases.decide(o, Observed(service=rayservice("UNHEALTHY", ready=False)), at(5000), TUN))
    assert o["status"]["phase"] == "Serving" and o["status"]["serving"]["notReadySince"] == observed.fmt_time(at(5000))
    assert cond(o, c.Condition.READY)["status"] == "False"
    d = phases.decide(o, Observed(service=rayservice("UNHEALTHY", ready=False)), at(5600), TUN)
    assert d.phase == "Failed" and d.status["reason"] == "ServeFailed"


def test_disabling_serve_deletes_the_rayservice_and_succeeds():
    o, n, _ = served()
    o = apply(o, phases.decide(o, Observed(service=rayservice("RUNNING", ready=True)), at(200), TUN))
    o["spec"]["serve"]["enabled"] = False
    o["metadata"]["generation"] = 2
    d = phases.decide(o, Observed(service=rayservice("RUNNING", ready=True)), at(300), TUN)
    assert d.phase == "Succeeded" and d.status["reason"] == "ServeStopped"
    assert kinds(d) == [("delete", "RayService", n.service)]
    assert "serving" not in d.status and "ignoredSpecChange" not in d.status   # acted on, not ignored
    assert cond(d, c.Condition.READY)["status"] == "True" and cond(d, c.Condition.SERVING)["status"] == "False"


def test_serve_disabled_before_training_ends_succeeds_without_serving():
    o, n = training(accelerator="cpu", topology="2", serve=dict(SERVE_CPU))
    o["spec"]["serve"]["enabled"] = False
    d = phases.decide(o, Observed(cluster(2, desired=2, provisioned=True),
                                  {n.train_job: job(n.train_job, "SUCCEEDED", "Complete")}), at(100), TUN)
    assert d.phase == "Succeeded" and d.status["reason"] == "TrainingComplete" and kinds(d) == []


def test_enabling_serve_on_a_finished_run_is_recorded_as_ignored():
    o, n = training()
    o = apply(o, phases.decide(o, Observed(cluster(4, provisioned=True), {n.train_job: job(n.train_job, "SUCCEEDED",
                                                                                             "Complete")}), at(100), TUN))
    o["spec"]["serve"] = {"enabled": True, "engine": "transformers"}
    o["metadata"]["generation"] = 2
    d = phases.decide(o, Observed(cluster(4, provisioned=True)), at(110), TUN)
    assert d.phase == "Succeeded" and d.status["ignoredSpecChange"]["fields"] == ["spec.serve"]


def test_the_rayservice_deleted_while_serving_fails_child_deleted():
    o, n, _ = served()
    d = phases.decide(o, Observed(service=None), at(150), TUN)
    assert d.phase == "Failed" and d.status["reason"] == "ChildDeleted" and n.service in d.status["message"]


def test_a_failed_serve_keeps_the_rayservice_until_the_ttl():
    o, n, _ = served(t=100)
    o = apply(o, phases.decide(o, Observed(service=rayservice("DEPLOYING")), at(700), TUN))
    assert o["status"]["reason"] == "ServeFailed"
    assert phases.decide(o, Observed(service=rayservice("DEPLOYING")), at(700 + 299), TUN).actions == ()
    d = phases.decide(o, Observed(service=rayservice("DEPLOYING")), at(700 + 300), TUN)
    assert kinds(d) == [("delete", "RayService", n.service)]


def test_objects_that_do_not_serve_carry_no_serving_condition():
    o = run_to(make(), Phase.PROVISIONING)
    assert "Serving" not in [x["type"] for x in o["status"]["conditions"]]
    o = run_to(make(accelerator="cpu", topology="2", serve=dict(SERVE_CPU)), Phase.PROVISIONING)
    assert cond(o, c.Condition.SERVING)["status"] == "Unknown"
