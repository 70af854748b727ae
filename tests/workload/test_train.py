"""Fine-tuning on 2 real CPU workers (gloo, FSDP2) with the built-in tiny model and data, through the
RayJob's CLI path (`train.run_training`), status patches going to the session's loopback recorder.

One object's run meets, in order, the disruptions a run meets on a slice:
1. rank 1 killed hard before step KILL_STEP: Ray Train's FailureConfig restarts the group, which
   resumes from the newest periodic checkpoint, at most one interval lost;
2. a SIGTERM to rank 1 before step SIGTERM_STEP (what a pod's preStop hook sends on a Kueue eviction
   or a drain): every rank saves at the next step and the run ends as stopped;
3. its training RayJob's retry (the same object, same UID) resumes step-exact from that checkpoint
   and finishes: loss went down, status.training written by rank 0 (with its history; no MFU on CPU),
   rank 0's TensorBoard files hold one curve across the three attempts (and `tpuft plot` reads them
   as tensorboardX does), and the export loads with AutoModelForCausalLM.from_pretrained and generates.
Then whose checkpoints a run resumes: its own object's only, unless spec.checkpoint.resumeFrom says
otherwise (continued on purpose, or refused naming the field). A re-created object (same name and
storagePath, another UID) trains from step 0 and leaves the first one's files untouched: its run
name is another (tests/unit/test_builders.py::test_run_directory_belongs_to_one_object), and a run
resumes only its own directory or resumeFrom (below). The real API
server keeping every status key the workload writes: tests/integration/test_status_roundtrip.py.
(`killed_run`, tests/workload/conftest.py, is that run up to its stop; the JAX path's tests start
from the same fixture.)
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from tests.factories import (TINY_CKPT_EVERY, TINY_EPOCHS, TINY_STEPS_PER_EPOCH, assert_export_generates,
                             tensorboard_scalars, tiny_train_argv)
from tpuft.cli import plot_cli
from tpuft.api.constants import HISTORY_MAX_POINTS
from tpuft_workload import __main__ as cli
from tpuft_workload import checkpoint, train

FRAMEWORK, NS, NAME = "torch", "ns", "demo"   # killed_run's
EPOCHS, STEPS_PER_EPOCH, CKPT_EVERY = TINY_EPOCHS, TINY_STEPS_PER_EPOCH, TINY_CKPT_EVERY
TOTAL = EPOCHS * STEPS_PER_EPOCH
KILL_STEP = 5        # rank 1 exits before step 5 runs: 4 done, step 3 committed
SIGTERM_STEP = 11    # rank 1's SIGTERM comes after step 10; committed by then: 3, 6, 7 (epoch end), 9
MORE_FAULTS = f"sigterm-rank:1:step:{SIGTERM_STEP}"


def _files(run_dir: Path) -> dict[str, str]:
    return {str(p.relative_to(run_dir)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(run_dir.rglob("*")) if p.is_file()}


def _committed(run_dir: Path) -> list[int]:
    return sorted(int(p.parent.name.rsplit("_", 1)[1])
                  for p in run_dir.glob(f"checkpoint_step_*/{checkpoint.COMMITTED}"))


def _run(tiny_train, storage: Path, uid: str, **flags):
    """The RayJob's CLI path for object NAME's run `uid`."""
    return tiny_train(FRAMEWORK, storage, f"{NS}-{NAME}-{uid}", NAME, **flags)


@pytest.fixture(scope="module")
def first_object(killed_run, tiny_train):
    """Object uid-a: killed, restarted in the job, stopped by a SIGTERM (killed_run); then its RayJob's retry."""
    run_dir = killed_run.run_dir
    committed_after_stop, summary_after_stop = _committed(run_dir), (run_dir / train.SUMMARY).exists()
    retry = _run(tiny_train, killed_run.storage, "uid-a")
    return {"storage": killed_run.storage, "run_dir": run_dir, "stopped": killed_run, "retry": retry,
            "committed_after_stop": committed_after_stop, "summary_after_stop": summary_after_stop,
            "files": _files(run_dir)}


def test_a_killed_worker_is_restarted_from_the_last_checkpoint(killed_run):
    killed_run.assert_resumed_after_kill(KILL_STEP)


