"""`tpuft chat NAME "message"`: one chat completion from a served TPUFinetune, from a laptop.

It reads the object's status.serving (kubectl get), forwards a local port to the Serve Service
(kubectl port-forward, a process this command starts and stops), sends one request with
tpuft.cli.chat and prints the answer (with --stream, its text as it is generated). A fine-tune
published to a served base (spec.publish) is asked on that base's endpoint, as model
<base>:<adapter>. Exit 1 when the object is not serving, with its phase and why.
When spec.serve.apiKeySecret is set, the key is read from that Secret with the user's own kubectl
rights and sent as `Authorization: Bearer <key>`; it is never printed.
"""
from __future__ import annotations

import argparse
import base64
import binascii
import json
import subprocess
import sys
from typing import Callable

from tpuft.cli import chat as chatlib
from tpuft.api import constants as c
from tpuft.cli import kubectl
from tpuft.cli.kubectl import NO_CLUSTER, KubectlError, port_forward, unconfigured
from tpuft.controller.observed import serving_ready


class NotServing(RuntimeError):
    """The object is not (yet) serving: the message says its phase and what it is waiting for."""


class NoApiKey(RuntimeError):
    """The served model wants an API key and its Secret cannot be read: the message says why and what to do."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", help="the TPUFinetune (its status.serving says where it is served; a fine-tune "
                                "published to a base is asked on that base)")
    p.add_argument("message", help="the user message")
    p.add_argument("--namespace", "-n", default="default")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--stream", action="store_true",
                   help="print the answer's text as the model generates it (server-sent events)")
    kubectl.add_argument(p)


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


def api_key(kubectl: str, namespace: str, obj: dict) -> str | None:
    """The key in the Secret that spec.serve.apiKeySecret names (read with the user's kubectl rights),
    or None when the object sets none. NoApiKey says which Secret and what to do when it cannot be read."""
    ref = ((obj.get("spec") or {}).get("serve") or {}).get("apiKeySecret")
    if not ref:
        return None
    secret, key = ref.get("name"), ref.get("key") or c.SERVE_API_KEY_SECRET_KEY
    if not secret:
        raise NoApiKey("spec.serve.apiKeySecret has no name: give the Secret that holds the API key")
    where = f"Secret {namespace}/{secret} (spec.serve.apiKeySecret)"
    got = subprocess.run([kubectl, "get", "secret", secret, "-n", namespace, "-o", "json"],
                         capture_output=True, text=True, timeout=60)
    if got.returncode != 0:
        err = got.stderr.strip()
        if unconfigured(err):
            raise NoApiKey(NO_CLUSTER)
        if "(Forbidden)" in err:
            raise NoApiKey(f"cannot read the API key: your kubectl user is not allowed to get {where}; ask "
                           f"for `get` on that secret in namespace {namespace} (check: kubectl auth can-i get "
                           f"secret/{secret} -n {namespace})")
        if "(NotFound)" in err:
            raise NoApiKey(f"cannot read the API key: {where} does not exist; create it (kubectl create secret "
                           f"generic {secret} -n {namespace} --from-literal={key}=...) or fix the name in "
                           "spec.serve.apiKeySecret")
        raise NoApiKey(f"cannot read the API key from {where}: {err}")
    data = json.loads(got.stdout).get("data") or {}
    if key not in data:
        raise NoApiKey(f"{where} has no key {key!r} (spec.serve.apiKeySecret.key); its keys: "
                       f"{', '.join(sorted(data)) or 'none'}")
    try:
        # stripped as the server strips it: HTTP trims header values
        return base64.b64decode(data[key], validate=True).decode("utf-8").strip()
    except (binascii.Error, UnicodeDecodeError):
        raise NoApiKey(f"{where}: the value under {key!r} is not UTF-8 text; store the key as text") from None


def published_to(obj: dict) -> tuple[str, str] | None:
    """(the base, the model id) of a fine-tune whose adapter a served base serves (spec.publish); None
    for any other object. NotServing, with status.serving's reason and message, while it is not."""
    publish = (obj.get("spec") or {}).get("publish")
    if not publish:
        return None
    st = obj.get("status") or {}
    serving, meta = st.get("serving") or {}, obj.get("metadata") or {}
    if serving.get("reason") != c.Reason.PUBLISHED.value or not serving.get("model"):
        why = (f"{serving['reason']}: {serving.get('message') or ''}" if serving.get("reason") else
               f"phase {st.get('phase') or '-'}: {st.get('message') or 'no status'}")
        raise NotServing(f"{meta.get('namespace')}/{meta.get('name')}'s adapter is not served by "
                         f"{publish.get('to')} yet ({why})")
    return publish["to"], serving["model"]


def _get(kubectl: str, namespace: str, name: str) -> dict:
    got = subprocess.run([kubectl, "get", c.PLURAL, name, "-n", namespace, "-o", "json"],
                         capture_output=True, text=True, timeout=60)
    if got.returncode != 0:
        err = got.stderr.strip()
        raise NotServing(NO_CLUSTER if unconfigured(err) else f"cannot read {c.KIND} {namespace}/{name}: {err}")
    return json.loads(got.stdout)


def ask(kubectl: str, namespace: str, name: str, message: str, max_tokens: int = 64,
        temperature: float = 0.0, on_text: Callable[[str], None] | None = None) -> tuple[str, str]:
    """(model id, answer) from the served object (a fine-tune published to a base: from that base,
    under <base>:<adapter>); with on_text, the answer is streamed and each piece of its text is
    passed to on_text as it arrives."""
    obj = _get(kubectl, namespace, name)
    published = published_to(obj)
    server = _get(kubectl, namespace, published[0]) if published else obj
    serving = endpoint(server)
    key = api_key(kubectl, namespace, server)
    with port_forward(kubectl, namespace, serving["service"], int(serving.get("port") or c.SERVE_PORT)) as local:
        url, model = f"http://127.0.0.1:{local}", published[1] if published else serving["model"]
        if on_text is None:
            return model, chatlib.chat(url, model, message, max_tokens=max_tokens, temperature=temperature,
                                       api_key=key)
        parts: list[str] = []
        for text in chatlib.chat_stream(url, model, message, max_tokens=max_tokens, temperature=temperature,
                                        api_key=key):
            on_text(text)
            parts.append(text)
        return model, "".join(parts)


def run(args: argparse.Namespace) -> int:
    printed: list[str] = []

    def show(text: str) -> None:
        printed.append(text)
        sys.stdout.write(text)
        sys.stdout.flush()   # each piece as it arrives, not when a buffer fills
    try:
        _, answer = ask(args.kubectl, args.namespace, args.name, args.message, args.max_tokens, args.temperature,
                        on_text=show if args.stream else None)
    except (NotServing, NoApiKey, KubectlError, chatlib.ChatError, subprocess.TimeoutExpired) as e:
        if printed:
            print()   # end the part of the answer printed before the error
        print(f"tpuft chat: {e}", file=sys.stderr)
        return 1
    print("" if args.stream else answer)   # streamed: the text is out, end its line
    return 0
