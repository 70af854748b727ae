"""The Ray Serve application of the `transformers` engine: the fine-tuned model's Hugging Face export
behind an OpenAI-compatible `/v1/models`, `/v1/chat/completions` and `/v1/completions`, streamed as
server-sent events on `"stream": true` (tpuft_workload.chat_api).

The RayService's serveConfigV2 names it by import path and passes `args` (tpuft.api.constants.ServeArg):

    applications:
    - name: llm                                   # SERVE_APP_NAME
      import_path: tpuft_workload.serve:build_app # SERVE_TRANSFORMERS_IMPORT_PATH
      route_prefix: /                             # SERVE_ROUTE_PREFIX
      args: {model_source: /path/to/export, model_id: my-model, max_model_len: 2048, max_batch_size: 16}

With adapters_root (a folder or gs:// URI of published LoRA adapters, tpuft_workload.adapters) the
model is a base that serves adapters side by side: /v1/models lists `model_id` and
`model_id:<adapter>` for every published adapter (the root is listed again on each /v1/models call
and whenever an unknown adapter is asked for, so a newly published one answers at once), and a
request whose model is `model_id:<adapter>` is generated with that adapter (loaded on first use, at
most max_adapters per replica, default MAX_ADAPTERS_DEFAULT; the least recently used goes), rendered
with the adapter folder's tokenizer and stopped at its generation config's stop ids.

Optional max_tokens_default caps the completion of a request that gives neither max_tokens nor
max_completion_tokens; without it such a request gets the rest of max_model_len, as OpenAI and vLLM do.

build_app validates the args where the application is built (the head) and fails naming the arg; the
replica (ChatDeployment, SERVE_DEPLOYMENT_NAME) loads the tokenizer, and starts the model's own process
(tpuft_workload.engine_process), which loads the model once, in eval mode: CPU fp32 without a GPU,
bf16 on CUDA; the replica's health check fails once that process is gone. No TPU path: vLLM's TPU engine (Ray Serve LLM) is the way to serve
on a slice; this engine is for CPU pods and local runs. A replica generates up to max_batch_size
concurrent requests together (tpuft_workload.batching: a request joins the running batch at its next
step where the model's cache allows, tpuft_workload.rolling); 1 generates them one at a time.

With TPUFT_SERVE_API_KEY (SERVE_API_KEY_ENV, from spec.serve.apiKeySecret) set in the replica's
environment, every /v1/* request needs `Authorization: Bearer <key>` (chat_api.check_api_key); /healthz
stays open. KubeRay's probes do not reach this app: they ask the Serve proxy's own /-/healthz and the
dashboard's health routes.
"""
# No `from __future__ import annotations` here: FastAPI reads the handlers' annotations (Request)
# at runtime, so they must be real classes, not strings.
import asyncio
import json
import os
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve

from tpuft.api.constants import (SERVE_API_KEY_ENV, SERVE_CHAT_PATH, SERVE_COMPLETIONS_PATH, SERVE_DEPLOYMENT_NAME,
                             SERVE_MODELS_PATH, SERVE_ROUTE_PREFIX, SERVE_TRANSFORMERS_IMPORT_PATH, ServeArg)
from tpuft_workload import adapters, batching, chat_api, engine_process, lora
from tpuft_workload.tiny_chat import BUILTIN_CHAT_MODEL

DEPLOYMENT_NAME = SERVE_DEPLOYMENT_NAME
ROUTE_PREFIX = SERVE_ROUTE_PREFIX
IMPORT_PATH = SERVE_TRANSFORMERS_IMPORT_PATH
MAX_BATCH_SIZE_DEFAULT = 16   # bench/serve_latency.py measures it beside max_batch_size 1 (docs/performance.md)
# Requests a replica accepts at once (Ray Serve's default is 5): above max_batch_size, so the next
# batch is already queued in the replica when one ends.
MAX_ONGOING_REQUESTS = 64
MAX_ADAPTERS_DEFAULT = 8      # spec.serve.adapters.maxPerReplica's default
MAX_ADAPTERS_LIMIT = 64
KEYED_PREFIX = "/v1/"   # the OpenAI routes, behind the API key when one is set
EXPORT_HINT = ("it must be the Hugging Face export a TPUFinetune's training wrote (status.training.exportedModel): "
               "check that training succeeded and exported there")


