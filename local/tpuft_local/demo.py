"""`tpuft demo`: the whole system on one machine, no cloud and no TPU.

1. a real local control plane (etcd + kube-apiserver + kube-controller-manager), or the
   cluster in $KUBECONFIG with --use-kubeconfig;
2. our CRD and KubeRay's CRDs;
3. the operator, started exactly as the image starts it (`kopf run -m tpuft.handlers`);
4. the LOCAL STAND-IN for KubeRay's pod layer (tpuft_local.standin), which runs a real local Ray;
5. `examples/local-cpu.yaml`, streamed phase by phase until Succeeded or Failed.

Every step says what it is doing; a failing step says which and what to do.
"""
from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import yaml

from tpuft import constants as c
from tpuft_local.controlplane import free_port

REPO = Path(__file__).resolve().parents[2]
DEFAULT_EXAMPLE = REPO / "examples" / "local-cpu.yaml"
RAY_LOCK = Path(os.environ.get("TPUFT_RAY_LOCK", "/tmp/tpuft-ray.lock"))  # one local Ray per machine
STEPS = 5


class DemoError(RuntimeError):
    """A step failed: the message names the step and what to do."""


class Clock:
    def __init__(self) -> None:
        self.t0 = time.monotonic()

    def stamp(self) -> str:
        return f"[{time.monotonic() - self.t0:6.1f}s]"


def add_demo_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--example", type=Path, default=DEFAULT_EXAMPLE, help="TPUFinetune manifest to run")
    p.add_argument("--namespace", default="tpuft-demo", help="namespace to run it in (created if missing)")
    p.add_argument("--use-kubeconfig", action="store_true",
                   help="use the cluster in $KUBECONFIG instead of starting a local control plane")
    p.add_argument("--down", action="store_true", help="stop the local control plane at the end")
    p.add_argument("--timeout", type=float, default=1200, help="seconds to wait for a terminal phase")
    p.add_argument("--storage-path", default=None, help="override spec.checkpoint.storagePath")
    p.add_argument("--provisioning-timeout", type=int, default=None,
                   help="override spec.provisioningTimeoutSeconds (see a slice that never comes up fail fast)")
    p.add_argument("--rehearse-tpu", action="store_true",
                   help="let the stand-in run TPU examples in CPU mode on a scaled-down world")
    p.add_argument("--result", type=Path, default=None, help="write the final status and the loss history as JSON")
    p.add_argument("--state-dir", type=Path, default=None,
                   help="demo logs and stand-in state (default: ${TPUFT_HOME:-~/.tpuft}/demo)")


def _step(clock: Clock, n: int, text: str) -> None:
    print(f"{clock.stamp()} [{n}/{STEPS}] {text}", flush=True)


def _wait_http(url: str, timeout: float, proc: subprocess.Popen, what: str, log: Path) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise DemoError(f"{what} exited with code {proc.returncode}; see {log}")
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        time.sleep(0.3)
    raise DemoError(f"{what} did not become healthy at {url} within {timeout:.0f}s; see {log}")


def _spawn(argv: list[str], log: Path, env: dict) -> subprocess.Popen:
    log.parent.mkdir(parents=True, exist_ok=True)
    out = open(log, "w")
    return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def _stop(proc: subprocess.Popen | None, timeout: float = 60) -> None:
    if proc is None or proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


@contextlib.contextmanager
def ray_lock(clock: Clock):
    RAY_LOCK.parent.mkdir(parents=True, exist_ok=True)
    with open(RAY_LOCK, "w") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"{clock.stamp()}       another local Ray user holds {RAY_LOCK}; waiting for it", flush=True)
            fcntl.flock(fh, fcntl.LOCK_EX)
        yield


def _training_line(tr: dict) -> str:
    parts = [f"Epoch {tr.get('epoch', '?')}/{tr.get('epochs', '?')}",
             f"step {tr.get('step', '?')}/{tr.get('totalSteps', '?')}"]
    if tr.get("loss") is not None:
        parts.append(f"loss={tr['loss']:.4f}")
    if tr.get("tokensPerSecond") is not None:
        parts.append(f"tokens/s={tr['tokensPerSecond']:.1f} (real)")
    if tr.get("padFraction") is not None:
        parts.append(f"pad={100 * tr['padFraction']:.1f}%")
    return " | ".join(parts)


