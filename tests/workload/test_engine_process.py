"""tpuft_workload.engine_process: the serving engine's model in a child process of the replica. What
a replica relies on: a model that cannot load fails the replica's start naming the folder, and the
child never outlives its replica (closed cleanly or killed), so a replaced replica leaves no model
behind in the pod's memory. Answers through the child: tests/workload/test_serve.py."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tpuft_workload import checkpoint, engine_process, tiny

GONE_WAIT_S = 30.0


@pytest.fixture(scope="module")
def export(tmp_path_factory) -> str:
    tok = tiny.build_tokenizer()
    return checkpoint.export_hf(tiny.build_model(len(tok), seed=0), tok,
                                str(tmp_path_factory.mktemp("engine") / "export"), rank=0)


def _gone(pid: int) -> bool:
    """Exited: no such process, or a zombie nobody has reaped yet."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, ProcessLookupError):
        return True


def _wait_gone(pid: int) -> bool:
    deadline = time.monotonic() + GONE_WAIT_S
    while time.monotonic() < deadline:
        if _gone(pid):
            return True
        time.sleep(0.1)
    return False


def test_a_folder_without_a_model_fails_the_start_naming_it(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(RuntimeError, match=f"the engine process could not load {tmp_path}: "):
        engine_process.EngineProcess(str(tmp_path), 4)


def test_close_ends_the_child_by_closing_its_pipe(export):
    process = engine_process.EngineProcess(export, 4)
    assert process.ready.continuous and process.returncode is None
    # A generous bound: under a loaded CI (this lane runs niced beside the cluster lanes) the child's
    # interpreter took over the default 10 s to exit, and was killed; the exit on EOF is what is tested.
    process.close(timeout_s=90)
    assert process.returncode == 0   # it read EOF and returned: not killed


def test_the_child_exits_when_its_replica_is_killed(export):
    """SIGKILL gives the replica no chance to close anything: the child sees its pipe close and goes."""
    script = ("import sys, time\nfrom tpuft_workload import engine_process\n"
              "p = engine_process.EngineProcess(sys.argv[1], 2)\nprint(p.pid, flush=True)\ntime.sleep(600)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    replica = subprocess.Popen([sys.executable, "-c", script, export], stdout=subprocess.PIPE, text=True, env=env)
    child = None
    try:
        child = int(replica.stdout.readline())
        assert not _gone(child)
        replica.send_signal(signal.SIGKILL)
        replica.wait(GONE_WAIT_S)
        assert _wait_gone(child), f"the engine process {child} outlived its replica"
    finally:
        if replica.poll() is None:
            replica.kill()
            replica.wait()
        replica.stdout.close()
        if child is not None and not _gone(child):   # started by this test: ended by it too
            os.kill(child, signal.SIGKILL)
