"""What the demo's paths share about the objects they make: the demo namespace, its Pod Security
labels, and replacing an earlier run of the same name.

Its own module so that `tpuft demo` (tpuft_local.demo), its --gitops path (tpuft_local.demo_gitops)
and `tpuft cluster up` (tpuft_local.cluster, which makes the namespace with Kueue's LocalQueues in
it) each import it, and none of them imports another.
"""
from __future__ import annotations

import time

from tpuft.api import constants as c

# A namespace the demo creates refuses privileged pods (Pod Security Admission, baseline) and warns
# about what `restricted` would refuse: the run's pods must not need more (issue 25).
PSA_LABELS = {"pod-security.kubernetes.io/enforce": "baseline", "pod-security.kubernetes.io/warn": "restricted"}
DEMO_NAMESPACE = "tpuft-demo"   # `tpuft cluster up` makes it too, with the LocalQueues of kueue.DEMO_LOCAL_QUEUES


class DemoError(RuntimeError):
    """A step failed: the message names the step and what to do."""


def delete_previous(custom, namespace: str, name: str, say) -> None:
    """The demo starts a fresh run: an earlier object of the same name is deleted and waited for
    (60 s at most), by `tpuft demo` and `tpuft demo --gitops` alike."""
    from kubernetes.client.rest import ApiException

    try:
        custom.delete_namespaced_custom_object(c.GROUP, c.VERSION, namespace, c.PLURAL, name)
        say(f"deleted the previous {namespace}/{name}; waiting for it to go")
        end = time.monotonic() + 60
        while time.monotonic() < end:
            custom.get_namespaced_custom_object(c.GROUP, c.VERSION, namespace, c.PLURAL, name)
            time.sleep(0.5)
    except ApiException as e:
        if e.status != 404:
            raise DemoError(f"cannot replace {namespace}/{name}: {e.reason}") from None
