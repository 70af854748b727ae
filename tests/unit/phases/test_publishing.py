"""tpuft.controller.phases.decide for adapters on a shared base, pure and on a fixed clock: a base (training.method
none) serves from its first reconcile; a LoRA fine-tune (spec.publish) is refused against the wrong base
before training, publishes on the base's serving cluster once it succeeds, is kept unpublished with both
figures when not better, and is superseded by a newer publication; a base lists its adapters and removes
the adapter of a fine-tune that was deleted."""
from __future__ import annotations

import copy
import shlex
from datetime import datetime, timedelta, timezone

import pytest

from tpuft.api import constants as c
from tpuft.api.spec import parse
from tpuft.controller import builders, observed, phases
from tpuft.controller.observed import ClusterObs, JobObs, Observed, PeerObs, PublishedObs, ServiceObs

from tests.factories import merge_patch, small_object

T0 = datetime(2026, 1, 1, 12, 0, 0, tzinfo=timezone.utc)
TUN = observed.Tunables(verify_grace_seconds=60)
NS, BASE, FT = "team-a", "tiny", "ft"
BASE_CLUSTER = f"{BASE}-serve-raycluster-abcde"
BASE_ROOT = f"gs://bucket/ck/{NS}-{BASE}-u-base/adapters"
EVAL = {"fraction": 0.1}
EVAL_SET = "heldout:0.1:seed42:d[train]"


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def apply(o: dict, d: observed.Decision) -> dict:
    o = copy.deepcopy(o)
    merge_patch(o.setdefault("status", {}), d.patch or {})
    return o


def cond(d: observed.Decision, ctype: c.Condition) -> dict:
    return next(x for x in d.status["conditions"] if x["type"] == ctype.value)


def kinds(d: observed.Decision) -> list[tuple[str, str, str]]:
    return [(a.op.value, a.kind, a.name) for a in d.actions]


def job(name: str, job_status: str = "RUNNING", deploy: str = "Running") -> JobObs:
    return JobObs(name, {"jobStatus": job_status, "jobDeploymentStatus": deploy})


def base_object(**serve) -> dict:
    o = small_object(BASE, NS, {"uid": "u-base", "generation": 1}, accelerator="cpu", topology="1",
                     training={"method": "none"}, serve={"enabled": True, "adapters": {}, **serve})
    o["spec"].pop("dataset")
    return o


def running_service(cluster: str | None = BASE_CLUSTER) -> ServiceObs:
    active = {"applicationStatuses": {c.SERVE_APP_NAME: {"status": "RUNNING"}}}
    if cluster:
        active["rayClusterName"] = cluster
    return ServiceObs(f"{BASE}-serve", {"activeServiceStatus": active,
                                        "conditions": [{"type": "Ready", "status": "True"}]})


def base_peer(**changes) -> PeerObs:
    fields = dict(name=BASE, uid="u-base", model="m", adapters=True, max_rank=64, serving_ready=True,
                  ray_cluster=BASE_CLUSTER, adapters_root=BASE_ROOT)
    return PeerObs(**{**fields, **changes})


def publication(source: str = f"{NS}/old", uid: str = "u-old", loss: float | None = 1.0, eval_set: str = EVAL_SET,
                adapter: str = FT, at_: str = "2026-01-01T11:00:00Z") -> PublishedObs:
    return PublishedObs(source=source, uid=uid, base=BASE, adapter=adapter, eval_loss=loss, eval_set=eval_set,
                        published_at=at_)


