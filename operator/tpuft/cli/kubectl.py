"""The user's own kubectl, as the laptop commands (`tpuft chat`, `tpuft logs`) use it: a GET that
tells not-found from forbidden, and a local port forwarded to a Service for as long as a block
runs. Their rights are the user's: nothing here reads a kubeconfig or a token itself."""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import time
from contextlib import contextmanager
from typing import Iterator

FORWARD_WAIT_SECONDS = 30
FORWARDING = re.compile(r"Forwarding from 127\.0\.0\.1:(\d+) ->")


# The laptop's kubectl, for every `tpuft` command that runs one (the local cluster's `tpuft cluster
# env` exports it): read here only.
KUBECTL_ENV = "TPUFT_KUBECTL"


def add_argument(parser: argparse.ArgumentParser) -> None:
    """`--kubectl BIN` (default: $TPUFT_KUBECTL, else kubectl on PATH)."""
    parser.add_argument("--kubectl", default=os.environ.get(KUBECTL_ENV) or "kubectl",
                        help=f"kubectl binary (default: ${KUBECTL_ENV}, else kubectl on PATH; KUBECONFIG as set)")


class KubectlError(RuntimeError):
    """kubectl could not do it: the message says what, why and what to do."""


class Forbidden(KubectlError):
    """The user's kubectl identity may not read the object."""


# What kubectl says, once per API group it tries, when no cluster is configured (no KUBECONFIG, no
# ~/.kube/config): it falls back to http://localhost:8080.
NO_CLUSTER_SIGNS = ("localhost:8080", "127.0.0.1:8080")
NO_CLUSTER = ("kubectl has no cluster configured (no KUBECONFIG, no ~/.kube/config, so it tried localhost:8080): for "
              "the local cluster run eval \"$(tpuft cluster env)\"; for another, set KUBECONFIG to its kubeconfig "
              "(or select a context: kubectl config use-context NAME)")


def unconfigured(err: str) -> bool:
    """Whether kubectl's stderr says it has no cluster to talk to (rather than what a cluster said)."""
    return any(sign in err for sign in NO_CLUSTER_SIGNS) and ("refused" in err or "connect" in err)


def missing(kubectl: str) -> str | None:
    """What to do when `kubectl` is not there; None when it is."""
    if shutil.which(kubectl) is None:
        return f"{kubectl} not found: put kubectl on PATH (local cluster: eval \"$(tpuft cluster env)\")"
    return None


def get(kubectl: str, resource: str, name: str, namespace: str, what: str | None = None) -> dict | None:
    """`kubectl get RESOURCE NAME -n NAMESPACE -o json`: the object, or None when it does not exist.
    Forbidden (naming the check to run) or KubectlError for anything else. `what` names the object
    in messages (default: RESOURCE NAMESPACE/NAME)."""
    if (why := missing(kubectl)) is not None:
        raise KubectlError(why)
    what = what or f"{resource} {namespace}/{name}"
    got = subprocess.run([kubectl, "get", resource, name, "-n", namespace, "-o", "json"],
                         capture_output=True, text=True, timeout=60)
    if got.returncode == 0:
        return json.loads(got.stdout)
    err = got.stderr.strip()
    if "(NotFound)" in err:
        return None
    if unconfigured(err):
        raise KubectlError(NO_CLUSTER)
    if "(Forbidden)" in err:
        raise Forbidden(f"your kubectl user is not allowed to get {what}; ask for `get` on {resource} in namespace "
                        f"{namespace} (check: kubectl auth can-i get {resource}/{name} -n {namespace})")
    raise KubectlError(f"cannot read {what}: {err or f'kubectl exited {got.returncode}'}")


@contextmanager
def port_forward(kubectl: str, namespace: str, service: str, port: int) -> Iterator[int]:
    """A local port forwarded to service:port, for as long as the block runs."""
    if (why := missing(kubectl)) is not None:
        raise KubectlError(why)
    proc = subprocess.Popen([kubectl, "port-forward", "-n", namespace, f"svc/{service}", f":{port}"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        yield _forwarded_port(proc, service)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


def _forwarded_port(proc: subprocess.Popen, service: str) -> int:
    assert proc.stdout is not None and proc.stderr is not None  # port_forward's pipes
    deadline = time.monotonic() + FORWARD_WAIT_SECONDS
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if match := FORWARDING.search(line or ""):
            return int(match.group(1))
        if not line and proc.poll() is not None:
            err = proc.stderr.read().strip()
            raise KubectlError(NO_CLUSTER if unconfigured(err) else f"kubectl port-forward to svc/{service} exited: {err}")
    raise KubectlError(f"kubectl port-forward to svc/{service} did not start within {FORWARD_WAIT_SECONDS}s")
