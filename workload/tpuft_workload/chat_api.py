"""The OpenAI-compatible subset tpuft_workload.serve answers: request models, prompt building, the
completion-token budget, stop sequences, the response and stream-chunk bodies and the error body.

Pure functions over a tokenizer and plain values, so every rule here is unit-tested without a
model or Ray Serve. What is supported: `/v1/models`, `/v1/chat/completions` (messages; text content
parts are joined; role "developer" is a system message) and `/v1/completions` (one prompt string),
each with `max_tokens` (or `max_completion_tokens`; without either, the server's default if it
has one, else the rest of the context, as OpenAI and vLLM do), `temperature`, `top_p`, `seed`,
`stop` (a string or up to 4), `n=1`, and `stream` (server-sent events in OpenAI's chunk format,
with `stream_options.include_usage`). The answer's text is the generated tokens decoded, nothing
stripped (a completion's leading space stays), cut before a stop sequence. Fields that would change
what the answer holds (`n` > 1, `logprobs`, `echo`, `suffix`, `best_of` > 1) are refused with a 400
naming them; any other OpenAI field is accepted and ignored, as many servers do, so stock clients
work. With an API key set (spec.serve.apiKeySecret), a request without `Authorization: Bearer <key>`
gets OpenAI's 401.
"""
from __future__ import annotations

import enum
import hmac
import json
import re
import time
import uuid
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

OWNED_BY = "tpufinetune"
FINISH_STOP, FINISH_LENGTH = "stop", "length"
MAX_STOP_SEQUENCES = 4   # OpenAI's limit
INT64 = 2 ** 63          # OpenAI's seed is an int64; torch's generators take any
# A streamed text's tail that may still change: trailing whitespace (a tokenizer's clean-up drops the
# space before punctuation that follows it: "a ." -> "a.") and half a character (U+FFFD from a split
# UTF-8 byte sequence).
_UNSETTLED_TAIL = re.compile(r"[\s\ufffd]+\Z")
SSE_DONE = "data: [DONE]\n\n"
# OpenAI's own 401 messages (code null for a missing key, "invalid_api_key" for a wrong one), ending in
# where this server's key is instead of OpenAI's dashboard. Neither quotes the key sent.
KEY_WHERE = "the key is in the Secret that the TPUFinetune's spec.serve.apiKeySecret names (tpuft chat sends it)"
MISSING_KEY = ("You didn't provide an API key. You need to provide your API key in an Authorization header "
               f"using Bearer auth (i.e. Authorization: Bearer YOUR_KEY); {KEY_WHERE}.")
INCORRECT_KEY = f"Incorrect API key provided; {KEY_WHERE}."


class ApiError(Exception):
    """An HTTP error with OpenAI's body: {"error": {"message", "type", "code", "param"}}."""

    def __init__(self, status: int, message: str, code: str | None, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param

    def body(self) -> dict:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": kind, "code": self.code, "param": self.param}}


class Endpoint(enum.Enum):
    """The two generation routes: their objects' names and id prefixes (OpenAI's)."""
    CHAT = ("chat.completion", "chat.completion.chunk", "chatcmpl-")
    TEXT = ("text_completion", "text_completion", "cmpl-")

    def __init__(self, obj: str, chunk: str, id_prefix: str):
        self.obj, self.chunk, self.id_prefix = obj, chunk, id_prefix


class Message(BaseModel):
    role: Literal["system", "user", "assistant"]
    content: str

    @field_validator("role", mode="before")
    @classmethod
    def _developer_is_system(cls, role: object) -> object:
        return "system" if role == "developer" else role   # OpenAI's newer name for the system message

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts(cls, content: object) -> object:
        """[{"type": "text", "text": ...}, ...] (what SDKs send for multi-part content) -> one string."""
        if not isinstance(content, list):
            return content
        texts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
        if len(texts) != len(content) or not all(isinstance(t, str) for t in texts):
            raise ValueError("only text parts ({\"type\": \"text\", \"text\": \"...\"}) are supported")
        return "\n".join(texts)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


class GenerationRequest(BaseModel):
    """The fields /v1/chat/completions and /v1/completions share."""
    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)  # newer clients' name for max_tokens
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)       # OpenAI's default; 0 is greedy
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=-INT64, lt=INT64)
    stop: tuple[Annotated[str, Field(min_length=1)], ...] = ()
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    logprobs: Any = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, stop: object) -> object:
        if stop is None:
            return ()
        if isinstance(stop, str):
            return (stop,)
        if isinstance(stop, list) and len(stop) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences, got {len(stop)}")
        return stop

    def requested_tokens(self, default: int | None) -> int | None:
        """The completion tokens asked for, else the server's `default`; None: as many as the context allows."""
        return self.max_tokens or self.max_completion_tokens or default

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatRequest(GenerationRequest):
    messages: list[Message] = Field(min_length=1)


