"""tpuft.controller.workqueue: one run per key at a time, a key kicked while running runs once more, the
resync schedule (a fake clock), the backoff after failures, and the ticker."""
from __future__ import annotations

import asyncio

from tpuft.controller.workqueue import BACKOFF_MAX, WorkQueue, backoff

K = ("team-a", "ft")
OTHER = ("team-a", "other")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def queue(handle=None, keys=(K, OTHER), resync=5.0, workers=2, errors=None, clock=None) -> WorkQueue:
    async def ok(key):
        return None
    errors = errors if errors is not None else []
    return WorkQueue(handle or ok, set(keys), resync=resync, workers=workers,
                     on_error=lambda *a: errors.append(a), clock=clock or Clock())


def test_backoff_doubles_up_to_its_bound():
    assert [backoff(n) for n in range(1, 9)] == [1, 2, 4, 8, 16, 32, 60, 60] and BACKOFF_MAX == 60


def test_a_queued_key_is_queued_once():
    q = queue()
    q.kick(K)
    q.kick(K)
    q.kick(OTHER)
    assert q.queued == {K, OTHER} and q._queue.qsize() == 2


def test_the_next_run_is_due_at_the_requeue_at_most_the_resync():
    clock = Clock()
    answers = {K: 2.0, OTHER: 600.0}

    async def handle(key):
        return answers[key]
    q = queue(handle, clock=clock)
    assert q.is_due(K, 0.0)   # never run
    asyncio.run(q.process(K))
    asyncio.run(q.process(OTHER))
    assert not q.is_due(K, 101.9) and q.is_due(K, 102.0)
    assert not q.is_due(OTHER, 104.9) and q.is_due(OTHER, 105.0)   # capped at the resync
    answers[K] = None
    asyncio.run(q.process(K))
    assert not q.is_due(K, 104.9) and q.is_due(K, 105.0)           # None: at the resync


def test_failures_back_off_and_a_success_resets_them():
    clock, errors = Clock(), []
    outcome: list = [RuntimeError("bug"), KeyError("x"), RuntimeError("again"), 1.0, ValueError("new")]

    async def handle(key):
        x = outcome.pop(0)
        if isinstance(x, Exception):
            raise x
        return x
    q = queue(handle, clock=clock, errors=errors)
    for _ in range(5):
        asyncio.run(q.process(K))
    assert [(key, type(e).__name__, n, delay) for key, e, n, delay in errors] == [
        (K, "RuntimeError", 1, 1.0), (K, "KeyError", 2, 2.0), (K, "RuntimeError", 3, 4.0), (K, "ValueError", 1, 1.0)]
    assert not q.is_due(K, 100.9) and q.is_due(K, 101.0)


def test_a_key_gone_from_the_index_is_not_scheduled():
    q = queue(keys=(OTHER,))
    asyncio.run(q.process(K))
    assert q.is_due(K, 0.0) and K not in q.busy


def test_a_key_kicked_while_running_runs_once_more_and_never_twice_at_once():
    runs: list[str] = []

    async def main():
        gate = asyncio.Event()
        running = 0

        async def handle(key):
            nonlocal running
            running += 1
            assert running == 1, "two runs of one key at once"
            runs.append("start")
            await gate.wait()
            running -= 1
            return None
        q = queue(handle, workers=3)
        q.start()
        q.kick(K)
        while not q.busy:
            await asyncio.sleep(0)
        q.kick(K)
        q.kick(K)
        assert q.dirty == {K} and q.queued == set()
        gate.set()
        for _ in range(100):
            await asyncio.sleep(0)
        await q.stop()
        return q
    q = asyncio.run(main())
    assert runs == ["start", "start"] and q.dirty == set() and q.busy == set()


def test_the_ticker_kicks_only_due_keys():
    clock = Clock()
    q = queue(clock=clock)
    asyncio.run(q.process(K))   # K due at 105; OTHER never ran: due
    q.kick_due()
    assert q.queued == {OTHER}
    clock.now = 105.0
    q.kick_due()
    assert q.queued == {K, OTHER}


def test_started_the_keys_are_resynced_and_stop_ends_the_tasks():
    seen: list = []

    async def main():
        async def handle(key):
            seen.append(key)
            return None
        q = WorkQueue(handle, {K}, resync=0.05, workers=1, on_error=lambda *a: None)
        q.start()
        await asyncio.sleep(0.5)
        await q.stop()
        return q
    q = asyncio.run(main())
    assert seen.count(K) >= 3 and all(t.done() for t in q._tasks)
