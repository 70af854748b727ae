"""A checkpoint path that cannot be written fails in seconds, with its name, before Ray starts."""
import json
import subprocess
import sys

import pytest

from tpuft_workload import checkpoint


def test_writable_local_path_is_created_and_left_clean(tmp_path):
    target = tmp_path / "bucket" / "run"
    checkpoint.check_writable(str(target))
    assert target.is_dir() and list(target.iterdir()) == []


def test_a_path_under_a_file_is_reported_with_its_name(tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    with pytest.raises(checkpoint.StorageError) as err:
        checkpoint.check_writable(str(blocker / "run"))
    assert str(blocker / "run") in str(err.value) and "not writable" in str(err.value)
    assert "spec.checkpoint.storagePath" in str(err.value)


def test_train_cli_fails_fast_on_an_unwritable_storage_path(tmp_path, ray_auth_env):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    proc = subprocess.run(
        [sys.executable, "-m", "tpuft_workload", "train", "--accelerator", "cpu", "--topology", "2",
         "--model", "builtin:tiny-llama", "--dataset", "builtin:dolly-mini", "--storage-path", str(blocker),
         "--run-name", "r"],
        # the session's token: a regression that reaches ray.init must not write ~/.ray/auth_token
        capture_output=True, text=True, timeout=120, env={**ray_auth_env, "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 1, proc.stderr[-2000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("TPUFT_TRAIN_RESULT "))
    result = json.loads(line.split(" ", 1)[1])
    assert result["succeeded"] is False and "not writable" in result["error"]
    assert "ray.init" not in proc.stderr and "Started a local Ray instance" not in proc.stderr + proc.stdout


# ---- spec.checkpoint.resumeFrom: what is refused before any worker starts -----------------------

def _run_dir(root, manifest=True, committed=True, step=14):
    run = root / "ns-demo-uid-a"
    ckpt = run / f"checkpoint_step_{step:07d}"
    ckpt.mkdir(parents=True)
    (ckpt / checkpoint.TRAIN_STATE).write_text(json.dumps({"step": step}))
    if committed:
        (ckpt / checkpoint.COMMITTED).write_text("ok\n")
    if manifest:
        checkpoint.write_run_manifest(str(run), {"model": "builtin:tiny-llama", "architecture": {"class": "X"}})
    return run, ckpt


def test_resume_from_a_run_directory_picks_its_newest_committed_checkpoint(tmp_path):
    run, ckpt = _run_dir(tmp_path)
    (run / "checkpoint_step_0000020").mkdir()  # newer but never committed
    assert checkpoint.resolve_resume(str(run)) == (str(ckpt), json.loads((run / checkpoint.RUN_MANIFEST).read_text()))
    assert checkpoint.resolve_resume(str(ckpt) + "/")[0] == str(ckpt)


@pytest.mark.parametrize("case,words", [
    ("missing", "does not exist"),
    ("foreign", "was not written by a TPUFinetune"),
    ("file", "is a file"),
    ("uncommitted", "is incomplete"),
    ("empty-run", "holds no committed checkpoint"),
    ("other-format", "is not a tpuft-run/v1 manifest"),
])
def test_resume_from_refusals_name_the_field_and_the_path(tmp_path, case, words):
    if case == "missing":
        target = tmp_path / "gone"
    elif case == "foreign":  # checkpoints some other tool wrote: no manifest beside them
        _, target = _run_dir(tmp_path, manifest=False)
    elif case == "file":
        target = tmp_path / "model.safetensors"
        target.write_text("x")
    elif case == "uncommitted":
        _, target = _run_dir(tmp_path, committed=False)
    elif case == "empty-run":
        target, _ = _run_dir(tmp_path, committed=False)
    else:
        target, _ = _run_dir(tmp_path)
        (target / checkpoint.RUN_MANIFEST).write_text(json.dumps({"format": "something-else/v9"}))
    with pytest.raises(checkpoint.ResumeError) as err:
        checkpoint.resolve_resume(str(target))
    assert str(err.value).startswith("spec.checkpoint.resumeFrom: ") and str(target) in str(err.value)
    assert words in str(err.value)


def test_run_manifest_is_written_once(tmp_path):
    checkpoint.write_run_manifest(str(tmp_path / "run"), {"model": "first"})
    checkpoint.write_run_manifest(str(tmp_path / "run"), {"model": "second"})  # a retry
    assert json.loads((tmp_path / "run" / checkpoint.RUN_MANIFEST).read_text()) == {
        "format": checkpoint.RUN_FORMAT, "model": "first"}


def test_architecture_mismatch_names_both_models():
    theirs = {"model": "builtin:tiny-llama", "architecture": {"class": "LlamaForCausalLM", "parameters": 10,
                                                              "shapes": "aaaa"}}
    ours = {"class": "LlamaForCausalLM", "parameters": 20, "shapes": "bbbb"}
    checkpoint.check_architecture("/ckpt/run", theirs, theirs["architecture"], "builtin:tiny-llama")
    with pytest.raises(checkpoint.ResumeError) as err:
        checkpoint.check_architecture("/ckpt/run", theirs, ours, "/models/other")
    msg = str(err.value)
    assert msg.startswith("spec.checkpoint.resumeFrom: /ckpt/run was written for a different model architecture")
    assert "10 parameters" in msg and "20 parameters" in msg and "/models/other" in msg