def test_a_sigterm_to_one_rank_saves_the_next_step_on_every_rank(first_object):
    from tpuft.api.constants import EXIT_STOPPED

    signalled_after = SIGTERM_STEP - 1   # the last step rank 1 had finished when it got the SIGTERM
    rc, body = first_object["stopped"].rc, first_object["stopped"].body
    assert rc == EXIT_STOPPED and body["succeeded"] is False and body["stopped"] == "SIGTERM", body
    saved = body["step"]
    assert saved - signalled_after in (1, 2), body   # at the next step boundary (at most one more)
    assert body["lastCheckpoint"] == str(first_object["run_dir"] / f"checkpoint_step_{saved:07d}")
    assert body["message"] == f"stop requested (SIGTERM): checkpoint at step {saved} saved; " \
                              "resume repeats at most one step"
    assert first_object["committed_after_stop"] == sorted({3, 6, 7, 9, saved})   # both ranks' shards, committed
    assert not first_object["summary_after_stop"]   # not finished: no summary, no export
    last = first_object["stopped"].patches[-1]
    assert (last["step"], last["message"], last["lastCheckpoint"]) == (saved, body["message"], body["lastCheckpoint"])
    assert "exportedModel" not in last
    manifest = json.loads((first_object["run_dir"] / checkpoint.RUN_MANIFEST).read_text())
    assert manifest["format"] == checkpoint.RUN_FORMAT and manifest["model"] == "builtin:tiny-llama"
    assert (manifest["namespace"], manifest["name"]) == (NS, NAME)


def test_a_retry_of_the_same_object_resumes_step_exact_from_its_own_newest_checkpoint(first_object):
    saved = first_object["stopped"].body["step"]
    rc, body = first_object["retry"].rc, first_object["retry"].body
    assert rc == 0 and body["succeeded"], body
    assert body["resumedFromStep"] == saved and body["step"] == body["totalSteps"] == TOTAL   # nothing repeated
    assert body["resumedFrom"] == first_object["stopped"].body["lastCheckpoint"]
    assert body["loss"] > 0 and body["tokensPerSecond"] > 0
    first = first_object["retry"].patches[0]
    assert (first["resumedFromStep"], first["step"]) == (saved, saved)
    assert first["message"].startswith(f"resumed at step {saved}")
    summary = json.loads((first_object["run_dir"] / train.SUMMARY).read_text())
    assert summary["step"] == summary["totalSteps"] == TOTAL and summary["resumedFromStep"] == saved


def test_status_training_is_written_by_rank_0_for_its_object_only(first_object):
    assert first_object["stopped"].objects | first_object["retry"].objects == {(NS, NAME)}   # TPUFT_NAMESPACE / TPUFT_NAME, nothing else patched
    t = first_object["retry"].patches[-1]
    assert t["epoch"] == t["epochs"] == EPOCHS and t["step"] == t["totalSteps"] == TOTAL
    assert t["exportedModel"] == str(first_object["run_dir"] / checkpoint.EXPORT_DIR)
    assert t["lastCheckpoint"].startswith(str(first_object["run_dir"]))
    assert t["loss"] > 0 and t["tokensPerSecond"] > 0 and 0 <= t["padFraction"] < 0.1
    steps = [p["step"] for p in t["history"]]
    assert 3 <= len(steps) <= HISTORY_MAX_POINTS and steps == sorted(set(steps)) and steps[-1] == t["step"]
    assert t["history"][-1] == {"step": t["step"], "loss": t["loss"], "tokensPerSecond": t["tokensPerSecond"]}
    assert "mfu" not in t   # CPU: no peak FLOP/s in the catalog


def test_tensorboard_holds_one_falling_curve_across_the_three_attempts(first_object):
    logdir = first_object["run_dir"] / "tensorboard"
    files, scalars = tensorboard_scalars(logdir)
    assert files == 3   # rank 0 of the killed attempt, of the restarted one, of the retry
    assert {"train/loss", "train/grad_norm", "train/tokens_per_second", "train/step_time_seconds",
            "train/learning_rate"} <= set(scalars) and "train/mfu" not in scalars
    steps = [s for s, _ in scalars["train/loss"]]
    stopped_at = first_object["stopped"].body["step"]
    assert steps == sorted(set(steps)) and steps[-1] == TOTAL   # no step twice
    assert min(steps) <= stopped_at < max(steps)   # the stopped attempt's points and the retry's, one curve
    losses = [v for _, v in scalars["train/loss"]]
    assert losses[-1] < losses[0] - 0.5, scalars["train/loss"]   # the loss went down
    assert all(v > 0 for _, v in scalars["train/grad_norm"])
    assert scalars["train/learning_rate"][0][1] == pytest.approx(3e-3)   # float32 in the event file
    # `tpuft plot` reads them without tensorboard or protobuf, as tensorboardX's own protos do
    assert plot_cli.read_events(logdir) == (files, scalars)


def test_export_loads_and_generates(first_object):
    assert_export_generates(first_object["run_dir"] / checkpoint.EXPORT_DIR)


