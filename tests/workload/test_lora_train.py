"""spec.training.method: lora on 2 real CPU workers (gloo, FSDP2) through the RayJob's CLI path
(`train.run_training`), the tiny model with rank-8 adapters, status patches going to the session's
loopback recorder: rank 1 killed hard before step KILL_STEP, Ray Train's FailureConfig restarts the
group, which resumes from its newest adapter checkpoint and finishes; the export is a PEFT adapter
folder. Everything one process can show (the driver's refusals, exact restores, the merged export,
serving) is tests/workload/test_lora.py's, at no Ray's cost.
"""
from __future__ import annotations

import json

import pytest

from tests.factories import TINY_LORA_FLAGS, assert_export_generates
from tpuft_workload import checkpoint

FRAMEWORK, NAME = "torch", "lora"   # killed_run's
KILL_STEP = 5   # rank 1 exits before step 5 runs: 4 done, step 3 committed
FLAGS = TINY_LORA_FLAGS


def test_a_killed_lora_run_resumes_from_its_adapter_checkpoint_and_exports_an_adapter_folder(killed_run):
    import torch.distributed.checkpoint as dcp

    run = killed_run
    assert run.rc == 0, run.body
    run.assert_resumed_after_kill(KILL_STEP)
    history = run.patches[-1]["history"]
    assert history[-1]["loss"] < history[0]["loss"], history   # the adapters learned
    trainable, total = run.body["trainableParameters"], run.body["totalParameters"]
    assert 0 < trainable < total / 5   # rank 8 on the tiny model: a seventh of it
    final = run.patches[-1]
    assert (final["trainableParameters"], final["totalParameters"]) == (trainable, total)
    manifest = json.loads((run.run_dir / checkpoint.RUN_MANIFEST).read_text())
    assert manifest["training"] == {"method": "lora", "lora": {"rank": 8, "alpha": 16, "dropout": 0.05, "targetModules": [
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}}
    last = run.run_dir / run.body["lastCheckpoint"].rsplit("/", 1)[-1]
    keys = [k for k in dcp.FileSystemReader(str(last)).read_metadata().state_dict_metadata if k.startswith("model.")]
    assert keys and all("lora_" in k for k in keys), keys[:5]   # the frozen base is not in it
    assert run.body["exportedModel"] == str(run.run_dir / "export")
    assert_export_generates(run.body["exportedModel"])


@pytest.mark.parametrize("flags,field", [({}, "spec.training.method"),
                                         ({**TINY_LORA_FLAGS, "lora_rank": 4}, "spec.training.lora")],
                         ids=["full-run", "another-rank"])
def test_resuming_the_lora_run_with_other_weights_is_refused_on_the_driver(killed_run, tiny_train, flags, field):
    """Refused before any worker starts (the resume point is checked before the data is read)."""
    run = tiny_train(FRAMEWORK, killed_run.storage, f"ns-{NAME}-uid-b", NAME, resume_from=killed_run.run_dir,
                     **flags)
    assert run.rc == 1 and run.body["error"].startswith(f"{field}: {killed_run.run_dir}/checkpoint_step_"), run.body
