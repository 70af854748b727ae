"""Fixtures for the workload tests: one real local Ray for the session, under a host-wide lock, and a
loopback stand-in for the API server's status subresource that its workers report to.

Only one local Ray may run on a machine at a time (other engineers' tests start Ray too),
so `ray_cluster` takes an exclusive flock on /tmp/tpuft-ray.lock for the session's lifetime
and always shuts Ray down. One Ray for every module, not one each: a start costs some ten CPU-seconds
of the 2 cores the whole suite shares. Do not also wrap pytest in `flock` on that file: the fixture would
wait on its own lock (it gives up with a clear error after TPUFT_RAY_LOCK_WAIT_S seconds).

`tiny_train` runs the tiny model through the RayJob's CLI path, either framework; `killed_run` is the
run every trainer's tests start from: one rank killed, the group restarted from the newest checkpoint.

Ray runs with token authentication, as Ray 2.60 defaults to for a local cluster, but with a random
token for this session in RAY_AUTH_TOKEN (which Ray's token loader reads before RAY_AUTH_TOKEN_PATH
and ~/.ray/auth_token): nothing is written to the user's ~/.ray, and every process a test starts
(a driver connecting through RAY_ADDRESS, the workload's CLI) inherits the token. Set here, at import,
because Ray reads RAY_AUTH_MODE once, when it is first imported. The `ray_auth_env` fixture gives
the same variables to a test that starts a process with an environment of its own.
"""
from __future__ import annotations

import atexit
import contextlib
import fcntl
import io
import json
import os
import secrets
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from tests.ranks import file_rendezvous
from tests.factories import TINY_CKPT_EVERY, TINY_STEPS_PER_EPOCH, tiny_train_argv
from tests.http_stub import QuietHandler, serving

RAY_LOCK = "/tmp/tpuft-ray.lock"
RAY_AUTH_ENV = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
os.environ.update(RAY_AUTH_ENV)
os.environ.pop("RAY_AUTH_TOKEN_PATH", None)

# Ray starts its workers at niceness 15 (its worker_niceness config). Beside the local cluster that
# starves them: the kubelet puts every pod in one cgroup (cpu.shares 2048 for the node's 2 CPUs), so
# the real node's Ray workers, at 15 too, share the weight of two busy processes, while these, in
# the root cgroup, weigh 36 each against its processes' 1024 (a killed-worker run took 544 s in the
# clean-clone run of 2026-12-03 that takes 101 s alone). At 0, as the processes they wait for run.
os.environ.setdefault("RAY_worker_niceness", "0")

# One JAX persistent compilation cache for this pytest process and every Ray worker it starts
# (they inherit the environment): a JaxTrainer worker group restarted after a killed rank loads
# the step it compiled before instead of compiling it again (4 s alone; a minute on the 2 cores
# beside the cluster lanes). JAX reads the variable when it is imported.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="tpuft-jax-cache-")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)


@pytest.fixture(scope="session")
def ray_auth_env() -> dict[str, str]:
    """RAY_AUTH_MODE and RAY_AUTH_TOKEN as this session's Ray has them."""
    return dict(RAY_AUTH_ENV)


@dataclass
class StatusRecorder:
    """Every status merge patch the workload sent, in order: (namespace, name, status)."""
    patches: list[tuple[str, str, dict]] = field(default_factory=list)

    def take(self, key: str = "training") -> list[dict]:
        """status[key] of each patch that has it, oldest first; forgets every patch recorded so far."""
        out = [status[key] for _, _, status in self.patches if key in status]
        self.patches.clear()
        return out


@pytest.fixture(scope="session")
def status_recorder(tmp_path_factory):
    """A loopback HTTP server standing in for the API server's status subresource (what
    tpuft_workload.report patches), with KUBECONFIG pointing at it for the whole session: set before
    Ray starts, because Ray's workers inherit the environment of the process that starts Ray. The
    real API server keeping every key the workload writes: tests/integration/test_status_roundtrip.py."""
    recorder = StatusRecorder()

    class Handler(QuietHandler):
        def do_PATCH(self):  # noqa: N802 - http.server's name
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            parts = self.path.strip("/").split("/")   # apis/<group>/<version>/namespaces/<ns>/<plural>/<name>/status
            recorder.patches.append((parts[4], parts[6], body["status"]))
            self.answer(200, b"{}")

    with serving(Handler) as port:
        kubeconfig = tmp_path_factory.mktemp("kube") / "config"
        kubeconfig.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "rec",
            "clusters": [{"name": "rec", "cluster": {"server": f"http://127.0.0.1:{port}"}}],
            "users": [{"name": "rec", "user": {"token": "t"}}],
            "contexts": [{"name": "rec", "context": {"cluster": "rec", "user": "rec"}}]}))
        mp = pytest.MonkeyPatch()
        mp.setenv("KUBECONFIG", str(kubeconfig))
        mp.delenv("KUBERNETES_SERVICE_HOST", raising=False)
        try:
            yield recorder
        finally:
            mp.undo()


RAY_INIT_TRIES = 3


def _init(ray):
    """ray.init, again (up to RAY_INIT_TRIES in all) if the raylet missed Ray's fixed 30 s
    registration window: seen on 2 cores running the cluster lanes beside this tier, twice in a row
    once (a clean-clone run of 2026-12-03, this tier niced 10)."""
    for attempt in range(1, RAY_INIT_TRIES + 1):
        try:
            return ray.init(num_cpus=4, include_dashboard=False, log_to_driver=True)
        except Exception as e:  # noqa: BLE001 - Ray raises a bare Exception for this
            if "timed out during startup" not in str(e) or attempt == RAY_INIT_TRIES:
                raise
            print(f"ray.init (try {attempt} of {RAY_INIT_TRIES}): {e}; starting Ray again", flush=True)
            ray.shutdown()


