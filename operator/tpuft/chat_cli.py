"""`tpuft chat NAME "message"`: one chat completion from a served TPUFinetune, from a laptop.

It reads the object's status.serving (kubectl get), forwards a local port to the Serve Service
(kubectl port-forward, a process this command starts and stops), sends one request with
tpuft.chat and prints the answer. Exit 1 when the object is not serving, with its phase and why.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from contextlib import contextmanager
from typing import Iterator

from tpuft import chat as chatlib
from tpuft import constants as c
from tpuft.observed import serving_ready

FORWARD_WAIT_SECONDS = 30
FORWARDING = re.compile(r"Forwarding from 127\.0\.0\.1:(\d+) ->")


class NotServing(RuntimeError):
    """The object is not (yet) serving: the message says its phase and what it is waiting for."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", help="the TPUFinetune (its status.serving says where it is served)")
    p.add_argument("message", help="the user message")
    p.add_argument("--namespace", "-n", default="default")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--kubectl", default=os.environ.get("TPUFT_KUBECTL") or "kubectl",
                   help="kubectl binary (default: kubectl on PATH; KUBECONFIG as set)")


def endpoint(obj: dict) -> dict:
    """status.serving of an object whose model is ready to answer; NotServing otherwise."""
    st = obj.get("status") or {}
    serving = st.get("serving") or {}
    meta = obj.get("metadata") or {}
    if not serving_ready(st) or not serving.get("service"):
        raise NotServing(f"{meta.get('namespace')}/{meta.get('name')} is not serving yet (phase "
                         f"{st.get('phase') or '-'}: {st.get('message') or 'no status'})"
                         + ("" if (obj.get("spec") or {}).get("serve", {}).get("enabled") else
                            "; set spec.serve.enabled: true to serve it after training"))
    return serving


@contextmanager
def port_forward(kubectl: str, namespace: str, service: str, port: int) -> Iterator[int]:
    """A local port forwarded to service:port, for as long as the block runs."""
    if shutil.which(kubectl) is None:
        raise NotServing(f"{kubectl} not found: put kubectl on PATH (local cluster: eval \"$(tpuft cluster env)\")")
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
    deadline = time.monotonic() + FORWARD_WAIT_SECONDS
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if match := FORWARDING.search(line or ""):
            return int(match.group(1))
        if not line and proc.poll() is not None:
            raise NotServing(f"kubectl port-forward to svc/{service} exited: {proc.stderr.read().strip()}")
    raise NotServing(f"kubectl port-forward to svc/{service} did not start within {FORWARD_WAIT_SECONDS}s")


def ask(kubectl: str, namespace: str, name: str, message: str, max_tokens: int = 64,
        temperature: float = 0.0) -> tuple[str, str]:
    """(model id, answer) from the served object."""
    got = subprocess.run([kubectl, "get", c.PLURAL, name, "-n", namespace, "-o", "json"],
                         capture_output=True, text=True, timeout=60)
    if got.returncode != 0:
        raise NotServing(f"cannot read {c.KIND} {namespace}/{name}: {got.stderr.strip()}")
    serving = endpoint(json.loads(got.stdout))
    with port_forward(kubectl, namespace, serving["service"], int(serving.get("port") or c.SERVE_PORT)) as local:
        answer = chatlib.chat(f"http://127.0.0.1:{local}", serving["model"], message, max_tokens=max_tokens,
                              temperature=temperature)
    return serving["model"], answer


def run(args: argparse.Namespace) -> int:
    try:
        _, answer = ask(args.kubectl, args.namespace, args.name, args.message, args.max_tokens, args.temperature)
    except (NotServing, chatlib.ChatError, subprocess.TimeoutExpired) as e:
        print(f"tpuft chat: {e}", file=sys.stderr)
        return 1
    print(answer)
    return 0
