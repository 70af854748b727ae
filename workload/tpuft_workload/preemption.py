"""Stop at the next step boundary on SIGTERM, with a checkpoint: a stopped run repeats at most one step.

What a pod's stop looks like here (a Kueue eviction suspending the RayCluster, a node drain, a spot
reclaim): the kubelet runs the Ray container's preStop hook (`python -m tpuft_workload.preemption`,
`hook`), which sends SIGTERM to this pod's Ray Train worker processes and waits; only then does PID 1
(`ray start --block`) get its SIGTERM. In a worker, `StopFlag.install` puts a handler on SIGTERM that
only sets a flag (Ray's own handler raises SystemExit at once). At every step boundary the ranks agree
(train.py: one all-reduce MAX of a 0/1 int over a gloo group; jax_train.py: JAX's preemption sync
point): any rank told to stop -> every rank saves the normal committed checkpoint of that step and the
train function returns. The driver then reports a stopped run (EXIT_STOPPED), never a finished one.

Ray Train 2.60 has its own preemption hook, `ray.train.get_preemption_info()` (ray/train/v2/api/
train_fn_utils.py, fed by _internal/execution/preemption.py's PreemptionWatcher), but it only sees
Ray Core's node drains (GCS DrainNode: the autoscaler or `ray drain-node`), polled every 5 s, and every
call is a barrier through a Ray actor. Nothing turns a pod's SIGTERM into such a drain, so it is not
used; this module listens for the SIGTERM itself.

Stdlib only at import: the hook runs in the preStop's short-lived process.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time

from tpuft.api.constants import PRESTOP_WAIT_SECONDS, STOP_MARKER_DIR
from tpuft.api.kuberay import RAY_TRAIN_WORKER_PROCESS_TITLE

REASON = "SIGTERM"
# After a worker's marker appears, how long the hook still waits for its process to end (Ray Train's
# controller polls, sees every train function done and ends the worker actors).
EXIT_AFTER_MARKER_S = 30.0
POLL_S = 0.2

_received = threading.Event()   # set by the handler (the worker's main thread), read by the train thread
_wakeup: int | None = None      # read end of the signal wakeup pipe, when this module owns the wakeup fd


def _on_sigterm(signum, frame) -> None:
    if not _received.is_set():
        sys.stdout.write(f"[tpuft] {REASON} received: stopping at the next step boundary with a checkpoint\n")
        sys.stdout.flush()
    _received.set()


def _install_here() -> bool:
    """In the process's main thread (Python installs signal handlers only there). The handler runs
    only when the main thread next runs Python code; the wakeup fd is written by the C-level handler
    at once, so `requested` sees a SIGTERM at the very next step boundary either way."""
    global _wakeup
    signal.signal(signal.SIGTERM, _on_sigterm)
    if _wakeup is None:
        r, w = os.pipe()
        os.set_blocking(r, False)
        os.set_blocking(w, False)
        if signal.set_wakeup_fd(w, warn_on_full_buffer=False) == -1:
            _wakeup = r
        else:   # someone else's (an asyncio loop): leave it theirs, the handler still sets the flag
            signal.set_wakeup_fd(-1)
            os.close(r)
            os.close(w)
    return True


def install() -> bool:
    """Put the flag-setting handler on SIGTERM in this Ray Train worker process; False if it could not.

    Ray Train 2.60 runs the train function in a thread of its own (worker_group/thread_runner.py), so
    the handler is installed by a task on this worker's own actor (RayTrainWorker.execute): a sync actor
    runs its tasks in the main thread, where Ray's worker loop had installed its SystemExit handler.
    The handler itself runs in that main thread too, at the next Python code it runs: Ray Train's
    status poll (RAY_TRAIN_HEALTH_CHECK_INTERVAL_S: 2 s by default, 0.5 s as the driver sets it) reaches
    every worker that often."""
    if threading.current_thread() is threading.main_thread():
        return _install_here()
    import ray

    try:
        actor = ray.get_runtime_context().current_actor
        return bool(ray.get(actor.execute.remote(_install_here), timeout=60))
    except Exception as e:  # noqa: BLE001 - a run without the hook still trains (and loses work on a stop)
        sys.stdout.write(f"[tpuft] warning: no SIGTERM handler in this worker ({type(e).__name__}: {e}); "
                         "a stop loses the steps since the last checkpoint\n")
        sys.stdout.flush()
        return False


def requested() -> bool:
    """This process was told to stop (its own flag: the ranks still have to agree). One non-blocking
    read of the wakeup pipe: about a microsecond."""
    if not _received.is_set() and _wakeup is not None:
        try:
            if signal.SIGTERM in os.read(_wakeup, 512):   # the signal numbers, one byte each
                _received.set()
        except BlockingIOError:
            pass
    return _received.is_set()


def message(step: int) -> str:
    return (f"stop requested ({REASON}): checkpoint at step {step} saved; "
            "resume repeats at most one step")


def write_marker(step: int, checkpoint: str, directory: str = STOP_MARKER_DIR) -> None:
    """Tell this pod's preStop hook that this process's stop checkpoint is committed."""
    try:
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, f"{os.getpid()}.json"), "w") as f:
            json.dump({"step": step, "checkpoint": checkpoint, "reason": REASON}, f)
    except OSError:
        pass   # the hook then waits for the process to end, which it does anyway


# ---- the preStop hook ---------------------------------------------------------------------------

def _cmdline(pid: int, proc: str) -> list[str]:
    try:
        with open(f"{proc}/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []


def _pids(proc: str) -> list[int]:
    return sorted(int(p) for p in os.listdir(proc) if p.isdigit())


def train_worker_pids(proc: str = "/proc") -> list[int]:
    """This pod's Ray Train worker processes: Ray sets their title ("ray::RayTrainWorker", with
    ".<method>" while it runs one) as their whole command line."""
    out = []
    for pid in _pids(proc):
        args = _cmdline(pid, proc)
        title = args[0].strip() if args else ""
        if title == RAY_TRAIN_WORKER_PROCESS_TITLE or title.startswith(RAY_TRAIN_WORKER_PROCESS_TITLE + "."):
            out.append(pid)
    return out


def train_driver_pids(proc: str = "/proc") -> list[int]:
    """The training RayJob's driver (`python -m tpuft_workload train ...`): on the head."""
    out = []
    for pid in _pids(proc):
        args = _cmdline(pid, proc)
        if "-m" in args and "tpuft_workload" in args and "train" in args:
            out.append(pid)
    return out


