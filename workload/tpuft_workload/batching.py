"""Batched generation for the transformers engine (tpuft_workload.serve): concurrent requests are
generated together by one worker thread, in one of two ways.

Continuous batching (tpuft_workload.rolling), where every cache layer is full attention (Llama,
Qwen, Mistral, the builtin tiny model): a request that arrives while others decode joins them at the
next step, and a row that ends leaves at once. Static batching otherwise (sliding windows, shared
KV layers): one `model.generate` call over a left-padded batch, and a request that arrives while a
batch runs waits for it to end (the next takes up to max_batch_size waiting requests).

Why generate() for the rest and not our loop everywhere: transformers keeps each architecture's
cache (Gemma's sliding windows, shared KV layers) and position handling right for a padded batch.
What generate() cannot do per row is done by two hooks it calls every step: `_Sampler` (a logits
processor) samples the rows that asked for temperature > 0 with their own temperature, top_p and
seed, leaving greedy rows to generate's argmax; `_Rows` (a stopping criterion) takes each row's new
token, decodes it when the row streams or has stop sequences, sends the text that became final and
ends the row on EOS, a stop sequence, its own token budget or its client going away. The continuous
loop picks tokens the same way and feeds them to the same `advance`.

With LoRA adapters on the base (tpuft_workload.adapters), a forward step applies one adapter to
every row (PEFT's active adapter), so requests are batched per adapter: the running batch serves
one adapter (or the base alone); a request for another waits in its adapter's queue. Once another
adapter has a request waiting, the running batch admits no more rows and drains; the next batch is
the adapter whose oldest request came first. So no adapter waits longer than one batch's drain per
adapter ahead of it, however busy the others are.

Greedy rows are deterministic: the same prompt alone gives the same tokens every time, and in a
batch the same tokens up to float rounding in the padded attention.
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Protocol

from tpuft_workload import chat_api, rolling

# After a batch of k requests, the next waits up to this long for k requests to be queued: closed-loop
# clients send their next request right after an answer. A lone client never waits (k = 1).
BATCH_WAIT_S = 0.01


@dataclass(frozen=True)
class Sampling:
    temperature: float   # 0: greedy
    top_p: float
    seed: int | None     # None: a fresh random seed (never the process's global generator)


@dataclass(frozen=True)
class Finished:
    """A request's last event: why it ended and how many tokens it generated (a final EOS included)."""
    finish_reason: str   # chat_api.FINISH_STOP | FINISH_LENGTH
    completion_tokens: int


@dataclass
class Job:
    """One request inside the batcher; `emit` hands events to its client (thread-safe)."""
    ids: list[int]
    budget: int
    sampling: Sampling
    stops: tuple[str, ...]
    incremental: bool                      # decode every step: it streams, or stop sequences need the text
    emit: Callable[[object], None]
    cancelled: threading.Event = field(default_factory=threading.Event)
    tokens: list[int] = field(default_factory=list)   # the worker's bookkeeping from here on
    shown: str = ""
    finish: str | None = None
    generator: object = None                # a sampled row's torch.Generator, once it runs
    adapter: object = None                  # tpuft_workload.adapters.AdapterRef, None: the base alone
    seq: int = 0                            # arrival order (set by Batcher.put)

    @property
    def group(self) -> tuple[str, str] | None:
        """What may share a forward step with it: the same adapter at the same version."""
        return None if self.adapter is None else (self.adapter.name, self.adapter.uid)


class Adapters(Protocol):
    """What the batcher needs of the adapters on its model (tpuft_workload.engine_process.PeftAdapters)."""
    model: object

    def begin(self, adapter) -> None:
        """Load (if needed) and activate `adapter` (None: the base) for the batch about to start."""

    def forward_context(self, adapter) -> contextlib.AbstractContextManager:
        """Held around each forward of that batch (the base: adapters disabled)."""


class Waiting:
    """Queued jobs by group, each group in arrival order (pure: only the batcher's thread uses it)."""

    def __init__(self):
        self._groups: dict[object, deque[Job]] = {}

    def add(self, job: Job) -> None:
        self._groups.setdefault(job.group, deque()).append(job)

    def __len__(self) -> int:
        return sum(len(q) for q in self._groups.values())

    def count(self, group) -> int:
        return len(self._groups.get(group, ()))

    def oldest_group(self):
        """The group whose first job arrived first (its turn comes next)."""
        return min(self._groups, key=lambda g: self._groups[g][0].seq)

    def others_waiting(self, group) -> bool:
        return any(g != group for g in self._groups)

    def take(self, group, n: int) -> list[Job]:
        """Up to `n` of the group's jobs, oldest first."""
        q = self._groups.get(group)
        jobs = []
        while q and len(jobs) < n:
            jobs.append(q.popleft())
        if q is not None and not q:
            del self._groups[group]
        return jobs