def test_resume_from_an_earlier_run_continues_it_into_this_objects_directory(first_object, tiny_train):
    storage, first = first_object["storage"], first_object["run_dir"]
    run = _run(tiny_train, storage, "uid-c", epochs=EPOCHS + 1, resume_from=first)
    rc, body = run.rc, run.body
    assert rc == 0 and body["succeeded"], body
    assert body["resumedFromStep"] == TOTAL and body["step"] == TOTAL + STEPS_PER_EPOCH
    assert body["resumedFrom"] == str(first / f"checkpoint_step_{TOTAL:07d}")
    patches = run.patches
    assert patches[0]["resumedFrom"] == body["resumedFrom"] and patches[0]["resumedFromStep"] == TOTAL
    assert _committed(storage / f"{NS}-{NAME}-uid-c") == [15, 18, 21]
    manifest = json.loads((storage / f"{NS}-{NAME}-uid-c" / checkpoint.RUN_MANIFEST).read_text())
    assert manifest["resumeFrom"] == body["resumedFrom"]
    assert _files(first) == first_object["files"]


def test_resumed_at_the_last_step_keeps_the_completed_runs_metrics(first_object, tiny_train):
    """A finished run resubmitted retrains nothing (here through resumeFrom at its last checkpoint)."""
    storage, first = first_object["storage"], first_object["run_dir"]
    done = first_object["retry"].body
    run = _run(tiny_train, storage, "uid-d", resume_from=first / f"checkpoint_step_{TOTAL:07d}")
    rc, body = run.rc, run.body
    assert rc == 0 and body["succeeded"], body
    assert body["step"] == body["resumedFromStep"] == TOTAL
    assert "nothing left to do" in body["message"]
    assert (body["loss"], body["tokensPerSecond"]) == (done["loss"], done["tokensPerSecond"])
    patches = run.patches
    assert "nothing left to do" in patches[0]["message"] and patches[0]["loss"] == done["loss"]
    final = patches[-1]
    assert final["exportedModel"] == str(storage / f"{NS}-{NAME}-uid-d" / "export")  # this object's own export
    assert (final["loss"], final["tokensPerSecond"]) == (done["loss"], done["tokensPerSecond"])
    assert _files(first) == first_object["files"]


@pytest.mark.parametrize("case", ["missing", "foreign"])
def test_resume_from_refused_before_any_worker_starts(first_object, tiny_train, tmp_path, case):
    if case == "missing":
        target, words = tmp_path / "no-such-run", "does not exist"
    else:  # a directory of checkpoints no TPUFinetune wrote
        target, words = tmp_path / "elsewhere" / "checkpoint_step_0000014", "was not written by a TPUFinetune"
        target.mkdir(parents=True)
        (target / "model.pt").write_text("x")
    run = _run(tiny_train, first_object["storage"], f"uid-{case}", resume_from=target)
    rc, body = run.rc, run.body
    assert rc == 1 and body["succeeded"] is False
    assert body["error"].startswith(f"spec.checkpoint.resumeFrom: {target}") and words in body["error"]
    assert [p["message"] for p in run.patches] == [body["error"]]  # recorded in status
    assert not (first_object["storage"] / f"{NS}-{NAME}-uid-{case}" / checkpoint.RUN_MANIFEST).exists()


def test_resume_from_a_different_architecture_is_refused_before_any_worker_starts(first_object, tiny_train, tmp_path):
    from tpuft_workload import model as modellib
    from tpuft_workload.tiny import build_model

    tok = modellib.load_tokenizer("builtin:tiny-llama")
    other = tmp_path / "wider-llama"
    build_model(len(tok), hidden=32).save_pretrained(other)
    tok.save_pretrained(other)
    run = _run(tiny_train, first_object["storage"], "uid-e", model=other, resume_from=first_object["run_dir"])
    rc, body = run.rc, run.body
    assert rc == 1 and body["succeeded"] is False
    assert "spec.checkpoint.resumeFrom" in body["error"] and "different model architecture" in body["error"], body
    messages = [p["message"] for p in run.patches if "message" in p]
    assert messages == [body["error"]] and str(first_object["run_dir"]) in messages[0] and str(other) in messages[0]
    assert not (first_object["storage"] / f"{NS}-{NAME}-uid-e").exists()   # on the driver: no worker wrote a thing


