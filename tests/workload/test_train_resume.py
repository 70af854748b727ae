"""Whose checkpoints a run resumes: its own object's only, unless spec.checkpoint.resumeFrom says otherwise.

Real CPU training on 2 workers (gloo, FSDP2, built-in tiny model and data). The run names are
the operator's, `<namespace>-<name>-<uid>`: one object told to stop mid-run (a SIGTERM to one rank's
worker process, as the pod's preStop hook sends it on a Kueue eviction or a drain) saves a checkpoint
at the next step on every rank and ends as stopped, and its resubmission (a training RayJob retry:
same UID) resumes step-exact from that, its own newest checkpoint (a hard kill's in-job restart from
the periodic checkpoint is tests/workload/test_train.py's); resumeFrom continues an earlier run
on purpose, or is refused with a message naming the field. A re-created object (same name and
storagePath, another UID) training from step 0 and leaving the first one's files untouched is
the demo's second run, through the operator's own run names (tests/cluster/test_demo.py).
Status patches go to a loopback recorder (no API server): this module has its own Ray so its
workers inherit the recorder's kubeconfig.
"""
from __future__ import annotations

import contextlib
import hashlib
import io
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml
from tpuft_workload import __main__ as cli
from tpuft_workload import checkpoint, train

NS, NAME = "ns", "demo"
EPOCHS, STEPS_PER_EPOCH, CKPT_EVERY = 2, 7, 3   # train[:80] packs into 62 rows: 7 steps of 2x4 rows
TOTAL = EPOCHS * STEPS_PER_EPOCH
SIGTERM_STEP = 9   # rank 1's SIGTERM comes after step 8, before step 9; committed by then: 3, 6, 7 (epoch end)


PATCHES: list = []  # (path, status) of every status patch the recorder received