def fine_tune(eval_loss: float | None = 0.8, **publish) -> dict:
    """A LoRA fine-tune whose training RayJob has just succeeded (status as the workload left it)."""
    o = small_object(FT, NS, {"uid": "u-ft", "generation": 1}, accelerator="cpu", topology="2",
                     training={"method": "lora"}, evaluation=EVAL, verification={"enabled": False},
                     publish={"to": BASE, **publish})
    o = apply(o, phases.decide(o, Observed(base=base_peer()), at(0), TUN))
    n = builders.names(parse(o))
    hosts = ClusterObs(n.cluster, {"conditions": [{"type": "RayClusterProvisioned", "status": "True"}],
                                   "readyWorkerReplicas": 2, "desiredWorkerReplicas": 2})
    o = apply(o, phases.decide(o, Observed(cluster=hosts), at(10), TUN))
    assert o["status"]["phase"] == "Training"
    o["status"]["training"] = {"evalLoss": eval_loss, "exportedModel": "gs://bucket/ck/ft/export"}
    return o


def succeed(o: dict, t: float = 100, **obs) -> observed.Decision:
    n = builders.names(parse(o))
    hosts = ClusterObs(n.cluster, {"conditions": [{"type": "RayClusterProvisioned", "status": "True"}]})
    return phases.decide(o, Observed(cluster=hosts, jobs={n.train_job: job(n.train_job, "SUCCEEDED", "Complete")},
                                     **obs), at(t), TUN)


# --- a base: training.method none ----------------------------------------------------------------------
def test_a_base_serves_its_model_from_the_first_reconcile_with_no_training_cluster():
    o = base_object()
    d = phases.decide(o, Observed(), at(0), TUN)
    assert kinds(d) == [("create", "ServiceAccount", f"{BASE}-workload"), ("create", "Role", f"{BASE}-workload"),
                        ("create", "RoleBinding", f"{BASE}-workload"),
                        ("create", "NetworkPolicy", f"{BASE}-ray-ingress"), ("create", "RayService", f"{BASE}-serve")]
    assert d.phase == "Serving" and d.status["reason"] == "Deploying"
    assert d.status["children"] == {"rayService": f"{BASE}-serve", "serviceAccount": f"{BASE}-workload"}
    assert d.status["serving"]["modelSource"] == "m" and d.status["serving"]["model"] == BASE
    assert d.status["adapters"] == {"count": 0}
    assert cond(d, c.Condition.TRAINING_SUCCEEDED)["reason"] == "NotTrained"
    assert cond(d, c.Condition.COLLECTIVES_VERIFIED)["reason"] == "VerificationSkipped"


def test_a_serving_base_records_its_cluster_and_lists_the_newest_adapter_per_name():
    o = apply(base_object(), phases.decide(base_object(), Observed(), at(0), TUN))
    published = (publication(f"{NS}/a1", "u-a1", 1.0, adapter="a", at_="2026-01-01T11:00:00Z"),
                 publication(f"{NS}/a2", "u-a2", 0.9, adapter="a", at_="2026-01-01T11:30:00Z"),
                 publication(f"{NS}/b", "u-b", None, adapter="b"))
    d = phases.decide(o, Observed(service=running_service(), published=published,
                                  live_uids=frozenset({"u-a1", "u-a2", "u-b"})), at(50), TUN)
    assert d.phase == "Serving" and d.status["reason"] == "Serving" and cond(d, c.Condition.READY)["status"] == "True"
    assert d.status["serving"]["rayCluster"] == BASE_CLUSTER
    assert d.status["serving"]["adaptersRoot"] == builders.adapters_root(parse(o))
    assert d.status["adapters"]["count"] == 2
    assert [(a["name"], a["source"], a["model"]) for a in d.status["adapters"]["served"]] == [
        ("a", f"{NS}/a2", f"{BASE}:a"), ("b", f"{NS}/b", f"{BASE}:b")]
    assert d.actions == ()


