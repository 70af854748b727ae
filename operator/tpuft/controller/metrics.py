"""Prometheus metrics for the operator, served on Settings.metrics_port (TPUFT_METRICS_PORT; 0 disables).

  tpuft_reconcile_total{result}                 reconciles by result: ok, retry (API error, backing off), error (bug)
  tpuft_reconcile_duration_seconds               histogram of one reconcile (read, decide, act, write)
  tpuft_objects{phase}                           TPUFinetunes this operator sees, per phase
  tpuft_phase_duration_seconds{phase}            histogram of time spent in a phase, observed when it is left
  tpuft_failures_total{reason}                   runs that reached Failed, by reason
  tpuft_status_writes_total                      status subresource patches
  tpuft_actions_total{op,kind}                   child creates/patches/deletes performed
"""
from __future__ import annotations

import logging
import threading

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from tpuft.api.constants import Phase

log = logging.getLogger("tpuft.controller.metrics")

REGISTRY = CollectorRegistry()
RECONCILES = Counter("tpuft_reconcile_total", "Reconciles by result.", ["result"], registry=REGISTRY)
RECONCILE_SECONDS = Histogram("tpuft_reconcile_duration_seconds", "Duration of one reconcile.", registry=REGISTRY,
                              buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
OBJECTS = Gauge("tpuft_objects", "TPUFinetunes per phase.", ["phase"], registry=REGISTRY)
PHASE_SECONDS = Histogram("tpuft_phase_duration_seconds", "Time spent in a phase, observed when it is left.",
                          ["phase"], registry=REGISTRY,
                          buckets=(1, 5, 15, 30, 60, 120, 300, 600, 1200, 1800, 3600, 7200, 21600, 86400))
FAILURES = Counter("tpuft_failures_total", "Runs that reached Failed, by reason.", ["reason"], registry=REGISTRY)
SLICE_REPLACEMENTS = Counter("tpuft_slice_replacements_total", "Slices replaced after a lost host (spec.recovery).",
                             registry=REGISTRY)
STATUS_WRITES = Counter("tpuft_status_writes_total", "Status subresource patches.", registry=REGISTRY)
ACTIONS = Counter("tpuft_actions_total", "Child objects created, patched or deleted.", ["op", "kind"],
                  registry=REGISTRY)

_phases: dict[tuple[str, str], str] = {}
_lock = threading.Lock()
_server_port: int | None = None


def set_phase(key: tuple[str, str], phase: str | None) -> None:
    """Record the phase of one object (None: forget it) and refresh the per-phase gauge."""
    with _lock:
        if phase is None:
            _phases.pop(key, None)
        else:
            _phases[key] = phase
        counts = {p.value: 0 for p in Phase}
        for value in _phases.values():
            counts[value] = counts.get(value, 0) + 1
        for p, n in counts.items():
            OBJECTS.labels(phase=p).set(n)


def serve(port: int) -> int | None:
    """Start the HTTP endpoint on `port` once per process. Returns the port, or None when disabled (0)."""
    global _server_port
    if port <= 0:
        return None
    with _lock:
        if _server_port is None:
            start_http_server(port, registry=REGISTRY)
            _server_port = port
            log.info("metrics on :%d/metrics", port)
    return _server_port
