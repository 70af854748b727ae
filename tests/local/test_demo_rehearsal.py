"""`tpuft demo --rehearse-tpu`'s verdict, pure (demo.judge_rehearsal): a rehearsal that did what it
is designed to do on simulated hosts ends in phase Failed (the verification deadline) and exits 0
saying so; one that was never admitted, never provisioned, placed elsewhere, failed for another
reason or left its flex-start nodes exits 1 saying which. (The rehearsal on the real local
cluster: tests/cluster/test_local_cluster.py.)"""
from __future__ import annotations

from tpuft_local import demo

WORKERS = 4


def _condition(ctype: str, status: str = "True", reason: str = "", message: str = "") -> dict:
    return {"type": ctype, "status": status, "reason": reason or ctype, "message": message}


def _status(reason: str = "CollectiveTimeout", phase: str = "Failed", admitted: str | None = None,
            provisioned: str = "True") -> dict:
    conditions = [_condition("SliceProvisioned", provisioned, "SliceReady"),
                  _condition("CollectivesVerified", "False", reason)]
    if admitted is not None:
        conditions.insert(0, _condition("Admitted", admitted, "Admitted" if admitted == "True" else "WaitingForCapacity",
                                        "ProvisioningRequest flex-start: Waiting for capacity"))
    return {"phase": phase, "reason": reason, "message": "collective verification did not finish within 90s",
            "conditions": conditions}


def _placed(workers: int = WORKERS, simulated: bool = True, flex_start: bool = False) -> dict[str, dict]:
    pool = "gke-v6e-4x4-flex-ab12c-0" if flex_start else "gke-v6e-4x4-0"
    placed = {"r-ray-head-x": {"node": "gke-cpu-0", "simulated": True, "flexStart": False, "role": "head"}}
    for h in range(workers):
        placed[f"r-ray-tpu-worker-{h}"] = {"node": f"{pool}-{h}", "simulated": simulated, "flexStart": flex_start,
                                           "role": "worker"}
    return placed


def test_a_rehearsal_ending_at_the_verification_deadline_on_simulated_hosts_is_complete():
    verdict = demo.judge_rehearsal(_status(), _placed(), WORKERS, flex_start=False, nodes_released=None)
    assert verdict.as_designed and verdict.exit_code == 0
    assert verdict.line.startswith("rehearsal complete: ")
    assert "(verification cannot run on simulated hosts: the CollectiveTimeout is expected)" in verdict.line
    assert "gke-v6e-4x4-0-0, gke-v6e-4x4-0-1, gke-v6e-4x4-0-2, gke-v6e-4x4-0-3" in verdict.line
    assert "gke-cpu-0" not in verdict.line   # the head is not one of the slice's hosts


def test_kuberay_giving_the_rayjob_up_before_the_deadline_is_as_expected_on_simulated_hosts():
    verdict = demo.judge_rehearsal(_status("VerificationFailed"), _placed(), WORKERS, False, None)
    assert verdict.exit_code == 0 and "the VerificationFailed is expected" in verdict.line


def test_a_flex_start_rehearsal_is_complete_once_admitted_on_flex_start_hosts_and_its_nodes_gone():
    verdict = demo.judge_rehearsal(_status(admitted="True"), _placed(flex_start=True), WORKERS, True, True)
    assert verdict.exit_code == 0
    assert "Kueue admitted the slice through the flex-start check" in verdict.line
    assert "SIMULATED flex-start hosts (gke-v6e-4x4-flex-ab12c-0-0" in verdict.line
    assert "the flex-start nodes went with the run" in verdict.line


def test_a_flex_start_rehearsal_never_admitted_fails_with_kueues_words():
    status = _status(reason="QueueTimeout", admitted="False", provisioned="Unknown")
    verdict = demo.judge_rehearsal(status, {}, WORKERS, True, True)
    assert verdict.exit_code == 1 and verdict.line.startswith("never admitted: ")
    assert "Admitted=False: WaitingForCapacity: ProvisioningRequest flex-start: Waiting for capacity" in verdict.line
    assert "it ended in phase Failed: QueueTimeout" in verdict.line


def test_a_slice_never_provisioned_fails_even_with_an_expected_looking_reason():
    verdict = demo.judge_rehearsal(_status(reason="ProvisioningTimeout", provisioned="False"), {}, WORKERS, False, None)
    assert verdict.exit_code == 1 and verdict.line.startswith("never provisioned: ")
    assert "SliceProvisioned=False: SliceReady" in verdict.line and "ProvisioningTimeout" in verdict.line


def test_workers_missing_from_the_simulated_hosts_fail():
    for placed in (_placed(workers=3), _placed(simulated=False)):
        verdict = demo.judge_rehearsal(_status(), placed, WORKERS, False, None)
        assert verdict.exit_code == 1 and f"of the slice's {WORKERS} Ray workers were placed on simulated" in verdict.line
    # with flex-start, the static pool's hosts are not the flex-start ones the rehearsal is about
    verdict = demo.judge_rehearsal(_status(admitted="True"), _placed(), WORKERS, True, True)
    assert verdict.exit_code == 1 and "0 of the slice's 4 Ray workers were placed on simulated flex-start hosts" \
        in verdict.line


def test_a_failure_for_another_reason_fails_and_names_it():
    for status in (_status("StorageNotWritable"), _status("OutOfMemory"), _status("Verifying", phase="VerifyingCollectives")):
        verdict = demo.judge_rehearsal(status, _placed(), WORKERS, False, None)
        assert verdict.exit_code == 1, status
        assert f"it ended in phase {status['phase']}: {status['reason']}" in verdict.line
        assert "not at the end verification can only reach on simulated hosts" in verdict.line


def test_flex_start_nodes_left_behind_fail():
    verdict = demo.judge_rehearsal(_status(admitted="True"), _placed(flex_start=True), WORKERS, True, False)
    assert verdict.exit_code == 1 and "flex-start nodes were still there" in verdict.line


class _Placement:
    def __init__(self, placed: dict[str, dict]):
        self.placed = placed


def test_the_rehearsals_exit_code_and_words_come_from_its_object(capsys):
    """The v6e 4x4 example the rehearsal applies: its slice's 4 hosts are the workers counted."""
    import argparse

    p = argparse.ArgumentParser()
    demo.add_demo_arguments(p)
    obj = demo._manifest(p.parse_args(["--rehearse-tpu"]))
    obj["metadata"]["namespace"] = "bars"
    obj["status"] = _status()
    assert demo._rehearsal_summary(obj, _Placement(_placed()), False, None, demo.Clock()) == 0
    assert "rehearsal complete: its 4 Ray workers ran on SIMULATED hosts" in capsys.readouterr().out
    assert demo._rehearsal_summary(obj, _Placement(_placed(workers=3)), False, None, demo.Clock()) == 1
    err = capsys.readouterr().err
    assert "the rehearsal did not go as designed: 3 of the slice's 4 Ray workers" in err
    assert f"kubectl describe tft {obj['metadata']['name']} -n bars" in err