def stream(custom, namespace: str, name: str, clock: Clock, timeout: float) -> tuple[dict, list[float]]:
    """Print each phase change, the verification result and training progress; return the final object."""
    from kubernetes.client.rest import ApiException

    seen_phase, seen_verification, seen_training = None, None, None
    epoch_losses: dict[int, float] = {}
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            obj = custom.get_namespaced_custom_object(c.GROUP, c.VERSION, namespace, c.PLURAL, name)
        except ApiException as e:
            raise DemoError(f"cannot read {c.KIND} {namespace}/{name}: {e.reason}") from None
        st = obj.get("status") or {}
        phase = st.get("phase")
        if phase and phase != seen_phase:
            detail = st.get("message") or st.get("reason") or ""
            print(f"{clock.stamp()} phase {phase}{': ' + detail if detail else ''}", flush=True)
            seen_phase = phase
        ver = st.get("verification")
        if ver and ver != seen_verification:
            print(f"{clock.stamp()}   verification: {'passed' if ver.get('passed') else 'FAILED'} | "
                  f"ranks={ver.get('ranks')} | all_reduce_sum={ver.get('allReduceSum')} "
                  f"(expected {ver.get('expectedSum')}) | max|TP-ref|={ver.get('maxAbsDiff')} | "
                  f"{ver.get('seconds', 0):.1f}s", flush=True)
            seen_verification = ver
        tr = st.get("training")
        if tr and (tr.get("step"), tr.get("epoch")) != seen_training:
            print(f"{clock.stamp()}   {_training_line(tr)}", flush=True)
            seen_training = (tr.get("step"), tr.get("epoch"))
            if tr.get("epoch") is not None and tr.get("loss") is not None:
                epoch_losses[int(tr["epoch"])] = float(tr["loss"])
        if phase in (c.Phase.SUCCEEDED.value, c.Phase.FAILED.value):
            return obj, [epoch_losses[k] for k in sorted(epoch_losses)]
        time.sleep(0.5)
    raise DemoError(f"{namespace}/{name} did not finish within {timeout:.0f}s (last phase: {seen_phase}); "
                    "raise --timeout or look at the logs printed below")


def _apply(api_client, manifest: dict, namespace: str, clock: Clock) -> str:
    from kubernetes import client
    from kubernetes.client.rest import ApiException

    core, custom = client.CoreV1Api(api_client), client.CustomObjectsApi(api_client)
    with contextlib.suppress(ApiException):
        core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=namespace)))
    name = manifest["metadata"]["name"]
    manifest["metadata"]["namespace"] = namespace
    try:
        custom.delete_namespaced_custom_object(c.GROUP, c.VERSION, namespace, c.PLURAL, name)
        print(f"{clock.stamp()}       deleted the previous {namespace}/{name}; waiting for it to go", flush=True)
        end = time.monotonic() + 60
        while time.monotonic() < end:
            custom.get_namespaced_custom_object(c.GROUP, c.VERSION, namespace, c.PLURAL, name)
            time.sleep(0.5)
    except ApiException as e:
        if e.status != 404:
            raise DemoError(f"cannot replace {namespace}/{name}: {e.reason}") from None
    try:
        custom.create_namespaced_custom_object(c.GROUP, c.VERSION, namespace, c.PLURAL, manifest)
    except ApiException as e:
        body = json.loads(e.body).get("message", e.body) if e.body else e.reason
        raise DemoError(f"the API server rejected {namespace}/{name}: {body}") from None
    return name


