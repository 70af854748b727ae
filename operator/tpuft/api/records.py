"""What a dataset's records hold, read into one shape: a conversation (system/user/assistant turns,
each assistant turn trained or not) or a plain text. Pure: no tokenizer, no Ray.

The record types (spec.dataset.type, or detected from the columns):
  messages          {"messages": [{"role": "system"|"user"|"assistant", "content": "...",
                    "weight": 0|1 (assistant turns only, optional)}, ...]}: OpenAI's chat fine-tuning
                    JSONL; multi-turn; every assistant turn is trained unless its weight is 0.
  promptCompletion  {"prompt", "completion"}: a user turn and the assistant's answer.
  instruction       dolly {"instruction", "context", "response"} or alpaca {"instruction", "input",
                    "output"}: the user turn is the instruction, then a blank line and the context/input
                    when there is one; the assistant's answer is the response/output.
  text              {"text"}: every token trained.
spec.dataset.columns maps these names to the dataset's own (e.g. {prompt: question, completion: answer}).

Content is kept as written (an indented code answer keeps its indentation; the endpoint renders a
user's text untrimmed too), so training renders what serving renders; whitespace-only content is
refused. A record that does not fit is a RecordError naming its number (1-based, in file order), the field
and what was expected; the training driver checks every record before any worker starts.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from tpuft.api.constants import DATASET_COLUMN_KEYS, DatasetType

ROLES = ("system", "user", "assistant")
# Each type's columns, required then optional; a second name is the other layout's (alpaca's).
_ALIASES = {"input": ("input", "context"), "response": ("response", "output")}
LAYOUTS = "messages (chat), prompt + completion, instruction + response (dolly) or output (alpaca), or text"


class RecordError(ValueError):
    """One record that cannot be trained on: its number, the field, what was expected."""

    def __init__(self, number: int, field: str, problem: str):
        super().__init__(f"record {number}: {field}: {problem}")
        self.number, self.field, self.problem = number, field, problem


@dataclass(frozen=True)
class Turn:
    role: str          # system | user | assistant
    content: str
    trained: bool      # an assistant turn whose tokens are labels


@dataclass(frozen=True)
class Layout:
    """How to read records: their type and, for each name the type reads, the dataset's column."""
    type: DatasetType
    columns: Mapping[str, str]     # e.g. {"instruction": "instruction", "input": "context", "response": "response"}

    def column(self, key: str) -> str | None:
        return self.columns.get(key)


def detect(names: Iterable[str], declared: str | None = None,
           mapping: Mapping[str, str] | None = None) -> Layout:
    """The layout of a dataset with these column names: `declared` (spec.dataset.type) or detected,
    through `mapping` (spec.dataset.columns). ValueError naming the columns found and what fits."""
    names = list(names)
    mapping = dict(mapping or {})
    unknown = sorted(set(mapping) - set(DATASET_COLUMN_KEYS))
    if unknown:
        raise ValueError(f"spec.dataset.columns: unknown key(s) {unknown}; the keys are {', '.join(DATASET_COLUMN_KEYS)}")
    missing = sorted(c for c in mapping.values() if c not in names)
    if missing:
        raise ValueError(f"spec.dataset.columns names column(s) {missing} the dataset does not have (found {names})")

    def column(key: str) -> str | None:
        if key in mapping:
            return mapping[key]
        return next((n for n in _ALIASES.get(key, (key,)) if n in names), None)

    types = [DatasetType(declared)] if declared else list(DatasetType)
    for kind in types:
        required, optional = _COLUMNS[kind]
        found = {k: column(k) for k in required + optional}
        if all(found[k] for k in required):
            return Layout(kind, {k: v for k, v in found.items() if v})
        if declared:
            absent = [k for k in required if not found[k]]
            raise ValueError(f"spec.dataset.type {declared} reads column(s) {absent}, which the dataset does not have "
                             f"(found {names}); name yours with spec.dataset.columns, e.g. {{{absent[0]}: your_column}}")
    raise ValueError(f"no record layout fits the columns {names}: expected {LAYOUTS}; name yours with "
                     "spec.dataset.columns (e.g. {prompt: question, completion: answer}) or set spec.dataset.type")


