"""tpuft_workload.driver_log: what the driver writes to stdout and stderr also lands in --log-file
(each attempt appended, its first line saying so), the streams are the driver's own again after
the block, and a log that cannot be written never fails the job."""
from __future__ import annotations

import sys

from tpuft_workload import driver_log


def test_stdout_and_stderr_go_to_the_file_too_and_attempts_append(tmp_path, capsys):
    path = tmp_path / "run" / "logs" / "train.log"
    streams = sys.stdout, sys.stderr
    for attempt in (1, 2):
        with driver_log.tee(str(path), "train") as written:
            print(f"Epoch {attempt}/2 | loss=0.5", flush=True)
            sys.stderr.write(f"WARNING attempt {attempt}\n")
        assert written == str(path) and (sys.stdout, sys.stderr) == streams
    out, err = capsys.readouterr()
    assert out == "Epoch 1/2 | loss=0.5\nEpoch 2/2 | loss=0.5\n" and err == "WARNING attempt 1\nWARNING attempt 2\n"
    lines = path.read_text().splitlines()
    assert [ln for ln in lines if not ln.startswith("[tpuft] train driver started ")] == [
        "Epoch 1/2 | loss=0.5", "WARNING attempt 1", "Epoch 2/2 | loss=0.5", "WARNING attempt 2"]
    assert len(lines) == 6


def test_without_a_log_file_nothing_changes(capsys):
    streams = sys.stdout, sys.stderr
    with driver_log.tee(None, "verify") as written:
        assert (sys.stdout, sys.stderr) == streams
    assert written is None


def test_a_log_that_cannot_be_written_is_said_once_and_the_job_goes_on(tmp_path, capsys):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    with driver_log.tee(str(blocker / "train.log"), "train") as written:
        print("still running")
    assert written is None
    out, err = capsys.readouterr()
    assert out == "still running\n"
    assert f"cannot write the driver log to {blocker / 'train.log'}" in err and "continuing without it" in err


def test_a_log_that_cannot_be_uploaded_is_said_once_and_the_job_goes_on(capsys):
    with driver_log.tee("nosuchscheme://bucket/run/logs/verify.log", "verify"):
        print("verified")
    out, err = capsys.readouterr()
    assert out == "verified\n"
    assert err.count("the driver log stays on this host: nosuchscheme://bucket/run/logs/verify.log") == 1, err
    assert "could not upload" not in err   # not tried again
