"""The transformers engine's model in a process of its own: the Serve replica keeps the HTTP path and
the tokenizer, a child process (`python -m tpuft_workload.engine_process`) owns the model and its
batching.Batcher, and the two talk over a pair of pipes. vLLM splits its API server from its engine
core the same way.

Why: in one process the decoding thread and Ray Serve's event loops take turns on one GIL. With 8
concurrent clients on the 2-core dev machine the replica's process ran at 94% of a core, half of it
Serve's own work per request (receiving it, asking the proxy for its body, sending the answer back),
and every request waited behind the others' share (docs/performance.md). Apart, each side has a core.

With --max-adapters N the model is a base that LoRA adapters are applied to per request
(PeftAdapters: loaded on first use, at most N, least recently used out); the parent resolves each
adapter to a local folder (tpuft_workload.adapters.Registry) and sends its AdapterRef with the request.

Messages. Parent to child: (SUBMIT, id, ids, budget, sampling, stops, incremental, adapter), (CANCEL, id),
(STATS, id). Child to parent: (None, Ready) or (None, EngineError) once the model is loaded, then
(id, event): a str delta, a batching.Finished, an EngineError, or (STATS) a dict of the batches so far.
The child exits when the parent's end of its pipe closes, so it never outlives the replica.
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import subprocess
import sys
import threading
from dataclasses import dataclass
from multiprocessing.connection import Connection

from tpuft_workload import adapters as adapterslib, batching

SUBMIT, CANCEL, STATS = "submit", "cancel", "stats"
# The child's decoding thread shares its GIL with the thread that reads the pipe: at Python's default
# 5 ms switch interval a request waits up to that long to join the running rows.
GIL_SWITCH_INTERVAL_S = 0.0005
STATS_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class EngineError:
    """A failure inside the child, as text (a torch exception may not pickle)."""
    message: str


@dataclass(frozen=True)
class Ready:
    """What the replica needs from the loaded model."""
    config: object          # the model's transformers config
    stop_ids: frozenset
    pad_id: int
    continuous: bool        # rows join a running batch (tpuft_workload.rolling)


@dataclass
class Loaded:
    model: object
    tokenizer: object
    stop_ids: set
    pad_id: int


def load_causal_lm(path: str, dtype):
    """The export's model: a from_pretrained() folder, or a LoRA adapter folder applied to its base
    (base_model_name_or_path: a path, gs:// URI or hub name) and merged into it, so serving runs
    one plain model at the base's speed, with the adapter folder's generation config (its stop ids
    hold the chat template's turn end, which the base's may not) where it has one."""
    from transformers import AutoModelForCausalLM, GenerationConfig
    from transformers.utils import GENERATION_CONFIG_NAME

    from tpuft_workload import lora
    from tpuft_workload.model import _local_copy

    if not lora.is_adapter_folder(path):
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    from peft import PeftModel

    base = AutoModelForCausalLM.from_pretrained(_local_copy(lora.base_of(path)), dtype=dtype)
    model = PeftModel.from_pretrained(base, path).merge_and_unload()
    if os.path.isfile(os.path.join(path, GENERATION_CONFIG_NAME)):
        model.generation_config = GenerationConfig.from_pretrained(path)
    return model


class PeftAdapters:
    """LoRA adapters on one base, by PEFT name (one per adapter version): loaded on first use, at most
    `capacity` held (adapters.Lru; a new one is loaded before the one it evicts is deleted, so PEFT
    never holds zero), one active per forward; the base alone runs with adapters disabled."""

    def __init__(self, model, capacity: int):
        self.model, self.lru = model, adapterslib.Lru(capacity)
        self._keys: dict[str, str] = {}   # adapter name -> its PEFT adapter name
        self._active: str | None = None

    @staticmethod
    def _key(ref: adapterslib.AdapterRef) -> str:
        return f"{ref.name}__{ref.uid}".replace(".", "_")   # PEFT names are module keys: no '.'

    def begin(self, ref: adapterslib.AdapterRef | None) -> None:
        if ref is None:
            return
        key = self._key(ref)
        load, out = self.lru.use(ref.name, ref.uid)
        if load:
            try:
                self._load(ref.path, key)
            except Exception as e:  # noqa: BLE001 - any load failure: this adapter is refused, the others serve
                self.lru.forget(ref.name)
                raise RuntimeError(f"adapter {ref.name} could not be loaded from {ref.path}: "
                                   f"{type(e).__name__}: {e}") from None
        for name in out:
            old = self._keys.pop(name, None)
            if old is not None and old != key:
                self.model.delete_adapter(old)
                self._active = None if self._active == old else self._active
        self._keys[ref.name] = key
        if self._active != key:
            self.model.set_adapter(key)
            self._active = key

    def _load(self, path: str, key: str) -> None:
        from peft import PeftModel

        if isinstance(self.model, PeftModel):
            self.model.load_adapter(path, adapter_name=key)
        else:   # the first adapter wraps the base in place (its layers get LoRA branches)
            self.model = PeftModel.from_pretrained(self.model, path, adapter_name=key)
        self.model.eval()
        self._active = None

    def forward_context(self, ref: adapterslib.AdapterRef | None):
        if ref is None and self._keys:
            return self.model.disable_adapter()
        return contextlib.nullcontext()

    @property
    def loaded(self) -> list[str]:
        """Adapter names held, least recently used first."""
        return self.lru.names


def load(path: str) -> Loaded:
    """Tokenizer and model from a local export, in eval mode: CPU fp32 without a GPU, bf16 on CUDA."""
    import torch
    from transformers import AutoTokenizer

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = load_causal_lm(path, dtype).to(device).eval()
    eos = model.generation_config.eos_token_id
    eos = tokenizer.eos_token_id if eos is None else eos
    stop_ids = set(eos if isinstance(eos, list) else [eos]) - {None}
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(stop_ids)
    return Loaded(model, tokenizer, stop_ids, pad_id)


class EngineProcess:
    """The parent's side: starts the child, waits until its model is loaded (RuntimeError naming the
    child's failure otherwise), then submits requests to it from any event loop."""

    def __init__(self, path: str, max_batch_size: int, max_adapters: int = 0):
        to_child_r, to_child_w = os.pipe()
        from_child_r, from_child_w = os.pipe()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "tpuft_workload.engine_process", "--path", path,
             "--max-batch-size", str(max_batch_size), "--max-adapters", str(max_adapters),
             "--requests-fd", str(to_child_r),
             "--events-fd", str(from_child_w)],
            pass_fds=(to_child_r, from_child_w), env=env)
        os.close(to_child_r)     # the child's ends: closed here, so either side reads EOF when the other goes
        os.close(from_child_w)
        self._send_conn = Connection(to_child_w, readable=False)
        self._events = Connection(from_child_r, writable=False)
        self._send_lock, self._lock = threading.Lock(), threading.Lock()
        self._ids = itertools.count(1)
        self._pending: dict[int, object] = {}   # id -> emit
        self.failure: str | None = None
        first = self._recv_first()
        if isinstance(first, EngineError):
            self.close()
            raise RuntimeError(f"the engine process could not load {path}: {first.message}")
        self.ready: Ready = first
        threading.Thread(target=self._read, name="tpuft-engine-events", daemon=True).start()

    def _recv_first(self):
        try:
            return self._events.recv()[1]
        except EOFError:
            return EngineError(f"it exited with code {self._proc.wait()} before loading the model (its log says why)")

    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def returncode(self) -> int | None:
        return self._proc.poll()

    @property
    def continuous(self) -> bool:
        return self.ready.continuous

    def submit(self, ids: list[int], budget: int, sampling: batching.Sampling, stops: tuple[str, ...],
               stream: bool, adapter: adapterslib.AdapterRef | None = None) -> batching.Generation:
        """Queue one request in the child (with `adapter` on the base, None: the base alone); call
        from the event loop its client awaits on."""
        emit, events = batching.event_queue()
        rid = next(self._ids)
        with self._lock:
            self._pending[rid] = emit
        self._send((SUBMIT, rid, ids, budget, sampling, stops, stream or bool(stops), adapter))
        return batching.Generation(lambda: self._cancel(rid), events, len(ids))

    def batch_sizes(self) -> list[int]:
        """The child batcher's batch_sizes so far (for tests and benchmarks)."""
        return self._stats()["batch_sizes"]

    def stats(self) -> dict:
        """The child's batch_sizes, each batch's adapter name (None: the base) and the adapters it holds."""
        return self._stats()

    def _stats(self) -> dict:
        done, got = threading.Event(), []
        rid = next(self._ids)
        with self._lock:
            self._pending[rid] = lambda sizes: (got.append(sizes), done.set())
        self._send((STATS, rid))
        if not done.wait(STATS_TIMEOUT_S):
            raise RuntimeError(f"the engine process did not answer within {STATS_TIMEOUT_S:.0f} s")
        if isinstance(got[0], BaseException):
            raise got[0]
        return got[0]

    def close(self, timeout_s: float = 10.0) -> None:
        """Closing the pipe ends the child; it is killed if it has not gone within timeout_s."""
        self._send_conn.close()
        try:
            self._proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()

    def _send(self, message: tuple) -> None:
        if self.failure:
            raise RuntimeError(self.failure)
        try:
            with self._send_lock:
                self._send_conn.send(message)
        except OSError as e:   # the child is gone; _read says why once it sees the EOF
            raise RuntimeError(self.failure or f"the engine process is gone ({e})") from None

    def _cancel(self, rid: int) -> None:
        with self._lock:
            open_ = self._pending.pop(rid, None) is not None
        if open_ and not self.failure:
            try:
                self._send((CANCEL, rid))
            except RuntimeError:
                pass

    def _read(self) -> None:
        while True:
            try:
                rid, event = self._events.recv()
            except (EOFError, OSError):
                break
            done = isinstance(event, (batching.Finished, EngineError, dict))
            with self._lock:
                emit = self._pending.pop(rid, None) if done else self._pending.get(rid)
            if emit is not None:
                emit(RuntimeError(event.message) if isinstance(event, EngineError) else event)
        self.failure = f"the engine process exited with code {self._proc.wait()}"
        with self._lock:
            left, self._pending = list(self._pending.values()), {}
        for emit in left:
            emit(RuntimeError(self.failure))


