"""GitOps for real: Argo CD's own application controller and repo server (hack/argocd, `tpuft cluster
up --argocd`) sync TPUFinetunes from a git repository on this machine and judge them with our health
check from argocd-cm. Every sync and health below is Argo CD's (the Application's status), not ours.

One Application, one folder of the repo, simulated v6e slices (nothing trains: a slice stays
Provisioning/VerifyingCollectives), through what a GitOps user meets:
1. a commit with two objects: `slice` (fits a pool) syncs and is Progressing; `too-big` (a shape
   no pool offers, a short provisioning deadline) fails and Argo CD calls it, and the app, Degraded
   with the operator's reason; the app stays Synced while the operator writes status (no drift);
2. `suspend: true` committed: the operator suspends the slice and Argo CD says Suspended;
3. a commit holding two bad objects (a topology v6e has not, a field the CRD has not): the sync
   fails with the API server's field messages, neither exists, `slice` is untouched; the fix pushed
   next is what Argo CD's retry applies;
4. `slice`'s file deleted: prune deletes it and, through owner references, its RayCluster.
Healthy (a Serving object, Argo CD's evaluation) is tests/cluster/test_demo.py's served base for
adapters, which the demo test syncs through Argo CD.
"""
from __future__ import annotations

import json

import pytest
import yaml

from tests.paths import EXAMPLES
from tests.waiting import wait_until
from tpuft.api import constants as c
from tpuft_local import argocd

APP = "gitops"


def _slice(name: str, **spec) -> dict:
    doc = yaml.safe_load((EXAMPLES / "v6e-4x4.yaml").read_text())
    doc["metadata"] = {"name": name}
    doc["spec"].pop("hfTokenSecret")
    doc["spec"]["verification"]["timeoutSeconds"] = 900
    doc["spec"].update(spec)
    return doc


@pytest.fixture
def gitops(local_cluster, cluster_kubectl, cluster_ns):
    """An Application syncing apps/<ns>/ of the local repo into `cluster_ns`; deleted afterwards
    (no finalizer: the objects it made go with the namespace)."""
    repo, url = local_cluster.ensure_argocd()
    folder = f"apps/{cluster_ns}"
    app = argocd.application(f"{APP}-{cluster_ns}", url, folder, cluster_ns)

    def publish(files: dict[str, dict | None], message: str) -> None:
        argocd.publish(repo, {f"{folder}/{k}.yaml": (yaml.safe_dump(v) if v is not None else None)
                              for k, v in files.items()}, message)

    def status() -> dict:
        res = cluster_kubectl("get", "application", app["metadata"]["name"], "-n", argocd.NAMESPACE, "-o", "json")
        return argocd.summary(json.loads(res.stdout)) if res.returncode == 0 else {}

    yield publish, status, app
    cluster_kubectl("delete", "application", app["metadata"]["name"], "-n", argocd.NAMESPACE, "--ignore-not-found")


def _resource(st: dict, name: str) -> dict:
    return st.get("resources", {}).get(f"TPUFinetune/{name}", {})