class CompletionRequest(GenerationRequest):
    prompt: str
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, prompt: object) -> object:
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            return prompt[0]
        if isinstance(prompt, list):
            raise ValueError("give one prompt string per request (this server returns one choice)")
        return prompt


# (field, is the value refused?, why): each would change the answer's shape, so a silent default is wrong
_REFUSED = (
    ("n", lambda r: r.n != 1, lambda r: f"n={r.n}: the transformers engine returns exactly one choice (n=1)"),
    ("logprobs", lambda r: bool(r.logprobs), lambda r: "logprobs are not returned by the transformers engine; "
                                                       "leave logprobs unset"),
    ("echo", lambda r: getattr(r, "echo", False), lambda r: "echo is not supported; leave it false"),
    ("suffix", lambda r: bool(getattr(r, "suffix", None)), lambda r: "suffix (insertion) is not supported"),
    ("best_of", lambda r: (getattr(r, "best_of", None) or 1) != 1,
     lambda r: f"best_of={r.best_of}: the transformers engine generates one completion (best_of=1)"),
    ("stream_options", lambda r: r.stream_options is not None and not r.stream,
     lambda r: "stream_options is only allowed with \"stream\": true"),
)


def parse_request(body: object, model: type[GenerationRequest] = ChatRequest) -> GenerationRequest:
    """The JSON body -> a ChatRequest (or `model`), or ApiError 400 naming the first field at fault."""
    try:
        req = model.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        field = ".".join(str(p) for p in err["loc"]) or "body"
        raise ApiError(400, f"{field}: {err['msg']}", "invalid_value", field) from None
    for field, refused, why in _REFUSED:
        if refused(req):
            raise ApiError(400, why(req), "unsupported_value", field)
    return req


def check_api_key(authorization: str | None, api_key: str) -> None:
    """Let a request through when no key is set or its Authorization header is "Bearer <api_key>";
    else ApiError 401 (OpenAI's bodies). The comparison takes the same time however much matches."""
    if not api_key:
        return
    scheme, _, sent = (authorization or "").strip().partition(" ")
    sent = sent.strip()
    if scheme.lower() != "bearer" or not sent:
        raise ApiError(401, MISSING_KEY, None)
    if not hmac.compare_digest(sent.encode(), api_key.encode()):
        raise ApiError(401, INCORRECT_KEY, "invalid_api_key")


ADAPTER_SEPARATOR = ":"   # Ray Serve LLM's model id of an adapter: base_model_id:adapter_name


def adapter_model_id(base_id: str, adapter: str) -> str:
    return f"{base_id}{ADAPTER_SEPARATOR}{adapter}"


def adapter_of(requested: str, base_id: str) -> str | None:
    """The adapter name a request's model id asks for on `base_id` (None: not an adapter id of it)."""
    prefix = adapter_model_id(base_id, "")
    return requested[len(prefix):] if requested.startswith(prefix) else None


def model_not_found(requested: str, served: list[str]) -> ApiError:
    listed = ", ".join(f"'{m}'" for m in served)
    return ApiError(404, f"the model '{requested}' does not exist here; this server serves {listed} "
                         "(GET /v1/models lists them)", "model_not_found", "model")


def check_model(requested: str, served: str) -> None:
    if requested != served:
        raise model_not_found(requested, [served])


def models_list(model_id: str, adapters: list[str] = ()) -> dict:
    """/v1/models: the base, then `<base>:<adapter>` for each adapter served on it."""
    ids = [model_id, *(adapter_model_id(model_id, a) for a in adapters)]
    return {"object": "list", "data": [{"id": i, "object": "model", "owned_by": OWNED_BY} for i in ids]}


def fallback_prompt(messages: list[Message]) -> str:
    """For a tokenizer without a chat template: one "role: content" line per message, then
    "assistant:" for the model to continue."""
    return "".join(f"{m.role}: {m.content}\n" for m in messages) + "assistant:"


def prompt_ids(tokenizer, messages: list[Message]) -> list[int]:
    """Token ids of the prompt: the tokenizer's chat template when it has one (its text carries the
    special tokens it wants, so none are added again), else fallback_prompt with the tokenizer's
    usual special tokens (a Llama-style BOS). A conversation the template refuses (its
    raise_exception: Gemma's "System role not supported", roles that do not alternate) is ApiError
    400 quoting the template; a template that does not parse is the server's fault and raises as is."""
    if getattr(tokenizer, "chat_template", None):
        from jinja2.exceptions import TemplateError, TemplateSyntaxError

        try:
            text = tokenizer.apply_chat_template([m.model_dump() for m in messages], add_generation_prompt=True,
                                                 tokenize=False)
        except TemplateSyntaxError:
            raise
        except TemplateError as e:
            raise ApiError(400, f"the model's chat template refuses these messages: {e}", "invalid_value",
                           "messages") from None
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return list(tokenizer(fallback_prompt(messages), add_special_tokens=True)["input_ids"])


