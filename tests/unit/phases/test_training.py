"""tpuft.controller.phases.training, pure and on a fixed clock: the decisions of this phase group
(tests/unit/phases/clock.py drives an object there)."""
from __future__ import annotations

from tpuft.api import constants as c
from tpuft.api.spec import parse
from tpuft.controller import builders, observed, phases
from tpuft.controller.observed import Observed

from tests.unit.phases.clock import NAME, TUN, apply, at, cluster, cond, job, kinds, training


def test_training_success():
    o, n = training()
    d = phases.decide(o, Observed(cluster(4, provisioned=True), {n.train_job: job(n.train_job, "SUCCEEDED", "Complete")}),
                      at(100), TUN)
    assert d.phase == "Succeeded" and d.status["reason"] == "TrainingComplete"
    assert cond(d, c.Condition.READY)["status"] == "True" and cond(d, c.Condition.TRAINING_SUCCEEDED)["status"] == "True"
    assert cond(d, c.Condition.FAILED)["status"] == "False"
    assert d.status["completionTime"] == observed.fmt_time(at(100))
    assert [(e.type, e.reason) for e in d.events] == [("Normal", "TrainingComplete")]
    assert d.requeue_after == 300


def test_training_failure_without_retries():
    o, n = training()
    d = phases.decide(o, Observed(cluster(4, provisioned=True), {n.train_job: job(n.train_job, "FAILED", "Failed",
                      reason="AppFailed", message="OOM")}), at(100), TUN)
    assert d.status["reason"] == "TrainingFailed" and "OOM" in d.status["message"] and d.actions == ()


def test_training_retries_then_fails():
    o, n = training(training={"maxJobRetries": 2})
    jobs: dict = {}
    for attempt in range(3):
        name = n.train_attempt(attempt)
        assert o["status"]["trainingAttempts"] == attempt + 1 and o["status"]["children"]["trainJob"] == name
        jobs[name] = job(name, "FAILED", "Failed", reason="AppFailed")
        d = phases.decide(o, Observed(cluster(4, provisioned=True), dict(jobs)), at(100 + attempt), TUN)
        if attempt < 2:
            nxt = n.train_attempt(attempt + 1)
            assert kinds(d) == [("create", "RayJob", nxt)] and d.phase == "Training"
            assert d.status["reason"] == "Retrying" and [e.reason for e in d.events] == ["Retrying"]
            assert d.actions[0].body == builders.build_train_job(parse(o), attempt + 1)
            jobs[nxt] = job(nxt, "PENDING", "Initializing")
        else:
            assert d.status["reason"] == "TrainingFailed" and "after 3 attempt(s)" in d.status["message"]
            assert d.actions == ()
        o = apply(o, d)
    assert [n.train_attempt(i) for i in range(3)] == [f"{NAME}-train", f"{NAME}-train-r1", f"{NAME}-train-r2"]
