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

Greedy rows are deterministic: the same prompt alone gives the same tokens every time, and in a
batch the same tokens up to float rounding in the padded attention.
"""
from __future__ import annotations

import asyncio
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

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
                 wait_s: float = BATCH_WAIT_S):
        self.model, self.tokenizer, self.stop_ids, self.pad_id = model, tokenizer, stop_ids, pad_id
        self.max_batch_size, self.wait_s = max_batch_size, wait_s
        self._queue: queue.Queue[Job] = queue.Queue()
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
        self._queue.put(job)

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
        jobs = [self._queue.get()]
        deadline = time.monotonic() + self.wait_s
        while len(jobs) < self.max_batch_size:
            try:
                jobs.append(self._queue.get_nowait())
                continue
            except queue.Empty:
                pass
            left = deadline - time.monotonic()
            if len(jobs) >= self._last or left <= 0:
                break
            try:
                jobs.append(self._queue.get(timeout=left))
            except queue.Empty:
                break
        live = [j for j in jobs if not j.cancelled.is_set()]
        if live:
            self._last = len(live)
            self.batch_sizes.append(len(live))
        return live

    def _run(self, jobs: list[Job]) -> None:
        import torch
        from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList

        device = self.model.device
        width = max(len(j.ids) for j in jobs)
        ids = torch.tensor([[self.pad_id] * (width - len(j.ids)) + j.ids for j in jobs], device=device)
        mask = torch.tensor([[0] * (width - len(j.ids)) + [1] * len(j.ids) for j in jobs], device=device)
        # do_sample stays off: _Sampler picks the sampled rows' tokens, generate's argmax keeps them
        config = GenerationConfig(max_new_tokens=max(j.budget for j in jobs), do_sample=False, use_cache=True,
                                  eos_token_id=sorted(self.stop_ids), pad_token_id=self.pad_id)
        try:
            with torch.inference_mode():
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
                if joining:
                    new_rows, logits = rolling.prefill(self.model, [j.ids for j in joining], self.pad_id)
                    self._feed(joining, logits)
                    rows, jobs = (new_rows, joining) if rows is None else (rolling.join(rows, new_rows), jobs + joining)
                    self.batch_sizes.append(len(jobs))
                    rows, jobs = self._drop_ended(rows, jobs)
                if jobs:
                    self._feed(jobs, rolling.step(self.model, rows, [j.tokens[-1] for j in jobs]))
                    rows, jobs = self._drop_ended(rows, jobs)
            except Exception as e:  # noqa: BLE001 - every running client gets the failure, the worker lives on
                for j in jobs + joining:
                    if j.finish is None:
                        j.finish = "error"
                        j.emit(e)
                rows, jobs = None, []

    def _admit(self, running: int, block: bool) -> list[Job]:
        """Queued requests that fit beside `running` rows (waiting for the first one when `block`)."""
        jobs = [self._queue.get()] if block else []
        while running + len(jobs) < self.max_batch_size:
            try:
                jobs.append(self._queue.get_nowait())
            except queue.Empty:
                break
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
        ended = token in self.stop_ids
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
