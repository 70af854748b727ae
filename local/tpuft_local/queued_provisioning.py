"""LOCAL STAND-IN for GKE's queued provisioning (flex-start, Dynamic Workload Scheduler). NOT GKE;
never deploy it.

On GKE the cluster autoscaler answers a ProvisioningRequest (autoscaling.x-k8s.io/v1, class
`queued-provisioning.gke.io`) by creating a whole flex-start node pool at once when capacity
exists, holding it for the run and taking it back. The cluster autoscaler is not served by the Go
module proxy and GKE's provisioning is not open source, so the local cluster runs this host
process (`python -m tpuft_local.queued_provisioning`) instead. It follows the real API's fields
and conditions (the CRD and condition types come from k8s.io/autoscaler/cluster-autoscaler/apis,
the module Kueue v0.17.0 builds with):

- `Accepted=True` when it first sees a request of its class, `Provisioned=False` (waiting for
  capacity, with a message saying when, or that it never will) until the settable delay passes;
- then the slice's KWOK nodes, in a flex-start node pool per slice with GKE's labels
  (`cloud.google.com/gke-flex-start`, `cloud.google.com/gke-queued`, the TPU accelerator and
  topology, `cloud.google.com/gke-nodepool`) and taints (`google.com/tpu`,
  `cloud.google.com/gke-queued=true:NoSchedule`), and `Provisioned=True`;
- `CapacityRevoked=True` when the booking's `maxRunDurationSeconds` parameter has run out since
  it was provisioned (GKE takes flex-start nodes back then), or when a test asks for it with the
  stand-in's own annotation REVOKE_ANNOTATION; `BookingExpired=True` when no pod consumed the
  capacity within the booking time; either way its nodes go REMOVAL_NOTICE_SECONDS later;
- nodes whose request is gone (Kueue deletes it with its Workload) are deleted.

Settings, read on every pass from the ConfigMap SETTINGS (namespace kube-system), so a test can
change them while it runs: `provisionAfterSeconds` (a number, or `never` to show a request that
waits for capacity) and `bookingSeconds`. The condition messages say they come from this stand-in.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import signal
import sys
import time
from collections.abc import Iterable, Mapping
from datetime import datetime, timezone
from typing import Any

from tpuft.api.catalog import CatalogError, resolve_slice

log = logging.getLogger("tpuft_local.queued_provisioning")

# The real API's words (k8s.io/autoscaler/cluster-autoscaler/apis provisioningrequest v1), spelled
# here rather than imported from tpuft.api.constants, so that a wrong constant in the operator fails a test.
GROUP, VERSION, PLURAL = "autoscaling.x-k8s.io", "v1", "provisioningrequests"
CLASS = "queued-provisioning.gke.io"
ACCEPTED, PROVISIONED, FAILED = "Accepted", "Provisioned", "Failed"
BOOKING_EXPIRED, CAPACITY_REVOKED = "BookingExpired", "CapacityRevoked"
MAX_RUN_DURATION = "maxRunDurationSeconds"   # a spec.parameters key GKE reads
# Kueue's annotation on the pods that consume a provisioned request (its podSetUpdates).
CONSUMES = "cluster-autoscaler.kubernetes.io/consume-provisioning-request"
ACCELERATOR, TOPOLOGY = "cloud.google.com/gke-tpu-accelerator", "cloud.google.com/gke-tpu-topology"

# The stand-in's own: its settings, the label tying a node to its request, a test's revoke switch.
SETTINGS_NAMESPACE, SETTINGS = "kube-system", "tpuft-local-queued-provisioning"
OWNER_LABEL = "tpuft.local/provisioning-request-uid"
REVOKE_ANNOTATION = "tpuft.local/revoke-capacity"
DEFAULT_PROVISION_AFTER = 5.0
DEFAULT_BOOKING_SECONDS = 600.0   # the cluster autoscaler's default booking time for a provisioned request
POLL_SECONDS = 1.0
# The nodes of an ended booking go this long after its condition is set: the notice in which Kueue
# rejects the check and suspends the job (KubeRay deletes the pods), as GKE drains before it deletes.
REMOVAL_NOTICE_SECONDS = 10.0


@dataclasses.dataclass(frozen=True)
class Settings:
    provision_after: float | None = DEFAULT_PROVISION_AFTER   # None: never (waits for capacity forever)
    booking_seconds: float = DEFAULT_BOOKING_SECONDS

    @classmethod
    def of(cls, data: Mapping[str, str] | None) -> "Settings":
        data = data or {}
        after = str(data.get("provisionAfterSeconds", DEFAULT_PROVISION_AFTER)).strip()
        return cls(provision_after=None if after == "never" else float(after),
                   booking_seconds=float(data.get("bookingSeconds", DEFAULT_BOOKING_SECONDS)))


@dataclasses.dataclass(frozen=True)
class Slices:
    """What a request asks for, read from its pod sets' PodTemplates: whole slices of one shape."""
    shape: Any            # tpuft.api.catalog.SliceShape
    slices: int