@pytest.fixture(scope="session")
def ray_cluster(status_recorder):
    """Start a local Ray (4 logical CPUs: 2 workers + the Train controller fit on 2 cores), its
    workers reporting status to `status_recorder`."""
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
    from ray._private.authentication.authentication_utils import is_token_auth_enabled

    if not is_token_auth_enabled():
        lock.close()
        pytest.fail("something imported ray before tests/workload/conftest.py set RAY_AUTH_MODE=token (Ray "
                    "reads it once, at import), so it runs without token auth: import ray after this conftest "
                    "(in test modules or fixtures), not from a root conftest or plugin")
    env = pytest.MonkeyPatch()
    # Ray Train's controller polls workers every 2 s and a report() waits for that poll; a
    # shorter interval keeps the many small reports of these tests from dominating their time.
    env.setenv("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", os.environ.get("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5"))
    try:
        yield _init(ray).address_info["gcs_address"]
    finally:
        ray.shutdown()
        env.undo()
        fcntl.flock(lock, fcntl.LOCK_UN)
        lock.close()


@pytest.fixture(scope="module")
def world_of_one(tmp_path_factory):
    """This process as a torch.distributed world of 1 over gloo (no Ray) and its 1-device CPU mesh:
    FSDP2, DCP and the export as a training worker runs them (tests/workload/test_model.py, test_lora.py)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    rendezvous = file_rendezvous(tmp_path_factory.mktemp("world-of-one"))
    dist.init_process_group("gloo", init_method=rendezvous, rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,))
    dist.destroy_process_group()


NS = "ns"


@dataclass
class TrainRun:
    """One tiny run through the RayJob's CLI path (`run_training`, what `python -m tpuft_workload
    train` calls)."""
    rc: int
    body: dict                     # its TPUFT_TRAIN_RESULT line
    storage: Path
    run_dir: Path
    patches: list[dict]            # the status.training patches it sent, oldest first
    objects: set[tuple[str, str]]  # the (namespace, name) of every status patch it sent

    def assert_resumed_after_kill(self, kill_step: int) -> None:
        """Rank 1 killed hard before `kill_step`: the fault fired, and the restarted attempt resumed
        from the newest checkpoint (interval or epoch end), at most one interval lost, and said so."""
        assert (self.run_dir / f".tpuft-fault-kill-r1-s{kill_step}").exists()   # the fault did fire
        done_before_kill = kill_step - 1
        saved = [k for k in range(1, done_before_kill + 1) if k % TINY_CKPT_EVERY == 0 or k % TINY_STEPS_PER_EPOCH == 0]
        resumed = self.body["resumedFromStep"]   # the restarted attempt's
        assert resumed == max(saved), self.body
        assert done_before_kill - resumed < TINY_CKPT_EVERY   # at most one interval lost
        source = self.run_dir / f"checkpoint_step_{resumed:07d}"
        assert any(p.get("resumedFromStep") == resumed and p.get("resumedFrom") == str(source)
                   and p.get("message", "").startswith(f"resumed at step {resumed} of ") for p in self.patches)


@pytest.fixture(scope="session")
def tiny_train(status_recorder, ray_cluster):
    """`run(framework, storage, run_name, name, fault="", **flags) -> TrainRun`: the tiny run of
    `framework` for the object NS/`name` (the driver's TPUFT_NAMESPACE/TPUFT_NAME), faults as the
    driver's TPUFT_FAULT, `flags` as tests.factories.tiny_train_argv's."""
    from tpuft_workload import __main__ as cli
    from tpuft_workload import train

    def run(framework: str, storage: Path, run_name: str, name: str, fault: str = "", **flags) -> TrainRun:
        command, target = cli.parse_args(tiny_train_argv(framework, storage, run_name, **flags))
        if framework == "jax":
            from tpuft_workload import jax_train as trainer
        else:
            trainer = train
        status_recorder.take()
        out = io.StringIO()
        with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(out):
            mp.setenv("TPUFT_NAMESPACE", NS)
            mp.setenv("TPUFT_NAME", name)
            rc = trainer.run_training(command, target, fault)
        line = [ln for ln in out.getvalue().splitlines() if ln.startswith(train.RESULT_PREFIX)][-1]
        objects = {(ns, n) for ns, n, _ in status_recorder.patches}
        return TrainRun(rc, json.loads(line[len(train.RESULT_PREFIX):]), storage, storage / run_name,
                        status_recorder.take(), objects)
    return run


@pytest.fixture(scope="module")
def killed_run(request, tiny_train, tmp_path_factory) -> TrainRun:
    """The requesting module's tiny run (its FRAMEWORK, as object NS/its NAME, run name
    NS-NAME-uid-a) with rank 1 killed hard before step its KILL_STEP (and its MORE_FAULTS, if any), its
    FLAGS (tiny_train_argv's), if any: Ray Train's FailureConfig restarts the group once, from the
    newest committed checkpoint."""
    mod = request.module
    fault = ",".join(f for f in (f"kill-rank:1:step:{mod.KILL_STEP}", getattr(mod, "MORE_FAULTS", "")) if f)
    storage = tmp_path_factory.mktemp("storage")
    return tiny_train(mod.FRAMEWORK, storage, f"{NS}-{mod.NAME}-uid-a", mod.NAME, fault, **getattr(mod, "FLAGS", {}))
