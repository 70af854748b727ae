"""Progress into the TPUFinetune's status: rank 0 merge-patches two keys, nothing else.

The operator owns every other status key, so the patch body is always
{"status": {"verification": {...}}} or {"status": {"training": {...}}}, sent as a JSON
merge patch to the status subresource. Enabled only when TPUFT_NAMESPACE and TPUFT_NAME
are set. A failed report is logged and swallowed: progress reporting never kills a run.
A merge patch (RFC 7386) replaces a list wholly, so each status.training.history sent is the
whole curve (`add_point`), never appended to what the object holds.

The API server answers a patch with the whole object: the reporter keeps what the operator asks of
the run from it (`Requests`: status.recovery.checkpointRequestedAt, and the value the run already
answered in status.training.checkpointRequestSaved), so asking costs no extra request. Only when
no patch was sent for REQUEST_POLL_S (reports far apart) does the background thread read the
status once (a GET, which the job's Role allows beside the patch), so a request waits at most that
long to be seen.
"""
from __future__ import annotations

import datetime as _dt
import logging
import os
import time
from dataclasses import dataclass
from typing import Mapping

from tpuft.api.catalog import gpu_peak_flops
from tpuft.api.constants import (ENV_CR_NAME, ENV_CR_NAMESPACE, GROUP, HISTORY_MAX_POINTS, PLURAL, VERSION, HistoryPoint,
                             TrainingStatus, VerificationStatus)

# status.recovery's key the operator writes to ask for a checkpoint (tpuft.api.status.Recovery's field)
RECOVERY_CHECKPOINT_REQUESTED_AT = "checkpointRequestedAt"
# Without a patch for this long, rank 0's reporter reads the status once for a checkpoint request
REQUEST_POLL_S = 60.0

log = logging.getLogger(__name__)

# The one list of keys (tpuft.api.constants, which the CRD's status schema is built from too).
TRAINING_KEYS = tuple(k.value for k in TrainingStatus)
VERIFICATION_KEYS = tuple(k.value for k in VerificationStatus)


def add_point(history: list[dict], point: dict, max_points: int = HISTORY_MAX_POINTS) -> list[dict]:
    """status.training.history with `point` added: at most `max_points`, evenly spaced in steps (the
    gap of the first two) plus the latest. The latest stands in for its successor until the gap
    from the point before it reaches that spacing; when full, every other point is dropped (the
    first and the latest stay) and the spacing doubles. Points at or past `point`'s step are
    dropped first: an attempt restarted from a checkpoint reports those steps again."""
    step = HistoryPoint.STEP.value
    out = [p for p in history if p[step] < point[step]]
    if len(out) >= 3 and out[-1][step] - out[-2][step] < out[1][step] - out[0][step]:
        out.pop()
    out.append(point)
    if len(out) > max_points:
        out = out[:-1:2] + [out[-1]]
    return out