class Generation:
    """The events of one submitted request: its text deltas (str) in order, then its whole
    chat_api.Answer. Leaving the iteration early (a client gone) ends its row at the next step."""

    def __init__(self, cancel: Callable[[], None], events: asyncio.Queue, prompt_tokens: int):
        self._cancel, self._events, self.prompt_tokens = cancel, events, prompt_tokens

    async def __aiter__(self):
        parts: list[str] = []
        try:
            while True:
                event = await self._events.get()
                if isinstance(event, BaseException):
                    raise event
                if isinstance(event, Finished):
                    yield chat_api.Answer("".join(parts), event.finish_reason, self.prompt_tokens,
                                          event.completion_tokens)
                    return
                parts.append(event)
                yield event
        finally:
            self._cancel()

    async def answer(self) -> chat_api.Answer:
        async for event in self:
            if isinstance(event, chat_api.Answer):
                return event
        raise RuntimeError("a generation ended without its answer")   # __aiter__ returns after one


def event_queue() -> tuple[Callable[[object], None], asyncio.Queue]:
    """An emit function any thread may call, and the queue it fills on the running event loop."""
    loop, events = asyncio.get_running_loop(), asyncio.Queue()

    def emit(event: object) -> None:
        try:
            loop.call_soon_threadsafe(events.put_nowait, event)
        except RuntimeError:   # that loop is closed: nobody is listening any more
            pass
    return emit, events


