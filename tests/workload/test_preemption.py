"""The stop-on-SIGTERM helper without Ray: the flag handler, and the preStop hook on a fake /proc.

The real thing (a SIGTERM to one Ray Train worker mid-run, a checkpoint at the next step, a resume
from it) runs in tests/workload/test_train.py, beside its Ray runs.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from tpuft.api.kuberay import RAY_TRAIN_WORKER_PROCESS_TITLE
from tpuft_workload import preemption


def _proc(root, pid: int, args: list[str], state: str = "S") -> None:
    d = root / str(pid)
    d.mkdir(parents=True, exist_ok=True)
    (d / "cmdline").write_bytes(b"\0".join(a.encode() for a in args) + b"\0")
    (d / "stat").write_text(f"{pid} ({args[0][:15]}) {state} 1 1 1")


@pytest.fixture
def pod(tmp_path):
    """A worker pod's processes: two Ray Train workers (one idle, one running a method), and others."""
    proc = tmp_path / "proc"
    _proc(proc, 1, ["/usr/bin/python", "/usr/local/bin/ray", "start", "--block"])
    _proc(proc, 40, ["ray::TrainController"])
    _proc(proc, 41, [RAY_TRAIN_WORKER_PROCESS_TITLE])
    _proc(proc, 42, [RAY_TRAIN_WORKER_PROCESS_TITLE + ".poll_status"])
    _proc(proc, 43, ["ray::RayTrainWorkerGroup"])          # not a worker: the title must match exactly
    _proc(proc, 44, ["ray::IDLE"])
    return proc, tmp_path / "markers"


class _Clock:
    def __init__(self):
        self.t, self.events = 0.0, []

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.t += s
        for at, fn in [e for e in self.events if e[0] <= self.t]:
            self.events.remove((at, fn))
            fn()


def test_the_hook_finds_the_train_workers_by_their_title(pod):
    proc, _ = pod
    assert preemption.train_worker_pids(str(proc)) == [41, 42]
    assert preemption.train_driver_pids(str(proc)) == []
    _proc(proc, 7, ["python", "-m", "tpuft_workload", "train", "--epochs", "1"])
    _proc(proc, 8, ["/bin/sh", "-c", "python -m tpuft_workload train --epochs 1"])   # its shell: not it
    _proc(proc, 9, ["python", "-m", "tpuft_workload", "verify"])
    assert preemption.train_driver_pids(str(proc)) == [7]


def test_the_hook_signals_the_workers_and_waits_for_their_checkpoint_and_exit(pod):
    proc, markers = pod
    clock, sent = _Clock(), []
    markers.mkdir()

    def kill(pid, sig):
        sent.append((pid, sig))
        # each worker saves 4 s later, and Ray ends its process 1 s after that
        clock.events.append((4.0, lambda: (markers / f"{pid}.json").write_text(json.dumps({"step": 12}))))
        clock.events.append((5.0, lambda: _proc(proc, pid, ["ray::RayTrainWorker"], state="Z")))

    seen = preemption.hook(60, str(proc), str(markers), kill=kill, clock=clock, sleep=clock.sleep)
    assert sent == [(41, signal.SIGTERM), (42, signal.SIGTERM)]
    assert seen["saved"] == {41: 12, 42: 12} and seen["left"] == []
    assert 5.0 <= seen["seconds"] < 6.0


def test_the_head_waits_for_the_train_driver(pod):
    proc, markers = pod
    for pid in (41, 42):
        (proc / str(pid)).rename(proc / f"gone-{pid}")   # the head runs no train workers
    _proc(proc, 7, ["python", "-m", "tpuft_workload", "train"])
    clock = _Clock()
    clock.events.append((9.0, lambda: _proc(proc, 7, ["python"], state="Z")))
    seen = preemption.hook(60, str(proc), str(markers), kill=lambda *a: None, clock=clock, sleep=clock.sleep)
    assert seen["workers"] == [] and seen["left"] == [] and 9.0 <= seen["seconds"] < 10.0


def test_the_hook_gives_up_at_its_timeout(pod):
    proc, markers = pod
    clock = _Clock()
    seen = preemption.hook(30, str(proc), str(markers), kill=lambda *a: None, clock=clock, sleep=clock.sleep)
    assert seen["left"] == [41, 42] and seen["saved"] == {} and 30.0 <= seen["seconds"] < 31.0


def test_a_marked_worker_that_lingers_is_waited_for_only_a_while(pod):
    proc, markers = pod
    markers.mkdir()
    for pid in (41, 42):
        (markers / f"{pid}.json").write_text(json.dumps({"step": 3}))
    clock = _Clock()
    seen = preemption.hook(200, str(proc), str(markers), kill=lambda *a: None, clock=clock, sleep=clock.sleep)
    assert seen["saved"] == {41: 3, 42: 3}
    assert preemption.EXIT_AFTER_MARKER_S <= seen["seconds"] < preemption.EXIT_AFTER_MARKER_S + 1


def test_sigterm_only_sets_the_flag(tmp_path):
    """In a process of its own: the handler stays installed there."""
    code = ("import os, signal, time\n"
            "from tpuft_workload import preemption\n"
            "assert preemption.install() and not preemption.requested()\n"
            "os.kill(os.getpid(), signal.SIGTERM)\n"
            "time.sleep(0.1)\n"
            "assert preemption.requested()\n"
            f"preemption.write_marker(5, '/ckpt/step_5', {str(tmp_path)!r})\n"
            "print('alive')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "SIGTERM received: stopping at the next step boundary" in out.stdout and "alive" in out.stdout
    (marker,) = tmp_path.iterdir()
    assert json.loads(marker.read_text()) == {"step": 5, "checkpoint": "/ckpt/step_5", "reason": "SIGTERM"}


def test_the_hook_starts_without_ray_or_torch():
    """It runs in the preStop's own short-lived process: stdlib only."""
    code = ("import sys, tpuft_workload.preemption\n"
            "print(sorted(m for m in ('ray', 'torch', 'jax') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_the_hook_cli_reports_what_it_did(monkeypatch, capsys):
    monkeypatch.setattr(preemption, "hook", lambda timeout_s: {"workers": [41], "saved": {41: 8}, "left": [],
                                                                "seconds": 2.5})
    assert preemption.main(["--timeout-seconds", "5"]) == 0
    assert "SIGTERM to Ray Train workers [41]; checkpoint saved by [41] (steps [8])" in capsys.readouterr().out