class ServeArgsError(ValueError):
    """The application's args cannot be used; the message names the arg and what to give instead."""


@dataclass(frozen=True)
class ServeArgs:
    model_source: str
    model_id: str
    max_model_len: int | None   # None: the model config's max_position_embeddings
    max_tokens_default: int | None = None   # None: a request without max_tokens gets the rest of the context
    max_batch_size: int = MAX_BATCH_SIZE_DEFAULT
    adapters_root: str | None = None   # None: the model alone, no adapters
    max_adapters: int = MAX_ADAPTERS_DEFAULT


def _positive_int(args: dict, key: ServeArg, default: int | None, most: int | None = None) -> int | None:
    value = args.get(key.value, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ServeArgsError(f"serve arg {key.value}={value!r}: must be a positive integer")
    if most is not None and value > most:
        raise ServeArgsError(f"serve arg {key.value}={value}: give at most {most}")
    return value


def _check_export(model_source: str) -> None:
    """A local export folder must hold config.json and weights, or (spec.training.method: lora) be a
    PEFT adapter folder naming its base; a URI (gs://...) is checked by the replica when it
    downloads it, and builtin:tiny-chat (a base served as it is, training.method none) is the
    folder the image built."""
    if "://" in model_source or model_source == BUILTIN_CHAT_MODEL:
        return
    path = Path(model_source)
    if not path.is_dir():
        raise ServeArgsError(f"serve arg {ServeArg.MODEL_SOURCE.value}: {model_source} is not a folder; {EXPORT_HINT}")
    if lora.is_adapter_folder(model_source):
        _check_adapter(path)
        return
    missing = [what for what, globs in (("config.json", ["config.json"]),
                                        ("weights (*.safetensors)", ["*.safetensors", "*.bin"]))
               if not any(next(path.glob(g), None) for g in globs)]
    if missing:
        raise ServeArgsError(f"serve arg {ServeArg.MODEL_SOURCE.value}: {model_source} has no "
                             f"{' and no '.join(missing)}; {EXPORT_HINT}")


def _check_adapter(path: Path) -> None:
    """An adapter folder: its weights, and a base to load them on (a local base must exist here)."""
    where = f"serve arg {ServeArg.MODEL_SOURCE.value}: {path} is a LoRA adapter folder"
    if not any(next(path.glob(g), None) for g in ("adapter_model.safetensors", "adapter_model.bin")):
        raise ServeArgsError(f"{where} without adapter_model.safetensors; {EXPORT_HINT}")
    base = lora.base_of(str(path))
    if not base:
        raise ServeArgsError(f"{where} whose {lora.ADAPTER_CONFIG} names no base_model_name_or_path; {EXPORT_HINT}")
    if base.startswith("/") and not Path(base).is_dir():
        raise ServeArgsError(f"{where} on base {base}, which is not a folder here; {EXPORT_HINT}")


def parse_args(args: dict) -> ServeArgs:
    """Serve config args -> ServeArgs; ServeArgsError names the first arg at fault."""
    if not isinstance(args, dict):
        raise ServeArgsError(f"serve args must be a mapping, got {type(args).__name__}")
    known = {a.value for a in ServeArg}
    unknown = sorted(set(args) - known)
    if unknown:
        raise ServeArgsError(f"unknown serve arg(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    for key in (ServeArg.MODEL_SOURCE, ServeArg.MODEL_ID):
        value = args.get(key.value)
        if not isinstance(value, str) or not value.strip():
            raise ServeArgsError(f"serve arg {key.value} is required (a non-empty string), got {value!r}")
    _check_export(args[ServeArg.MODEL_SOURCE.value])
    root = args.get(ServeArg.ADAPTERS_ROOT.value)
    if root is not None and (not isinstance(root, str) or not root.strip()):
        raise ServeArgsError(f"serve arg {ServeArg.ADAPTERS_ROOT.value} must be a folder or gs:// URI, got {root!r}")
    if root and lora.is_adapter_folder(args[ServeArg.MODEL_SOURCE.value]):
        raise ServeArgsError(f"serve arg {ServeArg.ADAPTERS_ROOT.value}: adapters are served on a full model, but "
                             f"{ServeArg.MODEL_SOURCE.value} {args[ServeArg.MODEL_SOURCE.value]} is a LoRA adapter "
                             "folder; serve its base (spec.training.method none or full) instead")
    return ServeArgs(model_source=args[ServeArg.MODEL_SOURCE.value], model_id=args[ServeArg.MODEL_ID.value],
                     max_model_len=_positive_int(args, ServeArg.MAX_MODEL_LEN, None),
                     max_tokens_default=_positive_int(args, ServeArg.MAX_TOKENS_DEFAULT, None),
                     max_batch_size=_positive_int(args, ServeArg.MAX_BATCH_SIZE, MAX_BATCH_SIZE_DEFAULT,
                                                  most=MAX_ONGOING_REQUESTS),
                     adapters_root=root or None,
                     max_adapters=_positive_int(args, ServeArg.MAX_ADAPTERS, MAX_ADAPTERS_DEFAULT,
                                                most=MAX_ADAPTERS_LIMIT))


def model_len(requested: int | None, config) -> int:
    """The effective max_model_len: the arg, at most what the model's positions allow."""
    limit = getattr(config.get_text_config(), "max_position_embeddings", None)
    if requested is None:
        if limit is None:
            raise ServeArgsError(f"serve arg {ServeArg.MAX_MODEL_LEN.value} is required: the model's config "
                                 "has no max_position_embeddings")
        return limit
    if limit is not None and requested > limit:
        raise ServeArgsError(f"serve arg {ServeArg.MAX_MODEL_LEN.value}={requested} exceeds the model's "
                             f"max_position_embeddings ({limit}); give at most {limit}")
    return requested


class Engine:
    """The tokenizer here, the model (a LoRA export: its base with the adapters merged; with
    adapters_root: the base, adapters applied per request) in its own process
    (tpuft_workload.engine_process), which generates requests in batches."""

    def __init__(self, args: ServeArgs):
        from transformers import AutoTokenizer

        from tpuft_workload.model import _local_copy

        path = _local_copy(args.model_source)   # gs://... -> a local copy, once per host
        _check_export(path)                     # the replica's host may not be the one build_app ran on
        self.model_id = args.model_id
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.process = engine_process.EngineProcess(path, args.max_batch_size,
                                                    args.max_adapters if args.adapters_root else 0)
        self.max_model_len = model_len(args.max_model_len, self.process.ready.config)
        self.max_tokens_default = args.max_tokens_default
        self.adapters = (adapters.Registry(args.adapters_root, self.tokenizer, self.process.ready.stop_ids)
                         if args.adapters_root else None)

    def adapter_names(self) -> list[str]:
        """The published adapters (the adapters root listed now); [] without adapters."""
        return self.adapters.refresh() if self.adapters else []

    def model_ids(self) -> list[str]:
        """The base's id, then each published adapter's."""
        return [self.model_id, *(chat_api.adapter_model_id(self.model_id, n) for n in self.adapter_names())]

    def resolve(self, requested: str) -> tuple[object, adapters.AdapterRef | None]:
        """(the tokenizer, the adapter or None for the base) a request's model id asks for; ApiError 404
        model_not_found when this server does not serve it."""
        if requested == self.model_id:
            return self.tokenizer, None
        name = chat_api.adapter_of(requested, self.model_id) if self.adapters else None
        found = self.adapters.resolve(name) if name else None
        if found is None:
            raise chat_api.model_not_found(requested, self.model_ids())
        ref, tokenizer = found
        return tokenizer, ref

    def submit(self, req: chat_api.GenerationRequest,
               resolved: tuple[object, adapters.AdapterRef | None] | None = None) -> batching.Generation:
        """Queue one request (call it on the event loop that reads the answer), with what `resolve`
        gave for its model id (resolved here when None); ApiError 404 for a model not served here,
        400 when its prompt leaves no room for a completion or the chat template refuses its messages."""
        tokenizer, adapter = resolved or self.resolve(req.model)
        ids = chat_api.request_ids(tokenizer, req)
        budget = chat_api.completion_budget(len(ids), req.requested_tokens(self.max_tokens_default),
                                            self.max_model_len,
                                            "messages" if isinstance(req, chat_api.ChatRequest) else "prompt")
        return self.process.submit(ids, budget, batching.Sampling(req.temperature, req.top_p, req.seed), req.stop,
                                   req.stream, adapter)

    async def answer(self, req: chat_api.GenerationRequest) -> chat_api.Answer:
        """The whole answer to one request."""
        return await self.submit(req).answer()

    def check_health(self) -> None:
        """Raises once the model's process is gone, so Serve replaces the replica."""
        if self.process.failure:
            raise RuntimeError(self.process.failure)

    def close(self) -> None:
        self.process.close()


def _error(e: chat_api.ApiError) -> JSONResponse:
    # RFC 6750: a 401 names the scheme the client should use
    headers = {"WWW-Authenticate": "Bearer"} if e.status == 401 else None
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


async def _events(generation: batching.Generation, chunks: chat_api.Chunks):
    """The server-sent events of a streamed answer; an engine failure after the 200 is an error event."""
    yield chunks.start()
    try:
        async for event in generation:
            yield chunks.end(event) if isinstance(event, chat_api.Answer) else chunks.text(event)
    except Exception as e:  # noqa: BLE001 - the status line is gone: the client reads the error as an event
        yield chunks.error(chat_api.ApiError(500, f"generation failed: {e}", None))


def replica_api_key() -> str:
    """The API key as the replica's pod has it; "" leaves /v1/* open. Surrounding whitespace is
    dropped: HTTP trims a header value, so a key file's trailing newline could never be matched."""
    return os.environ.get(SERVE_API_KEY_ENV, "").strip()


def make_api(engine: Engine, args: ServeArgs, api_key: str) -> FastAPI:
    """The replica's HTTP app over a loaded engine; /v1/* answer only with `api_key` when it is set."""
    api = FastAPI(title="tpufinetune", docs_url=None, redoc_url=None)

    if api_key:
        @api.middleware("http")
        async def authorize(request: Request, call_next):
            if request.url.path.startswith(KEYED_PREFIX):
                try:
                    chat_api.check_api_key(request.headers.get("authorization"), api_key)
                except chat_api.ApiError as e:
                    return _error(e)
            return await call_next(request)

    @api.get(SERVE_MODELS_PATH)
    def models() -> dict:
        return chat_api.models_list(args.model_id, engine.adapter_names())

    @api.get("/healthz")
    def healthz() -> dict:
        return {"status": "ok", "model": args.model_id}

    async def generate(request: Request, endpoint: chat_api.Endpoint,
                       model: type[chat_api.GenerationRequest]):
        try:
            body = json.loads(await request.body() or b"null")
        except ValueError as e:
            return _error(chat_api.ApiError(400, f"the request body is not JSON ({e})", "invalid_json"))
        try:
            req = chat_api.parse_request(body, model)
            # an adapter may be listed, downloaded or its tokenizer read first: off the event loop
            resolved = await asyncio.to_thread(engine.resolve, req.model) if req.model != args.model_id else None
            generation = engine.submit(req, resolved)   # the prompt is checked here, before any answer starts
            if req.stream:
                return StreamingResponse(_events(generation, chat_api.Chunks(endpoint, req.model,
                                                                            req.include_usage)),
                                         media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
            answer = await generation.answer()
        except chat_api.ApiError as e:
            return _error(e)
        except Exception as e:  # noqa: BLE001 - the engine failed: OpenAI's 500 body, not a bare one
            return _error(chat_api.ApiError(500, f"generation failed: {e}", None))
        return JSONResponse(chat_api.response(endpoint, req.model, answer))

    @api.post(SERVE_CHAT_PATH)
    async def chat_completions(request: Request):
        return await generate(request, chat_api.Endpoint.CHAT, chat_api.ChatRequest)

    @api.post(SERVE_COMPLETIONS_PATH)
    async def completions(request: Request):
        return await generate(request, chat_api.Endpoint.TEXT, chat_api.CompletionRequest)

    return api


@serve.deployment(name=DEPLOYMENT_NAME, ray_actor_options={"num_cpus": 1}, max_ongoing_requests=MAX_ONGOING_REQUESTS)
@serve.ingress()   # no app yet: Serve calls __serve_build_asgi_app__ in the replica, after __init__
class ChatDeployment:
    def __init__(self, args: ServeArgs):
        self.args = args
        self.engine = Engine(args)
        self.api_key = replica_api_key()   # read here, in the replica: the env is the serving pod's

    def __serve_build_asgi_app__(self) -> FastAPI:
        return make_api(self.engine, self.args, self.api_key)

    def check_health(self) -> None:
        self.engine.check_health()


def build_app(args: dict) -> serve.Application:
    """The application builder serveConfigV2's import_path names; raises ServeArgsError for bad args."""
    return ChatDeployment.bind(parse_args(args))
