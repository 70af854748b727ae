"""The Ray Serve application of the `transformers` engine: the fine-tuned model's Hugging Face export
behind an OpenAI-compatible `/v1/models` and `/v1/chat/completions` (tpuft_workload.chat_api).

The RayService's serveConfigV2 names it by import path and passes `args` (tpuft.constants.ServeArg):

    applications:
    - name: llm                                   # SERVE_APP_NAME
      import_path: tpuft_workload.serve:build_app # SERVE_TRANSFORMERS_IMPORT_PATH
      route_prefix: /                             # SERVE_ROUTE_PREFIX
      args: {model_source: /path/to/export, model_id: my-model, max_model_len: 2048, max_tokens_default: 64}

build_app validates the args where the application is built (the head) and fails naming the arg; the
replica (ChatDeployment, SERVE_DEPLOYMENT_NAME) loads tokenizer and model once, in eval mode: CPU fp32
without a GPU, bf16 on CUDA. No TPU path: vLLM's TPU engine (Ray Serve LLM) is the way to serve
on a slice; this engine is for CPU pods and local runs. One replica
generates one request at a time (a lock): concurrent requests queue rather than share the cores.
"""
# No `from __future__ import annotations` here: FastAPI reads the handlers' annotations (Request)
# at runtime, and through serve.ingress's class wrapping string annotations are not resolved, so
# the body would be taken for a query parameter (422).
import asyncio
import json
import threading
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from ray import serve

from tpuft.constants import (SERVE_CHAT_PATH, SERVE_DEPLOYMENT_NAME, SERVE_MODELS_PATH, SERVE_ROUTE_PREFIX,
                             SERVE_TRANSFORMERS_IMPORT_PATH, ServeArg)
from tpuft_workload import chat_api

DEPLOYMENT_NAME = SERVE_DEPLOYMENT_NAME
ROUTE_PREFIX = SERVE_ROUTE_PREFIX
IMPORT_PATH = SERVE_TRANSFORMERS_IMPORT_PATH
MAX_TOKENS_DEFAULT = 64
EXPORT_HINT = ("it must be the Hugging Face export a TPUFinetune's training wrote (status.training.exportedModel): "
               "check that training succeeded and exported there")


class ServeArgsError(ValueError):
    """The application's args cannot be used; the message names the arg and what to give instead."""


@dataclass(frozen=True)
class ServeArgs:
    model_source: str
    model_id: str
    max_model_len: int | None   # None: the model config's max_position_embeddings
    max_tokens_default: int


def _positive_int(args: dict, key: ServeArg, default: int | None) -> int | None:
    value = args.get(key.value, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ServeArgsError(f"serve arg {key.value}={value!r}: must be a positive integer")
    return value


def _check_export(model_source: str) -> None:
    """A local export folder must hold config.json and weights; a URI (gs://...) is checked by the
    replica when it downloads it."""
    if "://" in model_source:
        return
    path = Path(model_source)
    if not path.is_dir():
        raise ServeArgsError(f"serve arg {ServeArg.MODEL_SOURCE.value}: {model_source} is not a folder; {EXPORT_HINT}")
    missing = [what for what, globs in (("config.json", ["config.json"]),
                                        ("weights (*.safetensors)", ["*.safetensors", "*.bin"]))
               if not any(next(path.glob(g), None) for g in globs)]
    if missing:
        raise ServeArgsError(f"serve arg {ServeArg.MODEL_SOURCE.value}: {model_source} has no "
                             f"{' and no '.join(missing)}; {EXPORT_HINT}")


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
    return ServeArgs(model_source=args[ServeArg.MODEL_SOURCE.value], model_id=args[ServeArg.MODEL_ID.value],
                     max_model_len=_positive_int(args, ServeArg.MAX_MODEL_LEN, None),
                     max_tokens_default=_positive_int(args, ServeArg.MAX_TOKENS_DEFAULT, MAX_TOKENS_DEFAULT))


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
    """Tokenizer + model from the export, and one generate() call per request (serialized)."""

    def __init__(self, args: ServeArgs):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from tpuft_workload.model import _local_copy

        path = _local_copy(args.model_source)   # gs://... -> a local copy, once per host
        _check_export(path)                     # the replica's host may not be the one build_app ran on
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(self.device).eval()
        self.max_model_len = model_len(args.max_model_len, self.model.config)
        eos = self.model.generation_config.eos_token_id
        eos = self.tokenizer.eos_token_id if eos is None else eos
        self.stop_ids = set(eos if isinstance(eos, list) else [eos]) - {None}
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else min(self.stop_ids)
        self._lock = threading.Lock()

    def generate(self, ids: list[int], budget: int, temperature: float, top_p: float, seed: int | None) -> list[int]:
        """Generated token ids (a final stop token included). temperature 0 is greedy; a seed makes a
        sampled completion reproducible without touching the process's global random state."""
        import torch
        from transformers import GenerationConfig

        sample = temperature > 0
        config = GenerationConfig(max_new_tokens=budget, do_sample=sample, use_cache=True,
                                  eos_token_id=sorted(self.stop_ids), pad_token_id=self.pad_id,
                                  **({"temperature": temperature, "top_p": top_p, "top_k": 0} if sample else {}))
        inputs = torch.tensor([ids], device=self.device)
        with self._lock, torch.no_grad(), torch.random.fork_rng(devices=[]):
            if seed is not None:
                torch.manual_seed(seed)
            out = self.model.generate(inputs, attention_mask=torch.ones_like(inputs), generation_config=config)
        return out[0, len(ids):].tolist()

    def chat(self, req: chat_api.ChatRequest, model_id: str, default_max_tokens: int) -> chat_api.ChatCompletion:
        ids = chat_api.prompt_ids(self.tokenizer, req.messages)
        requested = req.max_tokens or req.max_completion_tokens or default_max_tokens
        budget = chat_api.completion_budget(len(ids), requested, self.max_model_len)
        generated = self.generate(ids, budget, req.temperature, req.top_p, req.seed)
        text = self.tokenizer.decode(generated, skip_special_tokens=True).strip()
        return chat_api.completion(model_id, text, len(ids), generated, self.stop_ids)


def _error(e: chat_api.ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


api = FastAPI(title="tpufinetune", docs_url=None, redoc_url=None)


@serve.deployment(name=DEPLOYMENT_NAME, ray_actor_options={"num_cpus": 1})
@serve.ingress(api)
class ChatDeployment:
    def __init__(self, args: ServeArgs):
        self.args = args
        self.engine = Engine(args)

    @api.get(SERVE_MODELS_PATH)
    def models(self) -> dict:
        return chat_api.models_list(self.args.model_id)

    @api.get("/healthz")
    def healthz(self) -> dict:
        return {"status": "ok", "model": self.args.model_id}

    @api.post(SERVE_CHAT_PATH)
    async def chat_completions(self, request: Request) -> JSONResponse:
        try:
            body = json.loads(await request.body() or b"null")
        except ValueError as e:
            return _error(chat_api.ApiError(400, f"the request body is not JSON ({e})", "invalid_json"))
        try:
            req = chat_api.parse_request(body)
            chat_api.check_model(req.model, self.args.model_id)
            # generate() blocks on the CPU: off the event loop, so /v1/models still answers meanwhile
            result = await asyncio.to_thread(self.engine.chat, req, self.args.model_id, self.args.max_tokens_default)
        except chat_api.ApiError as e:
            return _error(e)
        return JSONResponse(result.model_dump())


def build_app(args: dict) -> serve.Application:
    """The application builder serveConfigV2's import_path names; raises ServeArgsError for bad args."""
    return ChatDeployment.bind(parse_args(args))