class _Recorder(BaseHTTPRequestHandler):
    def do_PATCH(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        PATCHES.append((self.path, body["status"]))
        out = b"{}"
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def status_recorder(tmp_path_factory):
    """A loopback HTTP server that records status patches, and KUBECONFIG pointing at it, set
    before Ray starts (workers inherit the environment of the process that starts Ray)."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    kubeconfig = tmp_path_factory.mktemp("kube") / "config"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "rec",
        "clusters": [{"name": "rec", "cluster": {"server": f"http://127.0.0.1:{server.server_port}"}}],
        "users": [{"name": "rec", "user": {"token": "t"}}],
        "contexts": [{"name": "rec", "context": {"cluster": "rec", "user": "rec"}}]}))
    mp = pytest.MonkeyPatch()
    mp.setenv("KUBECONFIG", str(kubeconfig))
    mp.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    mp.setenv("TPUFT_NAMESPACE", NS)
    mp.setenv("TPUFT_NAME", NAME)
    yield PATCHES
    mp.undo()
    server.shutdown()


@pytest.fixture(scope="module")
def ray_env(status_recorder, ray_cluster):
    return status_recorder


def _training_patches(recorded: list) -> list[dict]:
    out = [s["training"] for _, s in recorded if "training" in s]
    recorded.clear()
    return out


def _run(storage: Path, uid: str, fault: str = "", **extra) -> tuple[int, dict]:
    """The RayJob's CLI path for object `uid`: exit code and its TPUFT_TRAIN_RESULT line."""
    argv = ["train", "--accelerator", "cpu", "--topology", "2", "--model", "builtin:tiny-llama",
            "--dataset", "builtin:dolly-mini", "--dataset-split", "train[:80]", "--epochs", str(EPOCHS),
            "--batch-size-per-device", "4", "--max-seq-length", "128", "--learning-rate", "3e-3",
            "--storage-path", str(storage), "--run-name", f"{NS}-{NAME}-{uid}", "--report-every-steps", "100",
            "--checkpoint-every-steps", str(CKPT_EVERY), "--keep-checkpoints", "20", "--max-failures", "0"]
    for k, v in extra.items():
        argv += [f"--{k.replace('_', '-')}", str(v)]
    args, target = cli.parse_args(argv)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = train.run_training(args, target, fault)
    line = [ln for ln in out.getvalue().splitlines() if ln.startswith(train.RESULT_PREFIX)][-1]
    return rc, json.loads(line[len(train.RESULT_PREFIX):])


def _files(run_dir: Path) -> dict[str, str]:
    return {str(p.relative_to(run_dir)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(run_dir.rglob("*")) if p.is_file()}


def _committed(run_dir: Path) -> list[int]:
    return sorted(int(p.parent.name.rsplit("_", 1)[1])
                  for p in run_dir.glob(f"checkpoint_step_*/{checkpoint.COMMITTED}"))


@pytest.fixture(scope="module")
def first_object(ray_env, tmp_path_factory):
    """Object uid-a: stopped mid-run (SIGTERM to rank 1; no in-job restarts), then its training
    RayJob is resubmitted."""
    storage = tmp_path_factory.mktemp("storage")
    run_dir = storage / f"{NS}-{NAME}-uid-a"
    stopped = _run(storage, "uid-a", fault=f"sigterm-rank:1:step:{SIGTERM_STEP}")
    stopped_patches, committed_after_stop = _training_patches(ray_env), _committed(run_dir)
    summary_after_stop = (run_dir / train.SUMMARY).exists()
    ray_env.clear()
    retry = _run(storage, "uid-a")
    return {"storage": storage, "run_dir": run_dir, "stopped": stopped, "retry": retry,
            "stopped_patches": stopped_patches, "committed_after_stop": committed_after_stop,
            "summary_after_stop": summary_after_stop, "patches": _training_patches(ray_env), "files": _files(run_dir)}


def test_a_sigterm_to_one_rank_saves_the_next_step_on_every_rank(first_object):
    from tpuft.constants import EXIT_STOPPED

    signalled_after = SIGTERM_STEP - 1   # the last step rank 1 had finished when it got the SIGTERM
    rc, body = first_object["stopped"]
    assert rc == EXIT_STOPPED and body["succeeded"] is False and body["stopped"] == "SIGTERM", body
    saved = body["step"]
    assert saved - signalled_after in (1, 2), body   # at the next step boundary (at most one more)
    assert body["lastCheckpoint"] == str(first_object["run_dir"] / f"checkpoint_step_{saved:07d}")
    assert body["message"] == f"stop requested (SIGTERM): checkpoint at step {saved} saved; " \
                              "resume repeats at most one step"
    assert first_object["committed_after_stop"] == sorted({3, 6, 7, 9, saved})   # both ranks' shards, committed
    assert not first_object["summary_after_stop"]   # not finished: no summary, no export
    last = first_object["stopped_patches"][-1]
    assert (last["step"], last["message"], last["lastCheckpoint"]) == (saved, body["message"], body["lastCheckpoint"])
    assert "exportedModel" not in last
    manifest = json.loads((first_object["run_dir"] / checkpoint.RUN_MANIFEST).read_text())
    assert manifest["format"] == checkpoint.RUN_FORMAT and manifest["model"] == "builtin:tiny-llama"
    assert (manifest["namespace"], manifest["name"]) == (NS, NAME)


def test_a_retry_of_the_same_object_resumes_step_exact_from_its_own_newest_checkpoint(first_object):
    saved = first_object["stopped"][1]["step"]
    rc, body = first_object["retry"]
    assert rc == 0 and body["succeeded"], body
    assert body["resumedFromStep"] == saved and body["step"] == body["totalSteps"] == TOTAL   # nothing repeated
    assert body["resumedFrom"] == first_object["stopped"][1]["lastCheckpoint"]
    assert body["loss"] > 0 and body["tokensPerSecond"] > 0
    first = first_object["patches"][0]
    assert (first["resumedFromStep"], first["step"]) == (saved, saved)
    assert first["message"].startswith(f"resumed at step {saved}")
    print(f"SIGTERM after step {SIGTERM_STEP - 1}: checkpoint at step {saved}, resumed at step "
          f"{body['resumedFromStep']}: {saved - body['resumedFromStep']} steps repeated")


def test_resume_from_an_earlier_run_continues_it_into_this_objects_directory(first_object, ray_env):
    storage, first = first_object["storage"], first_object["run_dir"]
    rc, body = _run(storage, "uid-c", epochs=EPOCHS + 1, resume_from=first)
    assert rc == 0 and body["succeeded"], body
    assert body["resumedFromStep"] == TOTAL and body["step"] == TOTAL + STEPS_PER_EPOCH
    assert body["resumedFrom"] == str(first / f"checkpoint_step_{TOTAL:07d}")
    patches = _training_patches(ray_env)
    assert patches[0]["resumedFrom"] == body["resumedFrom"] and patches[0]["resumedFromStep"] == TOTAL
    assert _committed(storage / f"{NS}-{NAME}-uid-c") == [15, 18, 21]
    manifest = json.loads((storage / f"{NS}-{NAME}-uid-c" / checkpoint.RUN_MANIFEST).read_text())
    assert manifest["resumeFrom"] == body["resumedFrom"]
    assert _files(first) == first_object["files"]


def test_resumed_at_the_last_step_keeps_the_completed_runs_metrics(first_object, ray_env):
    storage, first = first_object["storage"], first_object["run_dir"]
    done = first_object["retry"][1]
    rc, body = _run(storage, "uid-d", resume_from=first / f"checkpoint_step_{TOTAL:07d}")
    assert rc == 0 and body["succeeded"], body
    assert body["step"] == body["resumedFromStep"] == TOTAL
    assert "nothing left to do" in body["message"]
    assert (body["loss"], body["tokensPerSecond"]) == (done["loss"], done["tokensPerSecond"])
    patches = _training_patches(ray_env)
    assert "nothing left to do" in patches[0]["message"] and patches[0]["loss"] == done["loss"]
    final = patches[-1]
    assert final["exportedModel"] == str(storage / f"{NS}-{NAME}-uid-d" / "export")  # this object's own export
    assert (final["loss"], final["tokensPerSecond"]) == (done["loss"], done["tokensPerSecond"])
    assert _files(first) == first_object["files"]


@pytest.mark.parametrize("case", ["missing", "foreign"])
def test_resume_from_refused_before_any_worker_starts(first_object, ray_env, tmp_path, case):
    if case == "missing":
        target, words = tmp_path / "no-such-run", "does not exist"
    else:  # a directory of checkpoints no TPUFinetune wrote
        target, words = tmp_path / "elsewhere" / "checkpoint_step_0000014", "was not written by a TPUFinetune"
        target.mkdir(parents=True)
        (target / "model.pt").write_text("x")
    rc, body = _run(first_object["storage"], f"uid-{case}", resume_from=target)
    assert rc == 1 and body["succeeded"] is False
    assert body["error"].startswith(f"spec.checkpoint.resumeFrom: {target}") and words in body["error"]
    assert [p["message"] for p in _training_patches(ray_env)] == [body["error"]]  # recorded in status
    assert not (first_object["storage"] / f"{NS}-{NAME}-uid-{case}" / checkpoint.RUN_MANIFEST).exists()


def test_resume_from_a_different_architecture_is_refused(first_object, ray_env, tmp_path):
    from tpuft_workload import model as modellib
    from tpuft_workload.tiny import build_model

    tok = modellib.load_tokenizer("builtin:tiny-llama")
    other = tmp_path / "wider-llama"
    build_model(len(tok), hidden=32).save_pretrained(other)
    tok.save_pretrained(other)
    rc, body = _run(first_object["storage"], "uid-e", model=other, resume_from=first_object["run_dir"])
    assert rc == 1 and body["succeeded"] is False
    assert "spec.checkpoint.resumeFrom" in body["error"] and "different model architecture" in body["error"], body
    messages = [p["message"] for p in _training_patches(ray_env) if "message" in p]
    assert len(messages) == 1 and str(first_object["run_dir"]) in messages[0] and str(other) in messages[0]