def test_a_base_unpublishes_the_adapter_of_a_deleted_fine_tune_then_drops_it():
    o = apply(base_object(), phases.decide(base_object(), Observed(), at(0), TUN))
    kept, deleted = publication(f"{NS}/a", "u-a", adapter="a"), publication(f"{NS}/b", "u-b", adapter="b")
    o = apply(o, phases.decide(o, Observed(service=running_service(), published=(kept, deleted),
                                           live_uids=frozenset({"u-a", "u-b"})), at(50), TUN))
    gone = Observed(service=running_service(), published=(kept,), live_uids=frozenset({"u-a"}))
    d = phases.decide(o, gone, at(60), TUN)
    name = builders.unpublish_job_name(BASE, "b", "u-b")
    assert kinds(d) == [("create", "RayJob", name)]
    body = d.actions[0].body
    assert body["spec"]["clusterSelector"] == {"ray.io/cluster": BASE_CLUSTER}
    assert shlex.split(body["spec"]["entrypoint"])[-4:] == ["--name", "b", "--uid", "u-b"]
    assert d.status["adapters"]["count"] == 1
    assert [(a["name"], a.get("unpublishing")) for a in d.status["adapters"]["served"]] == [("a", None), ("b", True)]
    assert d.status["children"]["unpublishJob"] == name
    o = apply(o, d)
    assert phases.decide(o, Observed(**{**gone.__dict__, "jobs": {name: job(name)}}), at(70), TUN).actions == ()
    done = phases.decide(o, Observed(**{**gone.__dict__, "jobs": {name: job(name, "SUCCEEDED", "Complete")}}),
                         at(80), TUN)
    assert kinds(done) == [("delete", "RayJob", name)]
    assert [a["name"] for a in done.status["adapters"]["served"]] == ["a"]
    assert "unpublishJob" not in done.status["children"]


# --- a fine-tune refused before training ------------------------------------------------------------
def test_a_fine_tune_naming_a_base_of_another_model_fails_before_anything_is_created():
    o = small_object(FT, NS, {"uid": "u-ft", "generation": 1}, training={"method": "lora"}, evaluation=EVAL,
                     publish={"to": BASE})
    d = phases.decide(o, Observed(base=base_peer(model="other/model")), at(0), TUN)
    assert d.phase == "Failed" and d.status["reason"] == "BaseMismatch" and d.actions == ()
    assert "'other/model'" in d.status["message"] and "'m'" in d.status["message"]   # both models named


def test_a_fine_tune_naming_an_object_without_adapters_or_with_a_smaller_rank_fails_before_training():
    o = small_object(FT, NS, {"uid": "u-ft", "generation": 1}, training={"method": "lora", "lora": {"rank": 128}},
                     evaluation=EVAL, publish={"to": BASE})
    d = phases.decide(o, Observed(base=base_peer(adapters=False)), at(0), TUN)
    assert d.status["reason"] == "BaseMismatch" and "serves no adapters" in d.status["message"]
    d = phases.decide(o, Observed(base=base_peer(max_rank=64)), at(0), TUN)
    assert d.status["reason"] == "BaseMismatch" and "rank 128" in d.status["message"] and d.actions == ()


def test_a_fine_tune_naming_a_vllm_base_fails_before_training_and_says_what_to_serve_with():
    o = small_object(FT, NS, {"uid": "u-ft", "generation": 1}, training={"method": "lora"}, evaluation=EVAL,
                     publish={"to": BASE})
    d = phases.decide(o, Observed(base=base_peer(engine="vllm")), at(0), TUN)
    assert d.phase == "Failed" and d.status["reason"] == "BaseMismatch" and d.actions == ()
    assert "serves with engine vllm" in d.status["message"] and "spec.serve.engine transformers" in d.status["message"]
    assert phases.decide(o, Observed(base=base_peer(engine="transformers")), at(0), TUN).phase == "Provisioning"


@pytest.mark.parametrize("spec, engine", [
    ({"accelerator": "cpu", "serve": {"enabled": True}}, "transformers"),
    ({"accelerator": "v6e", "serve": {"enabled": True}}, "vllm"),
    ({"accelerator": "v6e", "serve": {"enabled": True, "engine": "transformers"}}, "transformers"),
    ({"accelerator": "v6e", "serve": {"enabled": True, "accelerator": "cpu"}}, "transformers"),
])
def test_a_peers_engine_is_its_spec_serve_engine_or_the_default_of_where_it_serves(spec, engine):
    assert observed.PeerObs.of({"metadata": {"name": BASE}, "spec": spec}).engine == engine


