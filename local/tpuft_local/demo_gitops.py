"""`tpuft demo --gitops`: the demo's object goes through Argo CD instead of `kubectl apply`.

The manifest is committed to the local cluster's git repository (`tpuft cluster up --argocd`:
tpuft_local.argocd) under demo/<namespace>/<name>/, and an Application `demo-<namespace>-<name>`
(automated sync, prune, server-side apply) syncs that folder into the namespace. What is not the
object's own (the namespace, the API key Secret, the checkpoint claim) the demo makes directly, as
a platform team would outside the object's git folder: a Secret never belongs in git. While the
run goes, Argo CD's own view of the Application (sync and health) is printed whenever it changes.
"""
from __future__ import annotations

import contextlib
import time
from datetime import datetime

import yaml

from tpuft.api import constants as c
from tpuft.controller.observed import parse_time
from tpuft_local import argocd
from tpuft_local.demo_objects import delete_previous

APPS = ("argoproj.io", "v1alpha1", argocd.NAMESPACE, "applications")
SYNC_WAIT_S = 180     # the commit to the object existing: Argo CD polls git every 15 s here
SETTLE_WAIT_S = 90    # after the run's end, for Argo CD's health to catch up with the phase


class GitopsError(RuntimeError):
    """A GitOps step failed; the message says which and what Argo CD reported."""


def app_name(namespace: str, name: str) -> str:
    return f"demo-{namespace}-{name}"


def folder(namespace: str, name: str) -> str:
    return f"demo/{namespace}/{name}"


def apply(custom, cluster, manifest: dict, namespace: str, say) -> tuple[str, datetime, "ArgoView"]:
    """Commit `manifest` (already prepared for `namespace`) and let Argo CD create it; returns its
    name, its creation time and the view of its Application (to go on watching). An earlier demo's
    Application and object of the same name are deleted first (the demo starts a run afresh)."""
    from kubernetes.client.rest import ApiException

    name = manifest["metadata"]["name"]
    repo, url = cluster.ensure_argocd()
    app = argocd.application(app_name(namespace, name), url, folder(namespace, name), namespace)
    with contextlib.suppress(ApiException):   # no earlier Application: nothing to delete
        custom.delete_namespaced_custom_object(*APPS, app["metadata"]["name"])
    delete_previous(custom, namespace, name, say)   # after its Application: Argo CD would put it back
    revision = argocd.publish(repo, {f"{folder(namespace, name)}/{name}.yaml": yaml.safe_dump(manifest, sort_keys=False)},
                              f"tpuft demo: {namespace}/{name}")
    custom.create_namespaced_custom_object(*APPS, app)
    say(f"committed {revision[:12]} ({folder(namespace, name)}/{name}.yaml) to {url}; "
        f"Application {argocd.NAMESPACE}/{app['metadata']['name']} syncs it")
    view = ArgoView(custom, app["metadata"]["name"], say)
    end = time.monotonic() + SYNC_WAIT_S
    while time.monotonic() < end:
        view.poll()
        try:
            obj = custom.get_namespaced_custom_object(c.GROUP, c.VERSION, namespace, c.PLURAL, name)
            return name, parse_time(obj["metadata"]["creationTimestamp"]), view
        except ApiException as e:
            if e.status != 404:
                raise GitopsError(f"cannot read {namespace}/{name}: {e.reason}") from None
        time.sleep(1)
    last = view.last or {}
    raise GitopsError(f"Argo CD did not create {namespace}/{name} within {SYNC_WAIT_S}s: sync {last.get('sync')}, "
                      f"operation {last.get('operation')}: {last.get('operationMessage') or last.get('conditions')}; "
                      f"kubectl get application {app['metadata']['name']} -n {argocd.NAMESPACE} -o yaml")


class ArgoView:
    """Argo CD's sync and health of one Application, printed when they change; `history` keeps
    each (sync, health) seen, for the result file."""

    def __init__(self, custom, name: str, say) -> None:
        self.custom, self.name, self.say = custom, name, say
        self.history: list[tuple[str | None, str | None]] = []
        self.last: dict | None = None

    def poll(self) -> dict | None:
        from kubernetes.client.rest import ApiException
        try:
            self.last = argocd.summary(self.custom.get_namespaced_custom_object(*APPS, self.name))
        except ApiException:
            return None
        seen = (self.last["sync"], self.last["health"])
        if seen[0] and (not self.history or seen != self.history[-1]):
            self.history.append(seen)
            why = self.last["operationMessage"] if seen[0] == "OutOfSync" or seen[1] == "Degraded" else ""
            self.say(f"  Argo CD: {seen[0]}, {seen[1]}{' (' + why + ')' if why else ''}")
        return self.last

    def settle(self, expect: str) -> dict | None:
        """Poll until Argo CD's health is `expect` (the phase's health), at most SETTLE_WAIT_S."""
        end = time.monotonic() + SETTLE_WAIT_S
        while time.monotonic() < end:
            last = self.poll()
            if last and last["sync"] == "Synced" and last["health"] == expect:
                return last
            time.sleep(1)
        return self.last
