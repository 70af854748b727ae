"""The OpenAI-compatible chat subset tpuft_workload.serve answers: request and response models,
prompt building, the completion-token budget and the error body.

Pure functions over a tokenizer and plain values, so every rule here is unit-tested without a
model or Ray Serve. What is supported: `/v1/models` and non-streaming `/v1/chat/completions` with
`model`, `messages`, `max_tokens` (or `max_completion_tokens`), `temperature`, `top_p`, `seed`, `n=1`.
Other OpenAI fields are accepted and ignored, as many servers do, so stock clients work.
"""
from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

OWNED_BY = "tpufinetune"
FINISH_STOP, FINISH_LENGTH = "stop", "length"


class ApiError(Exception):
    """An HTTP error with OpenAI's body: {"error": {"message", "type", "code", "param"}}."""

    def __init__(self, status: int, message: str, code: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param

    def body(self) -> dict:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": kind, "code": self.code, "param": self.param}}


class Message(BaseModel):
    role: Literal["system", "user", "assistant"]
    content: str


class ChatRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)  # newer clients' name for max_tokens
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)       # OpenAI's default; 0 is greedy
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = None
    n: int = 1
    stream: bool = False


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class Choice(BaseModel):
    index: int
    message: Message
    finish_reason: Literal["stop", "length"]


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[Choice]
    usage: Usage


def parse_request(body: object) -> ChatRequest:
    """The JSON body -> ChatRequest, or ApiError 400 naming the first field at fault."""
    try:
        req = ChatRequest.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        field = ".".join(str(p) for p in err["loc"]) or "body"
        raise ApiError(400, f"{field}: {err['msg']}", "invalid_value", field) from None
    if req.stream:
        raise ApiError(400, "streaming is not supported by the transformers engine; send \"stream\": false",
                       "unsupported_value", "stream")
    if req.n != 1:
        raise ApiError(400, f"n={req.n}: the transformers engine returns exactly one choice (n=1)",
                       "unsupported_value", "n")
    return req


def check_model(requested: str, served: str) -> None:
    if requested != served:
        raise ApiError(404, f"the model '{requested}' does not exist here; this server serves '{served}' "
                            "(GET /v1/models lists it)", "model_not_found", "model")


def models_list(model_id: str) -> dict:
    return {"object": "list", "data": [{"id": model_id, "object": "model", "owned_by": OWNED_BY}]}


def fallback_prompt(messages: list[Message]) -> str:
    """For a tokenizer without a chat template: one "role: content" line per message, then
    "assistant:" for the model to continue."""
    return "".join(f"{m.role}: {m.content}\n" for m in messages) + "assistant:"


def prompt_ids(tokenizer, messages: list[Message]) -> list[int]:
    """Token ids of the prompt: the tokenizer's chat template when it has one (its text carries the
    special tokens it wants, so none are added again), else fallback_prompt with the tokenizer's
    usual special tokens (a Llama-style BOS)."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([m.model_dump() for m in messages], add_generation_prompt=True,
                                             tokenize=False)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return list(tokenizer(fallback_prompt(messages), add_special_tokens=True)["input_ids"])


def completion_budget(prompt_tokens: int, requested: int, max_model_len: int) -> int:
    """Completion tokens to generate: what was asked, capped so prompt + completion <= max_model_len."""
    room = max_model_len - prompt_tokens
    if room < 1:
        raise ApiError(400, f"the prompt is {prompt_tokens} tokens and max_model_len is {max_model_len}: "
                            "no room for a completion; shorten the messages", "context_length_exceeded",
                       "messages")
    return min(requested, room)


def finish_reason(generated: list[int], stop_ids: set[int]) -> str:
    """"stop" when the model ended on a stop token (EOS), else "length" (the budget ran out)."""
    return FINISH_STOP if generated and generated[-1] in stop_ids else FINISH_LENGTH


def completion(model_id: str, text: str, prompt_tokens: int, generated: list[int], stop_ids: set[int],
               now: float | None = None) -> ChatCompletion:
    """The chat.completion object; completion_tokens counts every generated token, a final EOS included."""
    return ChatCompletion(
        id=f"chatcmpl-{uuid.uuid4().hex}", created=int(time.time() if now is None else now), model=model_id,
        choices=[Choice(index=0, message=Message(role="assistant", content=text),
                        finish_reason=finish_reason(generated, stop_ids))],
        usage=Usage(prompt_tokens=prompt_tokens, completion_tokens=len(generated),
                    total_tokens=prompt_tokens + len(generated)))