def test_a_missing_base_does_not_hold_training():
    o = small_object(FT, NS, {"uid": "u-ft", "generation": 1}, training={"method": "lora"}, evaluation=EVAL,
                     publish={"to": BASE})
    assert phases.decide(o, Observed(base=None), at(0), TUN).phase == "Provisioning"


# --- publishing ----------------------------------------------------------------------------------------
def test_a_succeeded_fine_tune_publishes_on_the_bases_serving_cluster():
    o = fine_tune(eval_loss=0.8)
    d = succeed(o, base=base_peer())
    assert d.phase == "Succeeded" and d.status["reason"] == "Publishing"
    assert kinds(d) == [("create", "RayJob", f"{FT}-publish")]
    body = d.actions[0].body
    assert body["spec"]["clusterSelector"] == {"ray.io/cluster": BASE_CLUSTER}
    argv = shlex.split(body["spec"]["entrypoint"])
    assert argv[argv.index("--adapters-root") + 1] == BASE_ROOT
    assert argv[argv.index("--export") + 1] == "gs://bucket/ck/ft/export"
    assert argv[argv.index("--eval-set") + 1] == EVAL_SET and argv[argv.index("--eval-loss") + 1] == "0.8"
    assert d.status["serving"]["model"] == f"{BASE}:{FT}" and d.status["children"]["publishJob"] == f"{FT}-publish"


def test_the_publish_jobs_success_fills_status_serving_and_deletes_the_job():
    o = apply(fine_tune(), succeed(fine_tune(), base=base_peer()))
    name = f"{FT}-publish"
    d = phases.decide(o, Observed(base=base_peer(), jobs={name: job(name, "SUCCEEDED", "Complete")}), at(200), TUN)
    assert d.phase == "Succeeded" and d.status["reason"] == "Published"
    assert kinds(d) == [("delete", "RayJob", name)]
    assert d.status["serving"]["published"] == {"evalLoss": 0.8, "evalSet": EVAL_SET,
                                                "publishedAt": "2026-01-01T12:03:20Z"}
    assert cond(d, c.Condition.SERVING)["status"] == "True" and cond(d, c.Condition.READY)["status"] == "True"
    assert [(e.reason.value) for e in d.events] == ["Published"]
    o = apply(o, d)
    assert phases.decide(o, Observed(base=base_peer()), at(300), TUN).patch is None   # steady: no write
    assert observed.PeerObs.of(o).published == PublishedObs(f"{NS}/{FT}", "u-ft", BASE, FT, 0.8, EVAL_SET,
                                                            "2026-01-01T12:03:20Z")


def test_a_failed_publish_job_says_so_and_stays_unpublished():
    o = apply(fine_tune(), succeed(fine_tune(), base=base_peer()))
    name = f"{FT}-publish"
    d = phases.decide(o, Observed(base=base_peer(), jobs={name: job(name, "FAILED", "Failed")}), at(200), TUN)
    assert d.phase == "Succeeded" and d.status["reason"] == "PublishFailed" and kinds(d) == [("delete", "RayJob", name)]


def test_a_worse_eval_loss_is_not_promoted_with_both_figures():
    o = fine_tune(eval_loss=1.2)
    d = succeed(o, base=base_peer(), published=(publication(loss=1.0),))
    assert d.phase == "Succeeded" and d.status["reason"] == "NotPromoted" and d.actions == ()
    message = d.status["serving"]["message"]
    assert "1.2000" in message and "1.0000" in message and f"{NS}/old" in message
    assert cond(d, c.Condition.SERVING)["reason"] == "NotPromoted" and "published" not in d.status["serving"]