def test_argo_cd_syncs_judges_and_prunes_tpufinetunes_from_git(gitops, cluster_kubectl, cluster_ns):
    publish, status, app = gitops
    publish({"slice": _slice("slice"),
             "too-big": _slice("too-big", topology="4x8", provisioningTimeoutSeconds=20)}, "two runs")
    cluster_kubectl("apply", "-f", "-", input=json.dumps(app), check=True)

    # 1. Synced; the slice Progressing, too-big Degraded with the operator's reason, the app Degraded.
    st = wait_until(lambda: (s := status()).get("sync") == "Synced"
                    and _resource(s, "slice").get("health") == "Progressing"
                    and _resource(s, "too-big").get("health") == "Degraded" and s,
                    timeout=240, interval=2, what="Argo CD to sync and judge both objects")
    assert st["health"] == "Degraded", st
    assert "slice not provisioned after 20s" in _resource(st, "too-big")["message"], st
    # no drift while the operator writes the slice's status (Provisioning, then verification)
    seen = set()

    def verifying() -> bool:
        s = status()
        seen.add(s.get("sync"))
        return _get(cluster_kubectl, cluster_ns, "slice").get("status", {}).get("phase") == "VerifyingCollectives"
    wait_until(verifying, timeout=300, interval=2, what="the slice to reach VerifyingCollectives")
    assert seen == {"Synced"}, seen

    # 2. A spec change from git reaches the operator: suspended, and Argo CD says so.
    publish({"slice": _slice("slice", suspend=True)}, "suspend the slice")
    st = wait_until(lambda: (s := status()).get("sync") == "Synced"
                    and _resource(s, "slice").get("health") == "Suspended" and s,
                    timeout=180, interval=2, what="Argo CD to show the slice Suspended")
    # (the RayCluster is patched once its verify RayJob is gone: phases.py's _suspend)
    wait_until(lambda: (rc := json.loads(cluster_kubectl("get", "raycluster", "-n", cluster_ns, "-l",
                                                         f"{c.LABEL_NAME}=slice", "-o", "json", check=True).stdout
                                         )["items"]) and all(r["spec"].get("suspend") for r in rc),
               timeout=120, interval=2, what="the slice's RayCluster suspended")
    revision = st["revision"]

    # 3. Bad objects in git (a topology v6e has not; a field the CRD has not): the sync fails with
    # the API server's field messages, neither object exists, the slice is untouched.
    generation = _get(cluster_kubectl, cluster_ns, "slice")["metadata"]["generation"]
    publish({"bad": _slice("bad", topology="4x5"), "unknown": _slice("unknown", epochz=3)}, "two bad objects")
    st = wait_until(lambda: (s := status()).get("revision") != revision and "invalid" in (s.get("operationMessage") or "")
                    and s, timeout=180, interval=2, what="Argo CD's sync of the bad commit to fail")
    message = st["operationMessage"]
    assert "spec.topology: Invalid value: topology is not a v6e slice shape GKE offers" in message, message
    assert ".spec.epochz: field not declared in schema" in message, message
    assert st["sync"] == "OutOfSync" and _resource(st, "bad")["health"] == "Missing", st
    for name in ("bad", "unknown"):
        assert cluster_kubectl("get", "tft", name, "-n", cluster_ns).returncode != 0, name
    assert _get(cluster_kubectl, cluster_ns, "slice")["metadata"]["generation"] == generation

    # 4. The fix pushed: the retry syncs the newest commit (retry.refresh).
    publish({"bad": None, "unknown": None}, "drop the bad objects")
    wait_until(lambda: (s := status()).get("sync") == "Synced" and s.get("operation") == "Succeeded"
               and set(s["resources"]) == {"TPUFinetune/slice", "TPUFinetune/too-big"} and s,
               timeout=180, interval=2, what="Argo CD to sync the fix")

    # 5. A file deleted: prune deletes its object, and the object's children go with it. (Not the
    # last file: an automated sync never prunes an Application down to nothing unless allowEmpty.)
    assert cluster_kubectl("get", "raycluster", "-n", cluster_ns, "-l", f"{c.LABEL_NAME}=slice", "-o", "name",
                           check=True).stdout.strip()
    publish({"slice": None}, "remove the slice")
    wait_until(lambda: cluster_kubectl("get", "tft", "slice", "-n", cluster_ns).returncode != 0,
               timeout=180, interval=2, what="Argo CD to prune the slice")
    wait_until(lambda: not cluster_kubectl("get", "raycluster", "-n", cluster_ns, "-l", f"{c.LABEL_NAME}=slice",
                                           "-o", "name", check=True).stdout.strip(),
               timeout=120, interval=2, what="its RayCluster to go (owner references)")
    st = wait_until(lambda: (s := status()).get("sync") == "Synced" and set(s["resources"]) == {"TPUFinetune/too-big"}
                    and s, timeout=120, interval=2, what="the app Synced with the one object left")
    assert st["health"] == "Degraded", st


def _get(kubectl, ns: str, name: str) -> dict:
    return json.loads(kubectl("get", "tft", name, "-n", ns, "-o", "json", check=True).stdout)