def run_demo(args: argparse.Namespace) -> int:
    clock = Clock()
    state = args.state_dir or Path(os.environ.get("TPUFT_HOME") or Path.home() / ".tpuft") / "demo"
    state = state.resolve()
    state.mkdir(parents=True, exist_ok=True)
    operator = standin = cp = None
    code = 1
    try:
        manifest = yaml.safe_load(args.example.read_text())
        if args.storage_path:
            manifest["spec"].setdefault("checkpoint", {})["storagePath"] = args.storage_path
        if args.provisioning_timeout is not None:
            manifest["spec"]["provisioningTimeoutSeconds"] = args.provisioning_timeout
        if args.use_kubeconfig:
            kubeconfig = os.environ.get("KUBECONFIG") or str(Path.home() / ".kube" / "config")
            _step(clock, 1, f"using the cluster in {kubeconfig}")
            env = dict(os.environ, KUBECONFIG=kubeconfig)
            from tpuft_local.toolchain import tool_path

            _step(clock, 2, "installing the TPUFinetune CRD (KubeRay's must already be installed there)")
            subprocess.run([tool_path("kubectl"), "apply", "--server-side", "-f", str(REPO / "crds")],
                           check=True, env=env, capture_output=True)
        else:
            from tpuft_local.controlplane import ControlPlane, default_crd_paths, default_state_dir

            cp = ControlPlane(default_state_dir())
            _step(clock, 1, f"local control plane (etcd + kube-apiserver + kube-controller-manager) in {cp.state_dir}")
            if not cp.ready():
                cp.start()
            kubeconfig = str(cp.kubeconfig)
            env = dict(os.environ, KUBECONFIG=kubeconfig)
            _step(clock, 2, "installing CRDs: tpufinetunes.tpufinetune.dev, rayclusters.ray.io, rayjobs.ray.io")
            cp.install_crds(default_crd_paths())
        env.update(RAY_AUTH_MODE="disabled", TPUFT_METRICS_PORT=env.get("TPUFT_METRICS_PORT", "0"))

        _step(clock, 3, f"operator: kopf run -m tpuft.handlers --namespace={args.namespace} (log: {state}/operator.log)")
        liveness_port = free_port()
        operator = _spawn([sys.executable, "-m", "kopf", "run", "--standalone", "-m", "tpuft.handlers",
                           f"--namespace={args.namespace}", f"--liveness=http://127.0.0.1:{liveness_port}/healthz"],
                          state / "operator.log", env)
        _wait_http(f"http://127.0.0.1:{liveness_port}/healthz", 90, operator, "the operator", state / "operator.log")

        with ray_lock(clock):
            _step(clock, 4, f"LOCAL STAND-IN for KubeRay's pod layer, running a real local Ray "
                            f"(log: {state}/standin.log)")
            standin = _spawn([sys.executable, "-m", "tpuft_local.standin", f"--namespace={args.namespace}",
                              f"--state-dir={state / 'standin'}", *(["--rehearse-tpu"] if args.rehearse_tpu else [])],
                             state / "standin.log", env)
            try:
                from kubernetes import client, config

                api_client = config.new_client_from_config(config_file=kubeconfig)
                _step(clock, 5, f"kubectl apply -f {args.example} (namespace {args.namespace})")
                name = _apply(api_client, manifest, args.namespace, clock)
                final, losses = stream(client.CustomObjectsApi(api_client), args.namespace, name, clock,
                                       args.timeout)
            finally:
                _stop(standin, timeout=90)  # inside the lock: the stand-in stops the Ray it started
        code = _summary(final, losses, clock, state, args)
        if args.result:
            args.result.parent.mkdir(parents=True, exist_ok=True)
            args.result.write_text(json.dumps({"object": final, "epochLosses": losses}, indent=2, default=str))
        return code
    except DemoError as e:
        print(f"{clock.stamp()} demo failed: {e}", file=sys.stderr, flush=True)
        for log in ("operator.log", "standin.log"):
            print(f"  {state / log}", file=sys.stderr)
        return 1
    finally:
        _stop(standin, timeout=90)
        _stop(operator)
        if cp is not None:
            if args.down:
                cp.stop()
                print(f"{clock.stamp()} control plane stopped", flush=True)
            else:
                print(f"The control plane is still up:\n"
                      f'  kubectl --kubeconfig "$(tpuft cluster kubeconfig)" get tft -n {args.namespace} -o wide\n'
                      f"  tpuft cluster down      # stop it", flush=True)
        print(f"total {time.monotonic() - clock.t0:.1f}s", flush=True)


def _summary(obj: dict, losses: list[float], clock: Clock, state: Path, args) -> int:
    st = obj.get("status") or {}
    conds = {x["type"]: x["status"] for x in st.get("conditions", [])}
    if st.get("phase") == c.Phase.SUCCEEDED.value:
        tr = st.get("training") or {}
        print(f"{clock.stamp()} Succeeded: conditions {', '.join(f'{k}={v}' for k, v in conds.items())}")
        if losses:
            print(f"  loss per epoch: {' -> '.join(f'{x:.4f}' for x in losses)}")
        print(f"  last checkpoint: {tr.get('lastCheckpoint')}\n  exported model:  {tr.get('exportedModel')}",
              flush=True)
        return 0
    print(f"{clock.stamp()} Failed: {st.get('reason')}: {st.get('message')}", file=sys.stderr)
    print(f"  logs: {state / 'operator.log'}, {state / 'standin.log'}, {state / 'standin' / 'jobs'}",
          file=sys.stderr, flush=True)
    return 1



add_arguments, run = add_demo_arguments, run_demo
