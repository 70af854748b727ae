"""Fixtures for the workload tests: one real local Ray per test module, under a host-wide lock.

Only one local Ray may run on a machine at a time (other engineers' tests start Ray too),
so `ray_cluster` takes an exclusive flock on /tmp/tpuft-ray.lock for the module's lifetime
and always shuts Ray down. Do not also wrap pytest in `flock` on that file: the fixture would
wait on its own lock (it gives up with a clear error after TPUFT_RAY_LOCK_WAIT_S seconds).
"""
from __future__ import annotations

import fcntl
import os
import time

import pytest

RAY_LOCK = "/tmp/tpuft-ray.lock"


@pytest.fixture(scope="module")
def ray_cluster():
    """Start a local Ray (4 logical CPUs: 2 workers + the Train controller fit on 2 cores)."""
    wait_s = float(os.environ.get("TPUFT_RAY_LOCK_WAIT_S", "900"))
    lock = open(RAY_LOCK, "w")
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() > deadline:
                lock.close()
                pytest.fail(f"another local Ray holds {RAY_LOCK} for more than {wait_s:.0f}s "
                            "(is pytest itself wrapped in `flock` on that file?)")
            time.sleep(1)
    import ray

    env = pytest.MonkeyPatch()
    env.setenv("RAY_AUTH_MODE", "disabled")  # Ray 2.60 turns on token auth for local clusters
    # Ray Train's controller polls workers every 2 s and a report() waits for that poll; a
    # shorter interval keeps the many small reports of these tests from dominating their time.
    env.setenv("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", os.environ.get("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5"))
    try:
        ctx = ray.init(num_cpus=4, include_dashboard=False, log_to_driver=True)
        yield ctx.address_info["gcs_address"]
    finally:
        ray.shutdown()
        env.undo()
        fcntl.flock(lock, fcntl.LOCK_UN)
        lock.close()
