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

# Everything a run makes hangs off these (owner references): deleting them deletes the rest.
KINDS = "tpufinetunes.tpufinetune.dev,rayservices.ray.io,rayjobs.ray.io,rayclusters.ray.io"
RAY_PODS = "ray.io/node-type"
# past the training pods' terminationGracePeriodSeconds (300 s: their preStop hook may wait for a
# stop checkpoint), as tests/cluster_fixtures.clear_namespace waits
WAIT_S = 420


def leftovers(kubectl) -> list[str]:
    """`namespace/kind/name` of every run object on the cluster."""
    res = kubectl("get", KINDS, "-A", "--ignore-not-found", "-o",
                  "jsonpath={range .items[*]}{.metadata.namespace}/{.kind}/{.metadata.name}{'\\n'}{end}", check=True)
    return [line for line in res.stdout.splitlines() if line.strip()]


def ray_pods(kubectl) -> list[str]:
    res = kubectl("get", "pods", "-A", "-l", RAY_PODS, "-o", "name", check=True)
    return [line for line in res.stdout.splitlines() if line.strip()]


def clear(kubectl, say=print, wait_s: float = WAIT_S) -> bool:
    """Delete every run object and wait (bounded) for KubeRay's pods to go. True once none are left."""
    found = leftovers(kubectl)
    for item in found:
        say(f"deleting {item} (left by an earlier session)")
    if found:
        kubectl("delete", KINDS, "--all", "-A", "--wait=false", "--ignore-not-found", check=True)
    start = time.monotonic()
    while pods := ray_pods(kubectl):
        if time.monotonic() - start > wait_s:
            say(f"still there after {wait_s:.0f} s: {', '.join(pods)}")
            return False
        time.sleep(2)
    say(f"no runs left on the local cluster ({len(found)} deleted, {time.monotonic() - start:.0f} s)")
    return True


def main() -> int:
    from tpuft_local.cluster import LocalCluster

    cluster = LocalCluster()
    return 0 if clear(lambda *a, **kw: cluster.cp.kubectl(*a, **kw)) else 1


if __name__ == "__main__":
    sys.exit(main())