def serve_child(path: str, max_batch_size: int, requests: Connection, events: Connection,
                max_adapters: int = 0) -> int:
    """The child's side: load the model, then feed the parent's requests to one Batcher until the
    parent's pipe closes."""
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    send_lock = threading.Lock()

    def send(rid, event) -> None:
        with send_lock:
            events.send((rid, event))
    try:
        loaded = load(path)
        peft = PeftAdapters(loaded.model, max_adapters) if max_adapters else None
        batcher = batching.Batcher(loaded.model, loaded.tokenizer, loaded.stop_ids, loaded.pad_id, max_batch_size,
                                   adapters=peft)
    except Exception as e:  # noqa: BLE001 - the parent raises it, naming the export
        send(None, EngineError(f"{type(e).__name__}: {e}"))
        return 1
    send(None, Ready(loaded.model.config, frozenset(loaded.stop_ids), loaded.pad_id, batcher.continuous))
    jobs: dict[int, batching.Job] = {}
    while True:
        try:
            kind, rid, *rest = requests.recv()
        except EOFError:   # the replica closed its end or died
            return 0
        if kind == SUBMIT:
            ids, budget, sampling, stops, incremental, adapter = rest
            jobs[rid] = batching.Job(ids, budget, sampling, stops, incremental, _emitter(rid, jobs, send),
                                     adapter=adapter)
            batcher.put(jobs[rid])
        elif kind == CANCEL and rid in jobs:
            jobs.pop(rid).cancelled.set()
        elif kind == STATS:
            send(rid, {"batch_sizes": list(batcher.batch_sizes),
                       "groups": [g[0] if g else None for g in batcher.groups],
                       "adapters": peft.loaded if peft else []})


def _emitter(rid: int, jobs: dict, send):
    def emit(event) -> None:
        if isinstance(event, BaseException):
            event = EngineError(str(event) or type(event).__name__)
        if isinstance(event, (batching.Finished, EngineError)):
            jobs.pop(rid, None)
        send(rid, event)
    return emit


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="the transformers engine's model process (started by the Serve replica)")
    ap.add_argument("--path", required=True)
    ap.add_argument("--max-batch-size", type=int, required=True)
    ap.add_argument("--max-adapters", type=int, default=0,
                    help="LoRA adapters held on the base at once (0: no adapters; the model as it is)")
    ap.add_argument("--requests-fd", type=int, required=True)
    ap.add_argument("--events-fd", type=int, required=True)
    a = ap.parse_args(argv)
    return serve_child(a.path, a.max_batch_size, Connection(a.requests_fd, writable=False),
                       Connection(a.events_fd, readable=False), a.max_adapters)


if __name__ == "__main__":
    # run as the package's module, not as __main__: what it sends pickles under its importable name
    from tpuft_workload import engine_process

    sys.exit(engine_process.main())