def _alive(pid: int, proc: str) -> bool:
    try:
        with open(f"{proc}/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"   # a zombie has ended
    except OSError:
        return False


def hook(timeout_s: float = PRESTOP_WAIT_SECONDS, proc: str = "/proc", markers: str = STOP_MARKER_DIR,
         kill=os.kill, clock=time.monotonic, sleep=time.sleep) -> dict:
    """SIGTERM to this pod's Ray Train workers, then wait (at most `timeout_s`) until each has ended
    (or wrote its marker EXIT_AFTER_MARKER_S ago) and this pod's train driver, if any, has ended.
    Returns what it saw (for the log line and tests)."""
    start = clock()
    deadline = start + timeout_s
    workers = train_worker_pids(proc)
    for pid in workers:
        try:
            kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    saved: dict[int, dict] = {}
    marked_at: dict[int, float] = {}
    while clock() < deadline:
        for pid in workers:
            if pid not in saved:
                try:
                    with open(os.path.join(markers, f"{pid}.json")) as f:
                        saved[pid] = json.load(f)
                    marked_at[pid] = clock()
                except (OSError, ValueError):
                    pass
        waiting = [p for p in workers if _alive(p, proc) and clock() - marked_at.get(p, clock()) < EXIT_AFTER_MARKER_S]
        drivers = [p for p in train_driver_pids(proc) if _alive(p, proc)]
        if not waiting and not drivers:
            break
        sleep(POLL_S)
    left = [p for p in workers + train_driver_pids(proc) if _alive(p, proc)]
    return {"workers": workers, "saved": {p: s.get("step") for p, s in saved.items()},
            "left": left, "seconds": round(clock() - start, 1)}


def _log(line: str) -> None:
    """To the container's log (PID 1's stdout) when it can be reached: a preStop's own output is not kept."""
    try:
        with open("/proc/1/fd/1", "w") as f:
            f.write(line + "\n")
    except OSError:
        pass
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m tpuft_workload.preemption",
                                description="preStop hook: stop this pod's Ray Train workers at a checkpoint")
    p.add_argument("--timeout-seconds", type=float, default=PRESTOP_WAIT_SECONDS)
    args = p.parse_args(argv)
    seen = hook(args.timeout_seconds)
    _log(f"[tpuft] preStop: SIGTERM to Ray Train workers {seen['workers']}; checkpoint saved by "
         f"{sorted(seen['saved'])} (steps {sorted(set(seen['saved'].values()))}); still running: "
         f"{seen['left']}; {seen['seconds']} s")
    return 0   # a failed hook only adds a FailedPreStopHook event: the pod stops either way


if __name__ == "__main__":
    sys.exit(main())