@dataclasses.dataclass(frozen=True)
class Step:
    """What to do for one request now: conditions to set, nodes to make or remove."""
    conditions: tuple[dict, ...] = ()
    make_nodes: bool = False
    remove_nodes: bool = False


def _condition(ctype: str, status: bool, reason: str, message: str, now: datetime, generation: int) -> dict:
    return {"type": ctype, "status": "True" if status else "False", "reason": reason, "message": message,
            "lastTransitionTime": now.strftime("%Y-%m-%dT%H:%M:%SZ"), "observedGeneration": generation}


def _conditions(pr: Mapping) -> dict[str, dict]:
    return {x.get("type"): x for x in (pr.get("status") or {}).get("conditions") or []}


def _since(cond: Mapping | None, now: datetime) -> float:
    if not cond or not cond.get("lastTransitionTime"):
        return 0.0
    then = datetime.strptime(cond["lastTransitionTime"], "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc)
    return (now - then).total_seconds()


def slices_of(templates: Iterable[tuple[Mapping, int]]) -> Slices | str:
    """(PodTemplate, count) of each pod set -> the slices asked for, or why they cannot be made."""
    found: list[Slices] = []
    for template, count in templates:
        selector = ((template.get("template") or {}).get("spec") or {}).get("nodeSelector") or {}
        if ACCELERATOR not in selector:
            continue   # not a TPU pod set (Kueue leaves those out when only google.com/tpu is managed)
        try:
            shape = resolve_slice(selector[ACCELERATOR], selector.get(TOPOLOGY))
        except CatalogError as e:
            return f"pod template {template.get('metadata', {}).get('name')}: {e}"
        if count % shape.hosts:
            return f"{count} pods is not whole {shape.topology} slices of {shape.hosts} hosts"
        found.append(Slices(shape, count // shape.hosts))
    # Several TPU pod sets of one shape: one worker group per slice (the operator's rendering under Kueue TAS).
    if not found or len({f.shape for f in found}) != 1:
        return f"expected TPU pod sets of one slice shape, found {[f.shape.topology for f in found] or 'none'}"
    return Slices(found[0].shape, sum(f.slices for f in found))


def step(pr: Mapping, now: datetime, settings: Settings, consumed: bool) -> Step:
    """The stand-in's decision for one ProvisioningRequest of its class, from its status alone."""
    meta, spec = pr.get("metadata") or {}, pr.get("spec") or {}
    gen, conds = int(meta.get("generation") or 1), _conditions(pr)
    done = [x for x in (conds.get(t) for t in (FAILED, BOOKING_EXPIRED, CAPACITY_REVOKED))
            if x and x.get("status") == "True"]
    if done:   # the booking ended: its nodes go (after the notice), the conditions stay
        return Step(remove_nodes=max(_since(x, now) for x in done) >= REMOVAL_NOTICE_SECONDS)
    accepted, provisioned = conds.get(ACCEPTED), conds.get(PROVISIONED)
    if not accepted:
        when = ("never (provisionAfterSeconds: never)" if settings.provision_after is None
                else f"in {settings.provision_after:g} s")
        return Step(conditions=(
            _condition(ACCEPTED, True, "Accepted", "accepted by the local stand-in for GKE queued provisioning", now, gen),
            _condition(PROVISIONED, False, "CapacityIsNotFound", "Waiting for capacity: the local stand-in for GKE "
                       f"queued provisioning provisions this slice {when}", now, gen)))
    if provisioned and provisioned.get("status") == "True":
        held = _since(provisioned, now)
        revoke = meta.get("annotations", {}).get(REVOKE_ANNOTATION)
        limit = (spec.get("parameters") or {}).get(MAX_RUN_DURATION)
        if revoke is not None or (limit and held >= float(limit)):
            why = revoke or f"the flex-start nodes ran for their maxRunDurationSeconds ({limit})"
            return Step(conditions=(_condition(CAPACITY_REVOKED, True, "CapacityRevoked",
                                               f"capacity revoked (local stand-in for GKE): {why}", now, gen),))
        if not consumed and held >= settings.booking_seconds:
            return Step(conditions=(_condition(BOOKING_EXPIRED, True, "BookingExpired",
                                               f"no pod consumed the capacity within {settings.booking_seconds:g} s "
                                               "(local stand-in for GKE)", now, gen),))
        return Step()
    if settings.provision_after is not None and _since(accepted, now) >= settings.provision_after:
        return Step(make_nodes=True, conditions=(_condition(
            PROVISIONED, True, "CapacityIsProvisioned", "Capacity is provisioned by the local stand-in for GKE "
            "queued provisioning: the slice's flex-start nodes are ready", now, gen),))
    return Step()


def _merge(conditions: list[dict], new: Iterable[dict]) -> list[dict]:
    by_type = {x.get("type"): x for x in conditions}
    for x in new:
        by_type[x["type"]] = x
    return list(by_type.values())


def pool_name(pr: Mapping, shape) -> str:
    """The flex-start node pool's name: short (a node name is `gke-{pool}-{slice}-{host}`)."""
    return f"{shape.generation}-{shape.topology}-flex-{(pr.get('metadata') or {}).get('uid', '')[:5]}"


class StandIn:
    """The I/O side: one pass over every request of its class (`pass_once`), forever (`run`)."""

    def __init__(self, api_client, default: Settings):
        from kubernetes import client
        self.custom = client.CustomObjectsApi(api_client)
        self.core = client.CoreV1Api(api_client)
        self.default = default

    def settings(self) -> Settings:
        from kubernetes.client.exceptions import ApiException
        try:
            return Settings.of(self.core.read_namespaced_config_map(SETTINGS, SETTINGS_NAMESPACE).data)
        except ApiException as e:
            if e.status == 404:
                return self.default
            raise

    def pass_once(self, now: datetime) -> None:
        from tpuft_local import pools
        settings = self.settings()
        requests = [pr for pr in self.custom.list_cluster_custom_object(GROUP, VERSION, PLURAL).get("items") or []
                    if (pr.get("spec") or {}).get("provisioningClassName") == CLASS]
        live = {pr["metadata"]["uid"] for pr in requests}
        nodes = self.core.list_node(label_selector=OWNER_LABEL).items
        for node in nodes:   # a request gone (Kueue deleted it with its Workload): its nodes go
            if node.metadata.labels.get(OWNER_LABEL) not in live:
                self._delete_node(node.metadata.name)
        for pr in requests:
            meta = pr["metadata"]
            consumed = any((p.metadata.annotations or {}).get(CONSUMES) == meta["name"]
                           for p in self.core.list_namespaced_pod(meta["namespace"]).items)
            todo = step(pr, now, settings, consumed)
            if todo.make_nodes:
                asked = slices_of(self._templates(pr))
                if isinstance(asked, str):
                    todo = Step(conditions=(_condition(FAILED, True, "FailedToCreateNodes",
                                                       f"local stand-in for GKE: {asked}", now,
                                                       int(meta.get("generation") or 1)),))
                else:
                    for body in pools.flex_start_nodes(asked.shape, pool_name(pr, asked.shape), asked.slices,
                                                       {OWNER_LABEL: meta["uid"]}):
                        self._create_node(body)
            if todo.remove_nodes:
                for node in nodes:
                    if node.metadata.labels.get(OWNER_LABEL) == meta["uid"]:
                        self._delete_node(node.metadata.name)
            if todo.conditions:
                status = dict(pr.get("status") or {})
                status["conditions"] = _merge(list(status.get("conditions") or []), todo.conditions)
                self.custom.patch_namespaced_custom_object_status(GROUP, VERSION, meta["namespace"], PLURAL,
                                                                  meta["name"], {"status": status})
                log.info("%s/%s: %s", meta["namespace"], meta["name"],
                         ", ".join(f"{x['type']}={x['status']}" for x in todo.conditions))

    def _templates(self, pr: Mapping) -> list[tuple[dict, int]]:
        ns = pr["metadata"]["namespace"]
        out = []
        for ps in (pr.get("spec") or {}).get("podSets") or []:
            template = self.core.read_namespaced_pod_template(ps["podTemplateRef"]["name"], ns)
            out.append((self.core.api_client.sanitize_for_serialization(template), int(ps.get("count", 0))))
        return out

    def _create_node(self, body: dict) -> None:
        from kubernetes.client.exceptions import ApiException
        try:
            self.core.create_node(body)
            log.info("node %s created", body["metadata"]["name"])
        except ApiException as e:
            if e.status != 409:   # already there: made on an earlier pass
                raise

    def _delete_node(self, name: str) -> None:
        from kubernetes.client.exceptions import ApiException
        try:
            self.core.delete_node(name)
            log.info("node %s deleted", name)
        except ApiException as e:
            if e.status != 404:
                raise

    def run(self, stop) -> None:
        while not stop():
            try:
                self.pass_once(datetime.now(timezone.utc))
            except Exception:  # noqa: BLE001 - a stand-in keeps going; the log says what failed
                log.exception("pass failed")
            time.sleep(POLL_SECONDS)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tpuft_local.queued_provisioning",
                                 description="LOCAL STAND-IN for GKE queued provisioning (flex-start); not GKE")
    ap.add_argument("--kubeconfig", required=True)
    ap.add_argument("--provision-after", default=str(DEFAULT_PROVISION_AFTER),
                    help="seconds before a request is provisioned, or `never` (the ConfigMap overrides it)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", stream=sys.stdout)
    from kubernetes import config
    api = config.new_client_from_config(config_file=args.kubeconfig)
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    log.info("local stand-in for GKE queued provisioning (%s) running", CLASS)
    StandIn(api, Settings.of({"provisionAfterSeconds": args.provision_after})).run(lambda: bool(stopping))
    return 0


if __name__ == "__main__":
    sys.exit(main())
