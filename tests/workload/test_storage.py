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


def test_train_cli_fails_fast_on_an_unwritable_storage_path(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    proc = subprocess.run(
        [sys.executable, "-m", "tpuft_workload", "train", "--accelerator", "cpu", "--topology", "2",
         "--model", "builtin:tiny-llama", "--dataset", "builtin:dolly-mini", "--storage-path", str(blocker),
         "--run-name", "r"],
        capture_output=True, text=True, timeout=120, env={"RAY_AUTH_MODE": "disabled", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 1, proc.stderr[-2000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("TPUFT_TRAIN_RESULT "))
    result = json.loads(line.split(" ", 1)[1])
    assert result["succeeded"] is False and "not writable" in result["error"]
    assert "ray.init" not in proc.stderr and "Started a local Ray instance" not in proc.stderr + proc.stdout