def flops_per_token(parameters: int, config: Mapping, seq_len: int) -> float:
    """Training FLOPs per token, PaLM's formula (Chowdhery et al. 2022, appendix B): 6N + 12·L·H·Q·T.
    6N: forward (2N) and backward (4N) of every weight matmul, N every parameter the model holds
    (tied embeddings: the output projection's matmul; the input lookup is not one, an untied
    input table is counted anyway). 12·L·H·Q·T: attention's scores and weighted values, L layers,
    H·Q heads x head dim, T the sequence length (--max-seq-length: packed rows are full), over
    the whole row (no discount for the causal mask or a sliding window: PaLM's convention).
    `config` is the Hugging Face config as a dict; a multimodal one's text_config is the decoder."""
    text = config.get("text_config") or config
    layers, heads = int(text.get("num_hidden_layers") or 0), int(text.get("num_attention_heads") or 0)
    head_dim = int(text.get("head_dim") or (text.get("hidden_size") or 0) // max(heads, 1))
    return 6.0 * parameters + 12.0 * layers * heads * head_dim * seq_len


def gpu_slice_peak(device_name: str, devices: int) -> float | None:
    """Peak bf16 FLOP/s of `devices` GPUs named `device_name` (tpuft.api.catalog's table; one model
    across the run); None for a GPU it does not list, so no MFU is reported."""
    per_device = gpu_peak_flops(device_name)
    return per_device * devices if per_device else None


def mfu(flops_per_token: float, tokens_per_s: float, peak_flops: float | None) -> float | None:
    """Model FLOPs utilisation: the model FLOP/s achieved (flops_per_token x real tokens/s; padding
    does not count) over the slice's peak bf16 FLOP/s (tpuft.api.catalog), to 4 significant digits.
    None without a peak (CPU, a GPU the catalog does not list): never an invented figure."""
    if not peak_flops or peak_flops <= 0:
        return None
    return float(f"{flops_per_token * tokens_per_s / peak_flops:.4g}")


def now_rfc3339() -> str:
    return _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def status_path(namespace: str, name: str) -> str:
    return f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{PLURAL}/{name}/status"


@dataclass(frozen=True)
class Requests:
    """What the operator asks of the run, as the latest patch answer held it."""
    checkpoint_requested_at: str | None = None   # status.recovery.checkpointRequestedAt
    checkpoint_request_saved: str | None = None  # status.training.checkpointRequestSaved: the one answered

    @classmethod
    def of(cls, obj) -> Requests | None:
        """From the API server's answer (the TPUFinetune as a dict); None when it is not one."""
        if not isinstance(obj, Mapping):
            return None
        status = obj.get("status") or {}
        recovery, training = status.get("recovery") or {}, status.get("training") or {}
        requested = recovery.get(RECOVERY_CHECKPOINT_REQUESTED_AT)
        saved = training.get(TrainingStatus.CHECKPOINT_REQUEST_SAVED.value)
        return cls(str(requested) if requested else None, str(saved) if saved else None)

    @property
    def unanswered(self) -> str | None:
        """The checkpoint request the object holds no answer to."""
        requested = self.checkpoint_requested_at
        return requested if requested and requested != self.checkpoint_request_saved else None


class StatusReporter:
    """Patches status.verification / status.training of one TPUFinetune. No-op when unset."""

    def __init__(self, namespace: str | None = None, name: str | None = None, timeout_s: float = 10.0):
        self.namespace = namespace if namespace is not None else os.environ.get(ENV_CR_NAMESPACE, "")
        self.name = name if name is not None else os.environ.get(ENV_CR_NAME, "")
        self.timeout_s = timeout_s
        self._api = None
        self.failures = 0
        self.last_error: str | None = None
        self.requests: Requests | None = None   # from the latest patch answer (None before one)

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

    def _failed(self, e: Exception, doing: str) -> None:
        """A failed request, counted and logged; only the exception type and reason (API errors can
        echo request headers)."""
        self.failures += 1
        reason = getattr(e, "reason", None) or type(e).__name__
        self.last_error = f"{type(e).__name__}: {getattr(e, 'status', '')} {reason}".strip()
        log.warning("could not %s %s (%s); continuing", doing, status_path(self.namespace, self.name), self.last_error)

    def _patch(self, key: str, value: dict) -> bool:
        if not self.enabled:
            return False
        body = {"status": {key: value}}
        try:
            answer = self._client().patch_namespaced_custom_object_status(
                GROUP, VERSION, self.namespace, PLURAL, self.name, body,
                _content_type="application/merge-patch+json", _request_timeout=self.timeout_s,
            )
        except Exception as e:  # noqa: BLE001 - never let reporting kill training
            self._failed(e, f"patch status.{key} of")
            return False
        self.requests = Requests.of(answer) or self.requests
        return True

    def _read(self, doing: str) -> dict | None:
        """The object, read through its status subresource; None (counted and logged) on a failure."""
        if not self.enabled:
            return None
        try:
            return self._client().get_namespaced_custom_object_status(
                GROUP, VERSION, self.namespace, PLURAL, self.name, _request_timeout=self.timeout_s)
        except Exception as e:  # noqa: BLE001 - never let reporting kill training
            self._failed(e, doing)
            return None

    def read_requests(self) -> bool:
        """A GET of the status, for the operator's requests only (when no patch answer is recent).
        A failure is logged like a patch's; False then."""
        answer = self._read("read, for a checkpoint request,")
        if answer is None:
            return False
        self.requests = Requests.of(answer) or self.requests
        return True

    def condition(self, ctype: str) -> tuple[str, str] | None:
        """(status, message) of the TPUFinetune's condition `ctype`, or None (absent, or not read:
        logged like a failed patch)."""
        answer = self._read(f"read {ctype} of")
        found = next((x for x in ((answer or {}).get("status") or {}).get("conditions") or []
                      if x.get("type") == ctype), None)
        return (found.get("status") or "", found.get("message") or "") if found else None

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
    coalesce: the newest fields win. `close()` flushes what is left, with a bound. Idle for
    `poll_s` (no patch sent), the thread reads the status once for the operator's requests."""

    def __init__(self, reporter: StatusReporter, poll_s: float = REQUEST_POLL_S):
        import threading

        self.reporter = reporter
        self.poll_s = poll_s
        self._pending: dict = {}
        self._cv = threading.Condition()
        self._closed = False
        self._last_sent = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="tpuft-status", daemon=True)
        if reporter.enabled:
            self._thread.start()

    @property
    def enabled(self) -> bool:
        return self.reporter.enabled

    def checkpoint_request(self) -> str | None:
        """The checkpoint request (status.recovery.checkpointRequestedAt) the latest patch answer
        held without an answer in status.training.checkpointRequestSaved; None for none. A read of
        what the sending thread last stored: no request of its own."""
        requests = self.reporter.requests
        return requests.unanswered if requests else None

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
                    idle = time.monotonic() - self._last_sent
                    if idle >= self.poll_s:
                        break
                    self._cv.wait(self.poll_s - idle)
                if not self._pending and self._closed:
                    return
                fields, self._pending = self._pending, {}
            if fields:
                self.reporter.training(**fields)
            else:   # idle: the request a patch answer would have carried
                self.reporter.read_requests()
            self._last_sent = time.monotonic()

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