def request_ids(tokenizer, req: GenerationRequest) -> list[int]:
    """The prompt's token ids: the chat rendered (prompt_ids), or a completion's text with the
    tokenizer's usual special tokens."""
    if isinstance(req, ChatRequest):
        return prompt_ids(tokenizer, req.messages)
    return list(tokenizer(req.prompt, add_special_tokens=True)["input_ids"])


def completion_budget(prompt_tokens: int, requested: int | None, max_model_len: int,
                      param: str = "messages") -> int:
    """Completion tokens to generate: what was asked (None: all the room there is), capped so
    prompt + completion <= max_model_len."""
    room = max_model_len - prompt_tokens
    if room < 1:
        raise ApiError(400, f"the prompt is {prompt_tokens} tokens and max_model_len is {max_model_len}: "
                            f"no room for a completion; shorten the {param}", "context_length_exceeded", param)
    return room if requested is None else min(requested, room)


def visible(text: str, stops: tuple[str, ...], final: bool) -> tuple[str, bool]:
    """(the part of the completion's decoded `text` a client may see now, whether a stop sequence
    ended it). The text is as generated (OpenAI and vLLM strip nothing either: " Paris" continues
    "The capital is"), cut before the first stop sequence. Until `final`, a tail that could still
    become a stop sequence, or that may still change (_UNSETTLED_TAIL), is held back, so a stream
    never sends what the whole answer would not contain."""
    cuts = [i for i in (text.find(s) for s in stops) if i >= 0]
    if cuts:
        return text[:min(cuts)], True
    if final:
        return text, False
    hold = max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
    return _UNSETTLED_TAIL.sub("", text[:len(text) - hold]), False


@dataclass(frozen=True)
class Answer:
    """What the engine generated for one request."""
    text: str
    finish_reason: str   # FINISH_STOP (EOS or a stop sequence) | FINISH_LENGTH (the budget ran out)
    prompt_tokens: int
    completion_tokens: int   # every generated token, a final EOS included

    def usage(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}


def _head(endpoint: Endpoint, obj: str, model_id: str, rid: str | None, now: float | None) -> dict:
    return {"id": rid or f"{endpoint.id_prefix}{uuid.uuid4().hex}", "object": obj,
            "created": int(time.time() if now is None else now), "model": model_id}


def response(endpoint: Endpoint, model_id: str, answer: Answer, now: float | None = None) -> dict:
    """The chat.completion or text_completion body of a whole answer."""
    if endpoint is Endpoint.CHAT:
        choice = {"index": 0, "message": {"role": "assistant", "content": answer.text},
                  "finish_reason": answer.finish_reason}
    else:
        choice = {"index": 0, "text": answer.text, "logprobs": None, "finish_reason": answer.finish_reason}
    return {**_head(endpoint, endpoint.obj, model_id, None, now), "choices": [choice], "usage": answer.usage()}


class Chunks:
    """The server-sent events of one streamed answer, in OpenAI's chunk format: for a chat, a first
    chunk with delta.role "assistant"; one chunk per text delta; a last chunk with finish_reason;
    with include_usage, a chunk with usage and no choices (every other chunk has "usage": null);
    then `data: [DONE]`. All chunks share one id and created time."""

    def __init__(self, endpoint: Endpoint, model_id: str, include_usage: bool, now: float | None = None):
        self.endpoint, self.include_usage = endpoint, include_usage
        self.head = _head(endpoint, endpoint.chunk, model_id, None, now)

    def _event(self, choices: list[dict], **extra) -> str:
        body = {**self.head, "choices": choices, **({"usage": None} if self.include_usage else {}), **extra}
        return f"data: {json.dumps(body)}\n\n"

    def _choice(self, text: str | None, finish: str | None, role: bool = False) -> dict:
        if self.endpoint is Endpoint.CHAT:
            delta = ({"role": "assistant"} if role else {}) | ({"content": text} if text is not None else {})
            return {"index": 0, "delta": delta, "finish_reason": finish}
        return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}

    def start(self) -> str:
        return self._event([self._choice("", None, role=True)]) if self.endpoint is Endpoint.CHAT else ""

    def text(self, delta: str) -> str:
        return self._event([self._choice(delta, None)])

    def end(self, answer: Answer) -> str:
        out = self._event([self._choice(None, answer.finish_reason)])
        if self.include_usage:
            out += self._event([], usage=answer.usage())
        return out + SSE_DONE

    @staticmethod
    def error(e: ApiError) -> str:
        """A failure after the 200 went out: OpenAI's error body as an event (the SDKs raise it)."""
        return f"data: {json.dumps(e.body())}\n\n" + SSE_DONE