def test_rank_0s_gauges_reach_rays_metrics_endpoint(ray_cluster):
    """What the chart's PodMonitor scrapes: ray.util.metrics gauges set in a Ray worker, as Ray's
    metrics agent exports them (ray_<name>{tpufinetune=...}) on the node's metrics port."""
    import time
    import urllib.request

    import ray

    from tpuft.api.constants import TrainMetric
    from tpuft_workload.metrics_log import Prometheus

    @ray.remote(num_cpus=0)
    def set_gauges():
        Prometheus(True, "gauge-probe").add(7, {"loss": 1.5, "tokens_per_s": 1234.0, "step_time_s": 0.25, "mfu": None})

    ray.get(set_gauges.remote())   # the worker stays (Ray keeps idle workers) and pushes them
    port = ray._private.worker.global_worker.node.metrics_export_port
    want = {m.exported: v for m, v in ((TrainMetric.LOSS, 1.5), (TrainMetric.TOKENS_PER_SECOND, 1234.0),
                                       (TrainMetric.STEP_TIME_SECONDS, 0.25), (TrainMetric.STEP, 7.0))}
    deadline, got = time.monotonic() + 45, {}
    while time.monotonic() < deadline and got.keys() != want.keys():
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        got = {ln.split("{", 1)[0]: float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
               if ln.startswith("ray_tpuft_train_") and 'tpufinetune="gauge-probe"' in ln}
        time.sleep(1)
    assert got == want   # and no MFU series: None is not exported


def test_too_little_data_fails_with_a_clear_reason(ray_cluster, tmp_path, capsys):
    command, target = cli.parse_args(tiny_train_argv(FRAMEWORK, tmp_path, "too-small", dataset_split="train[:3]"))
    assert train.run_training(command, target) == 1
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith(train.RESULT_PREFIX))
    body = json.loads(line[len(train.RESULT_PREFIX):])
    assert body["succeeded"] is False
    assert "cannot fill one global batch" in body["error"] and "spec.training.batchSizePerDevice" in body["error"]
    assert body["error"].startswith("spec.dataset.name: ")   # on the driver, before any worker


def test_a_saved_model_trains_from_shards_each_rank_read_for_itself(ray_cluster, tiny_train, tmp_path):
    """spec.model a saved folder (safetensors): the workers build it on the meta device and read
    their shards (tpuft_workload.sharded_load; the weights' equality with a full load is
    test_sharded_load's), then train and export as from the builtin."""
    from tpuft_workload import model as modellib
    from tpuft_workload.tiny import build_model

    tok = modellib.load_tokenizer("builtin:tiny-llama")
    saved = tmp_path / "saved-llama"
    build_model(len(tok), seed=42).save_pretrained(saved, max_shard_size="200KB")
    tok.save_pretrained(saved)
    run = _run(tiny_train, tmp_path / "storage", "uid-s", model=saved, epochs=1)
    assert run.rc == 0 and run.body["succeeded"], run.body
    losses = [p["loss"] for p in run.patches if p.get("loss") is not None]
    assert losses and losses[-1] < 5.0   # trained from the saved weights, not from garbage storage
    assert_export_generates(run.run_dir / checkpoint.EXPORT_DIR)


def test_a_record_the_template_refuses_reaches_status_training_and_the_result_line(monkeypatch, capsys):
    """The tokenize stage's DataError (tests/workload/test_pipeline.py: the record's number and the
    template's words) goes where every data error goes: status.training.message and the result line
    the operator reads, with no Ray traceback."""
    from tpuft_workload import pipeline

    sent: list[dict] = []

    class Recorder:
        def training(self, **fields):
            sent.append(fields)

    error = pipeline.DataError("/data/chats.jsonl: record 3: the model's chat template refuses this conversation "
                               "(system, user, assistant): System role not supported; change the record ...")

    def build(command, target, fault_spec):
        raise error
    monkeypatch.setattr(train, "StatusReporter", Recorder)
    assert train.run_training(None, None, build=build) == 1
    assert sent == [{"message": str(error)}]
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith(train.RESULT_PREFIX))
    assert json.loads(line[len(train.RESULT_PREFIX):]) == {"succeeded": False, "error": str(error)}
    assert str(error).startswith("spec.dataset.name: /data/chats.jsonl: record 3: ")


def test_the_driver_reports_rays_memory_kill_with_the_figures_the_operator_reads():
    """Ray Train's error for a worker Ray's memory monitor killed ends with its last line only; the
    result line (and status.training.message) keep the kill's report, which the operator parses."""
    from tests.kuberay_standin import memory_monitor_kill
    from tpuft.controller.observed import RayMemoryKill

    error = RuntimeError("Training failed due to worker errors:\n[Rank 1]\n" + memory_monitor_kill("10.4.1.7"))
    line = train.failure_message(error)
    assert line.startswith("RuntimeError: Worker exit type: NODE_OUT_OF_MEMORY") and "\n" not in line
    assert RayMemoryKill.of(line) == RayMemoryKill("10.4.1.7", "190.12GB", "200.00GB", "95.0%")
    assert train.failure_message(RuntimeError("boom\nValueError: bad row 3")) == "RuntimeError: ValueError: bad row 3"
