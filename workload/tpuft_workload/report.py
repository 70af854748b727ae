"""Progress into the TPUFinetune's status: rank 0 merge-patches two keys, nothing else.

The operator owns every other status key, so the patch body is always
{"status": {"verification": {...}}} or {"status": {"training": {...}}}, sent as a JSON
merge patch to the status subresource. Enabled only when TPUFT_NAMESPACE and TPUFT_NAME
are set. A failed report is logged and swallowed: progress reporting never kills a run.
"""
from __future__ import annotations

import datetime as _dt
import logging
import os
import time

from tpuft.constants import (ENV_CR_NAME, ENV_CR_NAMESPACE, GROUP, PLURAL, VERSION, TrainingStatus,
                             VerificationStatus)

log = logging.getLogger(__name__)

# The one list of keys (tpuft.constants, which the CRD's status schema is built from too).
TRAINING_KEYS = tuple(k.value for k in TrainingStatus)
VERIFICATION_KEYS = tuple(k.value for k in VerificationStatus)


def now_rfc3339() -> str:
    return _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def status_path(namespace: str, name: str) -> str:
    return f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{PLURAL}/{name}/status"


class StatusReporter:
    """Patches status.verification / status.training of one TPUFinetune. No-op when unset."""

    def __init__(self, namespace: str | None = None, name: str | None = None, timeout_s: float = 10.0):
        self.namespace = namespace if namespace is not None else os.environ.get(ENV_CR_NAMESPACE, "")
        self.name = name if name is not None else os.environ.get(ENV_CR_NAME, "")
        self.timeout_s = timeout_s
        self._api = None
        self.failures = 0
        self.last_error: str | None = None

    @property
    def enabled(self) -> bool:
        return bool(self.namespace and self.name)

    def _client(self):
        if self._api is None:
            from kubernetes import client, config

            # Our own ApiClient, never the library-wide default configuration.
            cfg = client.Configuration()
            if os.environ.get("KUBERNETES_SERVICE_HOST"):
                config.load_incluster_config(client_configuration=cfg)
            else:  # KUBECONFIG read now (the library reads it once, at import)
                config.load_kube_config(config_file=os.environ.get("KUBECONFIG") or None,
                                        client_configuration=cfg)
            cfg.retries = 1  # a down API server must not hold rank 0 for long
            self._api = client.CustomObjectsApi(client.ApiClient(cfg))
        return self._api

    def _patch(self, key: str, value: dict) -> bool:
        if not self.enabled:
            return False
        body = {"status": {key: value}}
        try:
            self._client().patch_namespaced_custom_object_status(
                GROUP, VERSION, self.namespace, PLURAL, self.name, body,
                _content_type="application/merge-patch+json", _request_timeout=self.timeout_s,
            )
            return True
        except Exception as e:  # noqa: BLE001 - never let reporting kill training
            self.failures += 1
            # Only the exception type and reason: API errors can echo request headers.
            reason = getattr(e, "reason", None) or type(e).__name__
            self.last_error = f"{type(e).__name__}: {getattr(e, 'status', '')} {reason}".strip()
            log.warning("could not patch %s status.%s (%s); continuing",
                        status_path(self.namespace, self.name), key, self.last_error)
            return False

    def verification(self, status: dict) -> bool:
        return self._patch("verification", {k: status.get(k) for k in VERIFICATION_KEYS})

    def training(self, **fields) -> bool:
        unknown = set(fields) - set(TRAINING_KEYS)
        if unknown:
            raise ValueError(f"not a status.training key: {sorted(unknown)}")
        fields.setdefault("updatedAt", now_rfc3339())
        return self._patch("training", fields)


class BackgroundReporter:
    """Sends status.training patches from a daemon thread so a slow or unreachable API server
    never stalls rank 0 (and with it every rank, at the next collective). Pending patches
    coalesce: the newest fields win. `close()` flushes what is left, with a bound."""

    def __init__(self, reporter: StatusReporter):
        import threading

        self.reporter = reporter
        self._pending: dict = {}
        self._cv = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="tpuft-status", daemon=True)
        if reporter.enabled:
            self._thread.start()

    @property
    def enabled(self) -> bool:
        return self.reporter.enabled

    def training(self, **fields) -> None:
        if not self.enabled:
            return
        unknown = set(fields) - set(TRAINING_KEYS)
        if unknown:
            raise ValueError(f"not a status.training key: {sorted(unknown)}")
        with self._cv:
            self._pending.update(fields, updatedAt=now_rfc3339())
            self._cv.notify()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._pending and not self._closed:
                    self._cv.wait()
                if not self._pending and self._closed:
                    return
                fields, self._pending = self._pending, {}
            self.reporter.training(**fields)

    def close(self, timeout_s: float = 30.0) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()
        if self._thread.is_alive():
            self._thread.join(timeout_s)


class Throttle:
    """At most one call per `every_s` seconds, except when forced (epoch ends, the end)."""

    def __init__(self, every_s: float = 10.0):
        self.every_s = every_s
        self._last = float("-inf")

    def ready(self, force: bool = False) -> bool:
        now = time.monotonic()
        if force or now - self._last >= self.every_s:
            self._last = now
            return True
        return False