_COLUMNS: dict[DatasetType, tuple[tuple[str, ...], tuple[str, ...]]] = {
    DatasetType.MESSAGES: (("messages",), ()),
    DatasetType.PROMPT_COMPLETION: (("prompt", "completion"), ()),
    DatasetType.INSTRUCTION: (("instruction", "response"), ("input",)),
    DatasetType.TEXT: (("text",), ()),
}


def column_pair(text: str) -> tuple[str, str]:
    """KEY=COLUMN (a spec.dataset.columns entry on a command line) -> (key, column); ValueError naming it."""
    key, sep, column = text.partition("=")
    if not sep or key not in DATASET_COLUMN_KEYS or not column:
        raise ValueError(f"expected KEY=COLUMN with KEY one of {', '.join(DATASET_COLUMN_KEYS)} (got {text!r})")
    return key, column


def read(record: Mapping, layout: Layout, number: int) -> tuple[Turn, ...] | str:
    """One record -> its conversation (turns) or, for type text, its text. RecordError if it does not fit."""
    def text(key: str, required: bool = True) -> str:
        name = layout.column(key)
        value = record.get(name) if name else None
        if value is None or (isinstance(value, str) and not value.strip()):
            if required:
                raise RecordError(number, name or key, "missing or empty; expected a non-empty string")
            return ""
        if not isinstance(value, str):
            raise RecordError(number, name or key, f"expected a string, got {type(value).__name__}")
        return value

    kind = layout.type
    if kind == DatasetType.TEXT:
        return text("text")
    if kind == DatasetType.PROMPT_COMPLETION:
        return (Turn("user", text("prompt"), False), Turn("assistant", text("completion"), True))
    if kind == DatasetType.INSTRUCTION:
        context = text("input", required=False)
        user = text("instruction") + (f"\n\n{context}" if context else "")
        return (Turn("user", user, False), Turn("assistant", text("response"), True))
    return _messages(record.get(layout.column("messages") or "messages"), layout.column("messages") or "messages",
                     number)


def _messages(value: object, field: str, number: int) -> tuple[Turn, ...]:
    if not isinstance(value, (list, tuple)) or not value:
        raise RecordError(number, field, "expected a non-empty list of {\"role\", \"content\"} messages")
    turns = []
    for i, message in enumerate(value):
        where = f"{field}[{i}]"
        if not isinstance(message, Mapping):
            raise RecordError(number, where, f"expected an object with role and content, got {type(message).__name__}")
        role = message.get("role")
        if role not in ROLES:
            raise RecordError(number, f"{where}.role", f"unknown role {role!r}; expected one of {', '.join(ROLES)}")
        content = message.get("content")
        if not isinstance(content, str) or not content.strip():
            raise RecordError(number, f"{where}.content", "missing or empty; expected a non-empty string")
        weight = message.get("weight")
        if weight not in (None, 0, 1):
            raise RecordError(number, f"{where}.weight", f"expected 0 or 1, got {weight!r}")
        if weight is not None and role != "assistant":
            raise RecordError(number, f"{where}.weight", "only an assistant turn has a weight")
        turns.append(Turn(role, content, role == "assistant" and weight != 0))
    first = next((t for t in turns if t.role != "system"), None)
    if first is None or first.role != "user":
        raise RecordError(number, field, "the first message after any system message must be the user's")
    if not any(t.trained for t in turns):
        raise RecordError(number, field, "no assistant turn to train (each needs role assistant, and weight 1 or "
                                         "no weight)")
    return tuple(turns)


def check(records: Iterable[Mapping], layout: Layout, first_number: int = 1) -> int:
    """Every record read (RecordError at the first that does not fit); their count."""
    count = 0
    for count, record in enumerate(records, start=1):
        read(record, layout, first_number + count - 1)
    return count