class Batcher:
    """Owns the model: only its worker thread calls it, on up to `max_batch_size` requests at a time."""

    def __init__(self, model, tokenizer, stop_ids: set[int], pad_id: int, max_batch_size: int,
                 wait_s: float = BATCH_WAIT_S, adapters: Adapters | None = None):
        self.model, self.tokenizer, self.stop_ids, self.pad_id = model, tokenizer, stop_ids, pad_id
        self.max_batch_size, self.wait_s, self.adapters = max_batch_size, wait_s, adapters
        self._queue: queue.Queue[Job] = queue.Queue()
        self._waiting = Waiting()
        self._seq = itertools.count()
        self._group = None   # the running batch's group
        self.groups: list[object] = []   # each batch's group as it started, for tests and benchmarks
        self._last = 1   # the last batch's size
        self.batch_sizes: list[int] = []   # rows running after each admission, for tests and benchmarks
        self.continuous = rolling.supported(model)
        threading.Thread(target=self._work, name="tpuft-generate", daemon=True).start()

    def submit(self, ids: list[int], budget: int, sampling: Sampling, stops: tuple[str, ...],
               stream: bool) -> Generation:
        """Queue one request; call from the event loop its client awaits on."""
        emit, events = event_queue()
        job = Job(ids, budget, sampling, stops, stream or bool(stops), emit)
        self.put(job)
        return Generation(job.cancelled.set, events, len(ids))

    def put(self, job: Job) -> None:
        """Queue a job whose events go where its `emit` sends them (any thread may call it)."""
        job.seq = next(self._seq)
        self._queue.put(job)

    def _collect(self, block: bool, timeout: float | None = None) -> None:
        """Move what is queued into the per-group waiting lines (waiting for one when `block`)."""
        if block:
            try:
                self._waiting.add(self._queue.get(timeout=timeout))
            except queue.Empty:
                return
        while True:
            try:
                self._waiting.add(self._queue.get_nowait())
            except queue.Empty:
                return

    def _start(self, jobs: list[Job]) -> list[Job]:
        """Activate the jobs' adapter for a new batch; on failure they get the error, [] is returned."""
        self.groups.append(jobs[0].group)
        if self.adapters is None:
            return jobs
        try:
            self.adapters.begin(jobs[0].adapter)
        except Exception as e:  # noqa: BLE001 - this adapter's clients get why; the others keep being served
            for j in jobs:
                j.finish = "error"
                j.emit(e)
            return []
        self.model = self.adapters.model
        return jobs

    def _forward(self, job: Job):
        return contextlib.nullcontext() if self.adapters is None else self.adapters.forward_context(job.adapter)

    def stop_ids_of(self, job: Job) -> set[int]:
        return set(job.adapter.stop_ids) if job.adapter is not None else self.stop_ids

    def _work(self) -> None:
        if self.continuous:
            self._roll()
        while True:
            jobs = self._take()
            if jobs:
                self._run(jobs)

    def _take(self) -> list[Job]:
        """The next static batch: whatever is queued (at most max_batch_size), waiting up to wait_s for
        as many requests as the last batch had."""
        self._collect(block=not len(self._waiting))
        group = self._waiting.oldest_group()
        deadline = time.monotonic() + self.wait_s
        while True:
            self._collect(block=False)
            queued = self._waiting.count(group)
            left = deadline - time.monotonic()
            if queued >= min(self._last, self.max_batch_size) or left <= 0:
                break
            self._collect(block=True, timeout=left)
        jobs = self._waiting.take(group, self.max_batch_size)
        live = [j for j in jobs if not j.cancelled.is_set()]
        if live:
            self._last = len(live)
            self.batch_sizes.append(len(live))
            live = self._start(live)
        return live

    def _run(self, jobs: list[Job]) -> None:
        import torch
        from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList

        device = self.model.device
        width = max(len(j.ids) for j in jobs)
        ids = torch.tensor([[self.pad_id] * (width - len(j.ids)) + j.ids for j in jobs], device=device)
        mask = torch.tensor([[0] * (width - len(j.ids)) + [1] * len(j.ids) for j in jobs], device=device)
        # do_sample stays off: _Sampler picks the sampled rows' tokens, generate's argmax keeps them
        stops = set().union(*(self.stop_ids_of(j) for j in jobs))
        config = GenerationConfig(max_new_tokens=max(j.budget for j in jobs), do_sample=False, use_cache=True,
                                  eos_token_id=sorted(stops), pad_token_id=self.pad_id)
        try:
            with torch.inference_mode(), self._forward(jobs[0]):
                self.model.generate(ids, attention_mask=mask, generation_config=config,
                                    logits_processor=LogitsProcessorList([_Sampler(jobs, device)]),
                                    stopping_criteria=StoppingCriteriaList([_Rows(self, jobs)]))
        except Exception as e:  # noqa: BLE001 - every waiting client gets the failure, the worker lives on
            for j in jobs:
                if j.finish is None:
                    j.finish = "error"
                    j.emit(e)
            return
        for j in jobs:   # generate ended at the longest budget: a row still open ran out of tokens
            if j.finish is None:
                self._end(j, chat_api.FINISH_LENGTH)

    def _roll(self) -> None:
        """Continuous batching, forever: admit what is queued (blocking only when nothing runs),
        prefill it and join it to the running rows, then one step for every row; ended rows leave."""
        import torch

        # Without it every step would record autograd history through the KV cache: ~15% slower per
        # step, and a batch that never empties under steady load would hold every step's activations.
        with torch.inference_mode():
            self._roll_forever()

    def _roll_forever(self) -> None:
        rows, jobs = None, []
        while True:
            joining = self._admit(len(jobs), block=not jobs)
            try:
                if joining and not jobs:
                    joining = self._start(joining)
                if joining:
                    with self._forward(joining[0]):
                        new_rows, logits = rolling.prefill(self.model, [j.ids for j in joining], self.pad_id)
                    self._feed(joining, logits)
                    rows, jobs = (new_rows, joining) if rows is None else (rolling.join(rows, new_rows), jobs + joining)
                    self.batch_sizes.append(len(jobs))
                    rows, jobs = self._drop_ended(rows, jobs)
                if jobs:
                    with self._forward(jobs[0]):
                        logits = rolling.step(self.model, rows, [j.tokens[-1] for j in jobs])
                    self._feed(jobs, logits)
                    rows, jobs = self._drop_ended(rows, jobs)
            except Exception as e:  # noqa: BLE001 - every running client gets the failure, the worker lives on
                for j in jobs + joining:
                    if j.finish is None:
                        j.finish = "error"
                        j.emit(e)
                rows, jobs = None, []

    def _admit(self, running: int, block: bool) -> list[Job]:
        """Queued requests of the running batch's group that fit beside its `running` rows (waiting
        for the first one when `block`); none while another group waits (the batch drains for it).
        With no rows running, the group whose oldest request came first starts the next batch."""
        self._collect(block=block and not len(self._waiting))
        if not len(self._waiting):
            return []
        if running == 0:
            self._group = self._waiting.oldest_group()
        elif self._waiting.others_waiting(self._group):
            return []
        jobs = self._waiting.take(self._group, self.max_batch_size - running)
        return [j for j in jobs if not j.cancelled.is_set()]

    def _feed(self, jobs: list[Job], logits) -> None:
        """Each open row's next token from its logits (greedy, or sampled with its own generator)."""
        tokens = logits.argmax(-1).tolist()
        for i, job in enumerate(jobs):
            if job.finish is not None:
                continue
            if job.sampling.temperature > 0:
                job.generator = job.generator or _generator(job.sampling, logits.device)
                tokens[i] = sample(logits[i], job.sampling.temperature, job.sampling.top_p, job.generator)
            self.advance(job, tokens[i])

    @staticmethod
    def _drop_ended(rows, jobs: list[Job]):
        kept = [i for i, j in enumerate(jobs) if j.finish is None]
        if len(kept) == len(jobs):
            return rows, jobs
        if not kept:
            return None, []
        return rolling.keep(rows, kept), [jobs[i] for i in kept]

    def advance(self, job: Job, token: int) -> None:
        """One new token of an open row: send what became final; end the row when it is done."""
        if job.cancelled.is_set():
            job.finish = "cancelled"
            return
        job.tokens.append(token)
        ended = token in self.stop_ids_of(job)
        out_of_budget = len(job.tokens) >= job.budget
        hit = False
        if job.incremental:
            shown, hit = chat_api.visible(self._decode(job), job.stops, final=ended or out_of_budget)
            self._show(job, shown)
        if hit or ended:
            self._end(job, chat_api.FINISH_STOP)
        elif out_of_budget:
            self._end(job, chat_api.FINISH_LENGTH)

    def _decode(self, job: Job) -> str:
        return self.tokenizer.decode(job.tokens, skip_special_tokens=True)

    def _show(self, job: Job, shown: str) -> None:
        # decoding a longer prefix extends the text; a tokenizer that rewrites earlier text (rare
        # cleanup rules) sends nothing until the text extends what was sent again
        if len(shown) > len(job.shown) and shown.startswith(job.shown):
            job.emit(shown[len(job.shown):])
            job.shown = shown

    def _end(self, job: Job, reason: str) -> None:
        if not job.incremental:
            self._show(job, chat_api.visible(self._decode(job), (), final=True)[0])
        job.finish = reason
        job.emit(Finished(reason, len(job.tokens)))


