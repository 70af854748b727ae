"""The work queue that drives the reconciler: kopf's change handlers cannot (they need annotations
or a finalizer on the user's object), so this is hand-written, like client-go's workqueue:

  * at most one run per key at a time: a key kicked while it runs is run once more afterwards;
  * each key is run again when due: after the run's own requeue delay, at most `resync` seconds;
  * a run that raises is retried after an exponential backoff (BACKOFF_MIN .. BACKOFF_MAX seconds),
    reset by the next success;
  * a ticker kicks every due key among `keys` (kopf's index of the objects) every half second.

Knows nothing about what a run does: `handle(key)` returns the requeue delay (None: at the resync)
or raises; `on_error(key, error, attempt, retry_in)` is told about each failure.
"""
from __future__ import annotations

import asyncio
import time
from typing import Awaitable, Callable, Collection

Key = tuple[str, str]
Handler = Callable[[Key], Awaitable["float | None"]]
OnError = Callable[[Key, Exception, int, float], None]

BACKOFF_MIN, BACKOFF_MAX = 1.0, 60.0
TICK_SECONDS = 0.5


def backoff(attempt: int) -> float:
    """The wait before retrying after `attempt` consecutive failures (1, 2, 4, ... 60 s)."""
    return min(BACKOFF_MIN * 2 ** (attempt - 1), BACKOFF_MAX)


class WorkQueue:
    def __init__(self, handle: Handler, keys: Collection[Key], *, resync: float, workers: int,
                 on_error: OnError, clock: Callable[[], float] = time.monotonic):
        self._handle, self._on_error, self._clock = handle, on_error, clock
        self.keys, self.resync, self.workers = keys, resync, workers
        self.queued: set[Key] = set()
        self.busy: set[Key] = set()
        self.dirty: set[Key] = set()            # kicked while busy: run again once done
        self._queue: asyncio.Queue[Key] = asyncio.Queue()
        self._due: dict[Key, float] = {}        # clock() time of each key's next run
        self._failures: dict[Key, int] = {}     # consecutive failures, for the backoff
        self._tasks: list[asyncio.Task] = []

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._ticker(), name="tpuft-resync")]
        self._tasks += [asyncio.create_task(self._worker(), name=f"tpuft-worker-{i}") for i in range(self.workers)]

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def kick(self, key: Key) -> None:
        if key in self.busy:
            self.dirty.add(key)
        elif key not in self.queued:
            self.queued.add(key)
            self._queue.put_nowait(key)

    def is_due(self, key: Key, now: float) -> bool:
        """A key never run (or dropped) is due."""
        return self._due.get(key, 0.0) <= now

    def kick_due(self) -> None:
        now = self._clock()
        for key in list(self.keys):
            if self.is_due(key, now):
                self.kick(key)

    async def process(self, key: Key) -> None:
        """One run of a dequeued key, then its next one scheduled."""
        self.queued.discard(key)
        self.busy.add(key)
        try:
            delay = await self._run(key)
        finally:
            self.busy.discard(key)
        if key in self.keys:
            self._due[key] = self._clock() + delay
        else:   # gone from the index: nothing to resync
            self._due.pop(key, None)
            self._failures.pop(key, None)
        if key in self.dirty:
            self.dirty.discard(key)
            self.kick(key)

    async def _run(self, key: Key) -> float:
        try:
            requeue = await self._handle(key)
        except Exception as e:  # noqa: BLE001  (any failure, a bug included, is retried; on_error says which)
            n = self._failures[key] = self._failures.get(key, 0) + 1
            delay = backoff(n)
            self._on_error(key, e, n, delay)
            return delay
        self._failures.pop(key, None)
        return min(requeue if requeue is not None else self.resync, self.resync)

    async def _ticker(self) -> None:
        tick = min(TICK_SECONDS, self.resync)
        while True:
            await asyncio.sleep(tick)
            self.kick_due()

    async def _worker(self) -> None:
        while True:
            await self.process(await self._queue.get())
