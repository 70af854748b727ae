"""What the reconciler remembers about each TPUFinetune between reconciles, in one place.

kopf's index is an informer cache: it lags this process's own writes by a watch event, and
after a re-list (410 Gone) it can keep objects forever (it never sees their DELETED event).
The ledger holds what bridges that lag, per key:

  * written: the operator-owned status as last written, overlaid on the indexed object until
    the index shows it (no GET per reconcile);
  * unsure: a status write failed, but may have landed: re-read before deciding;
  * removed: children this process deleted, confirmed with a GET instead of taken from the index;
  * gone: the uid of a TPUFinetune the API server says is deleted while the index still holds it;
  * pods: the slice's pods as last listed, reused for up to POD_LIST_INTERVAL_SECONDS (a stall's
    cause needs seconds, not every resync's fresh list);

and the last error posted as an Event (posted once, not every retry). The work queue's own
per-key state (when the next run is due, the backoff) is tpuft.controller.workqueue's.
Pure and synchronous: no client, no clock (callers pass monotonic times).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Mapping

from tpuft.api.status import OWNED_KEYS, owned

Key = tuple[str, str]
Child = tuple[str, str]   # (kind, name)


@dataclass
class _Entry:
    last_error: str | None = None
    written: dict | None = None
    unsure: bool = False
    removed: set[Child] = field(default_factory=set)
    gone: bool = False
    gone_uid: str | None = None
    pods: tuple | None = None
    pods_at: float = 0.0


class Ledger:
    def __init__(self) -> None:
        self._entries: dict[Key, _Entry] = {}

    def _entry(self, key: Key) -> _Entry:
        return self._entries.setdefault(key, _Entry())

    def __contains__(self, key: Key) -> bool:
        return key in self._entries

    def pods(self, key: Key, now: float, interval: float) -> tuple | None:
        """The slice's pods as listed less than `interval` seconds ago, else None (list again)."""
        e = self._entries.get(key)
        return e.pods if e is not None and e.pods is not None and now - e.pods_at < interval else None

    def listed_pods(self, key: Key, now: float, pods: tuple | None) -> None:
        """None (the list failed, or must not be reused) keeps nothing."""
        e = self._entry(key)
        e.pods, e.pods_at = pods, now

    def forget(self, key: Key) -> None:
        """The TPUFinetune is gone (or being deleted): nothing about it is kept."""
        self._entries.pop(key, None)

    # --- errors posted as Events -------------------------------------------------------------------
    def new_error(self, key: Key, error: str) -> bool:
        """Record `error`; True if it differs from the last one recorded (announce it)."""
        e = self._entry(key)
        changed, e.last_error = e.last_error != error, error
        return changed

    def clear_error(self, key: Key) -> None:
        if key in self._entries:
            self._entries[key].last_error = None

    # --- our own status writes -------------------------------------------------------------------
    def wrote(self, key: Key, status: Mapping[str, Any]) -> None:
        """The operator-owned status the server now holds (after a write, or as re-read)."""
        e = self._entry(key)
        e.written, e.unsure = owned(status), False

    def written(self, key: Key) -> dict | None:
        e = self._entries.get(key)
        return e.written if e else None

    def overlay(self, key: Key, body: dict) -> dict:
        """The indexed object with the operator's own status keys as this process last wrote them.

        The operator is the only writer of those keys, so until the index shows them, our copy
        is the truth (spec and the workload's keys always come from the index)."""
        mine = self.written(key)
        if mine is None:
            return body
        status = body.get("status") or {}
        if owned(status) == mine:
            self._entries[key].written = None    # caught up
            return body
        merged = {k: v for k, v in status.items() if k not in OWNED_KEYS}
        merged.update(copy.deepcopy(mine))
        return {**body, "status": merged}

    def write_unsure(self, key: Key) -> None:
        """A status write failed in a way (timeout, 5xx) that may come after it was applied."""
        self._entry(key).unsure = True

    def is_unsure(self, key: Key) -> bool:
        e = self._entries.get(key)
        return bool(e and e.unsure)

    # --- children we deleted and objects the server says are gone -----------------------------------
    def deleted_child(self, key: Key, kind: str, name: str) -> None:
        self._entry(key).removed.add((kind, name))

    def created_child(self, key: Key, kind: str, name: str) -> None:
        if key in self._entries:
            self._entries[key].removed.discard((kind, name))

    def removed(self, key: Key) -> frozenset[Child]:
        e = self._entries.get(key)
        return frozenset(e.removed) if e else frozenset()

    def mark_gone(self, key: Key, uid: str | None) -> None:
        e = self._entry(key)
        e.gone, e.gone_uid = True, uid

    def is_gone(self, key: Key, uid: str | None) -> bool:
        """The API server said this object (this uid: not a later one of the same name) is deleted."""
        e = self._entries.get(key)
        return bool(e and e.gone and e.gone_uid == uid)