class _Rows:
    """generate()'s stopping criterion: per row, done or not, after feeding each open row its token."""

    def __init__(self, batcher: Batcher, jobs: list[Job]):
        self.batcher, self.jobs = batcher, jobs

    def __call__(self, input_ids, scores, **kwargs):
        import torch

        for job, token in zip(self.jobs, input_ids[:, -1].tolist()):
            if job.finish is None:
                self.batcher.advance(job, token)
        return torch.tensor([j.finish is not None for j in self.jobs], device=input_ids.device)


class _Sampler:
    """generate()'s logits processor: each sampled row's token drawn with its own temperature, top_p
    and generator (seeded: reproducible, whatever else shares the batch); greedy rows untouched."""

    def __init__(self, jobs: list[Job], device):
        self.jobs = jobs
        self.rows = [(i, _generator(j.sampling, device)) for i, j in enumerate(jobs) if j.sampling.temperature > 0]

    def __call__(self, input_ids, scores):
        for i, gen in self.rows:
            job = self.jobs[i]
            if job.finish is None:
                token = sample(scores[i], job.sampling.temperature, job.sampling.top_p, gen)
                scores[i] = float("-inf")
                scores[i, token] = 0.0
        return scores


def _generator(sampling: Sampling, device):
    """A sampled row's own generator: seeded (reproducible, whatever else shares the batch) or fresh."""
    import torch

    gen = torch.Generator(device=device)
    gen.manual_seed(sampling.seed) if sampling.seed is not None else gen.seed()
    return gen


def sample(logits, temperature: float, top_p: float, generator) -> int:
    """One token from logits / temperature, among the smallest set of tokens whose probability
    reaches top_p (nucleus sampling; the most likely token is always kept)."""
    import torch

    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        ordered, order = probs.sort(descending=True)
        keep = ordered.cumsum(-1) - ordered < top_p
        probs = torch.zeros_like(probs).scatter(0, order[keep], ordered[keep])
    return int(torch.multinomial(probs, 1, generator=generator))
