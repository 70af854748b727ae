"""`python -m tests.leftovers`: before the cluster tests, delete the runs an earlier session left
on the local cluster, and wait for their pods to go.

`tpuft cluster down` keeps the cluster's state (its etcd) and `up` brings back what it held: a
demo a developer left serving came back as two Ray pods that ran through a whole `make test`
(a clean-clone run of 2026-12-03: about 300 CPU-seconds of the node's 2 cores, in the lanes
whose deadlines the tests bound). The tests own the local cluster while they run (the last tier
takes it down), so they start from none. Each object deleted is named; exit 1 if the pods stay.
"""
from __future__ import annotations

import sys
import time

from tests.cluster_fixtures import PODS_GONE_S, RAY_POD_LABEL, RUN_KINDS
from tests.waiting import wait_until


APPLICATIONS = "applications.argoproj.io"   # Argo CD's (`cluster up --argocd`): each would sync its runs back


def applications(kubectl) -> list[str]:
    """`namespace/name` of every Argo CD Application (none when Argo CD's CRD is not installed)."""
    res = kubectl("get", APPLICATIONS, "-A", "--ignore-not-found", "-o",
                  "jsonpath={range .items[*]}{.metadata.namespace}/{.metadata.name}{'\\n'}{end}")
    return [line for line in res.stdout.splitlines() if line.strip()] if res.returncode == 0 else []


def leftovers(kubectl) -> list[str]:
    """`namespace/kind/name` of every run object on the cluster."""
    res = kubectl("get", RUN_KINDS, "-A", "--ignore-not-found", "-o",
                  "jsonpath={range .items[*]}{.metadata.namespace}/{.kind}/{.metadata.name}{'\\n'}{end}", check=True)
    return [line for line in res.stdout.splitlines() if line.strip()]


def ray_pods(kubectl) -> list[str]:
    res = kubectl("get", "pods", "-A", "-l", RAY_POD_LABEL, "-o", "name", check=True)
    return [line for line in res.stdout.splitlines() if line.strip()]


def clear(kubectl, say=print, wait_s: float = PODS_GONE_S) -> None:
    """Delete every Argo CD Application (first: it would put its runs back; ours carry no finalizer,
    so its objects stay for the next step) and every run object, and wait (bounded: AssertionError
    past `wait_s`) for KubeRay's pods to go."""
    for app in applications(kubectl):
        say(f"deleting Application {app} (left by an earlier session)")
        ns, name = app.split("/", 1)
        kubectl("delete", APPLICATIONS, name, "-n", ns, "--ignore-not-found", check=True)
    found = leftovers(kubectl)
    for item in found:
        say(f"deleting {item} (left by an earlier session)")
    if found:
        kubectl("delete", RUN_KINDS, "--all", "-A", "--wait=false", "--ignore-not-found", check=True)
    start = time.monotonic()
    wait_until(lambda: not ray_pods(kubectl), timeout=wait_s, interval=2, what="KubeRay's pods to go")
    say(f"no runs left on the local cluster ({len(found)} deleted, {time.monotonic() - start:.0f} s)")


def main() -> int:
    from tpuft_local.cluster import LocalCluster

    cluster = LocalCluster()
    kubectl = cluster.cp.kubectl
    try:
        clear(kubectl)
    except AssertionError as e:
        print(f"{e}; still there: {', '.join(ray_pods(kubectl))}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
