"""tpuft.controller.ledger: what the reconciler keeps per TPUFinetune between reconciles (the last error
posted, and what bridges kopf's index lagging the API server)."""
from __future__ import annotations

from tpuft.controller.ledger import Ledger

K = ("team-a", "ft")
OTHER = ("team-a", "other")


def test_unknown_keys_hold_nothing():
    led = Ledger()
    assert led.written(K) is None and not led.is_unsure(K)
    assert led.removed(K) == frozenset() and not led.is_gone(K, "u-1") and K not in led


def test_an_error_is_new_once_until_cleared():
    led = Ledger()
    assert led.new_error(K, "HTTP 500") is True
    assert led.new_error(K, "HTTP 500") is False
    assert led.new_error(K, "HTTP 503") is True
    led.clear_error(K)
    assert led.new_error(K, "HTTP 503") is True


def test_overlay_until_the_index_catches_up():
    led = Ledger()
    body = {"metadata": {"name": "ft"}, "spec": {"x": 1},
            "status": {"phase": "Pending", "training": {"loss": 2.0}}}
    assert led.overlay(K, body) is body                      # nothing written: the index is the truth
    led.wrote(K, {"phase": "Provisioning", "reason": "WaitingForSlice", "training": {"loss": 9.0}})
    assert led.written(K) == {"phase": "Provisioning", "reason": "WaitingForSlice"}   # only operator keys
    seen = led.overlay(K, body)
    assert seen["status"] == {"phase": "Provisioning", "reason": "WaitingForSlice", "training": {"loss": 2.0}}
    assert seen["spec"] == {"x": 1} and body["status"]["phase"] == "Pending"          # the input is not changed
    caught_up = {**body, "status": {"phase": "Provisioning", "reason": "WaitingForSlice", "training": {"loss": 3.0}}}
    assert led.overlay(K, caught_up) is caught_up and led.written(K) is None


def test_unsure_write_is_settled_by_a_reread():
    led = Ledger()
    led.write_unsure(K)
    assert led.is_unsure(K) and not led.is_unsure(OTHER)
    led.wrote(K, {"phase": "Training"})
    assert not led.is_unsure(K) and led.written(K) == {"phase": "Training"}


def test_deleted_children_until_recreated():
    led = Ledger()
    led.deleted_child(K, "RayJob", "ft-verify")
    led.deleted_child(K, "RayCluster", "ft-ray")
    assert led.removed(K) == {("RayJob", "ft-verify"), ("RayCluster", "ft-ray")} and led.removed(OTHER) == set()
    led.created_child(K, "RayCluster", "ft-ray")
    led.created_child(OTHER, "RayCluster", "ft-ray")          # nothing recorded for it: no entry made
    assert led.removed(K) == {("RayJob", "ft-verify")} and OTHER not in led


def test_gone_is_per_uid():
    led = Ledger()
    led.mark_gone(K, "u-1")
    assert led.is_gone(K, "u-1") and not led.is_gone(K, "u-2")   # a new object of the same name is not gone


def test_forget_drops_everything():
    led = Ledger()
    led.new_error(K, "e")
    led.wrote(K, {"phase": "Training"})
    led.write_unsure(K)
    led.deleted_child(K, "RayJob", "j")
    led.mark_gone(K, "u-1")
    led.forget(K)
    assert K not in led and led.written(K) is None and not led.is_unsure(K)
    assert led.removed(K) == set() and not led.is_gone(K, "u-1") and led.new_error(K, "e")