def test_the_margin_decides_between_two_close_losses():
    o = fine_tune(eval_loss=0.95, margin=0.1)
    assert succeed(o, base=base_peer(), published=(publication(loss=1.0),)).status["reason"] == "NotPromoted"
    o = fine_tune(eval_loss=0.85, margin=0.1)
    assert succeed(o, base=base_peer(), published=(publication(loss=1.0),)).status["reason"] == "Publishing"


def test_eval_losses_on_different_eval_sets_are_not_compared():
    o = fine_tune(eval_loss=0.1)
    d = succeed(o, base=base_peer(), published=(publication(loss=1.0, eval_set="split:d[test]"),))
    assert d.status["reason"] == "NotPromoted" and d.actions == ()
    assert EVAL_SET in d.status["serving"]["message"] and "split:d[test]" in d.status["serving"]["message"]


def test_when_always_replaces_whatever_is_served():
    o = fine_tune(eval_loss=5.0, when="always")
    assert succeed(o, base=base_peer(), published=(publication(loss=1.0),)).status["reason"] == "Publishing"


def test_a_base_not_serving_leaves_it_succeeded_and_it_publishes_once_the_base_serves():
    o = fine_tune()
    d = succeed(o, base=base_peer(serving_ready=False))
    assert d.phase == "Succeeded" and d.status["reason"] == "BaseNotServing" and d.actions == ()
    assert d.requeue_after == phases.BASE_POLL_SECONDS
    o = apply(o, d)
    assert phases.decide(o, Observed(base=None), at(150), TUN).status["reason"] == "BaseNotServing"
    d = phases.decide(o, Observed(base=base_peer()), at(200), TUN)
    assert d.status["reason"] == "Publishing" and kinds(d) == [("create", "RayJob", f"{FT}-publish")]


def test_a_newer_publication_of_the_same_name_supersedes_the_published_one():
    o = apply(fine_tune(), succeed(fine_tune(), base=base_peer()))
    name = f"{FT}-publish"
    o = apply(o, phases.decide(o, Observed(base=base_peer(), jobs={name: job(name, "SUCCEEDED", "Complete")}),
                               at(200), TUN))
    newer = publication(f"{NS}/ft-v2", "u-v2", 0.5, at_="2026-01-01T13:00:00Z")
    d = phases.decide(o, Observed(base=base_peer(), published=(newer,)), at(300), TUN)
    assert d.status["reason"] == "Superseded" and f"{NS}/ft-v2" in d.status["serving"]["message"]
    assert "published" not in d.status["serving"] and d.actions == ()


def test_a_published_adapter_whose_base_goes_is_published_again_once_a_base_serves():
    o = apply(fine_tune(), succeed(fine_tune(), base=base_peer()))
    name = f"{FT}-publish"
    o = apply(o, phases.decide(o, Observed(base=base_peer(), jobs={name: job(name, "SUCCEEDED", "Complete")}),
                               at(200), TUN))
    assert o["status"]["serving"]["adaptersRoot"] == BASE_ROOT
    gone = phases.decide(o, Observed(base=None), at(300), TUN)
    assert gone.status["reason"] == "BaseNotServing" and "published" not in gone.status["serving"]
    assert observed.PeerObs.of(apply(o, gone)).published is None   # the base no longer lists it
    recreated = base_peer(uid="u-base-2", adapters_root=f"gs://bucket/ck/{NS}-{BASE}-u-base-2/adapters")
    d = phases.decide(apply(o, gone), Observed(base=recreated), at(400), TUN)
    assert d.status["reason"] == "Publishing" and kinds(d) == [("create", "RayJob", name)]
    argv = shlex.split(d.actions[0].body["spec"]["entrypoint"])
    assert argv[argv.index("--adapters-root") + 1] == recreated.adapters_root
    # a base recreated while nobody looked: its adapters root moved, so the adapter is published there
    assert phases.decide(o, Observed(base=recreated), at(300), TUN).status["reason"] == "Publishing"
