"""One prompt renderer for training and serving: a conversation becomes token ids through the
model's own chat template, the same text the endpoint builds (tpuft_workload.chat_api.prompt_ids:
`apply_chat_template(..., add_generation_prompt=True)`, tokenized without added special tokens).

Labels are the tokens each trained assistant turn adds: its content and whatever the template
writes to end the turn (`<end_of_turn>`, `<|eot_id|>`, `<|im_end|>`, EOS); everything else is -100.
The spans come from rendering the conversation prefix by prefix: the text up to a turn with the
generation prompt, and up to the end of that turn. Each must be a prefix of the whole
conversation's text and end on a token boundary; a template that renders earlier turns differently
once later ones follow (some strip reasoning from past answers) is refused loudly (RenderError),
never silently mislabelled.

A tokenizer without a chat template gets DOLLY_TEMPLATE (`with_template`, at load): the
instruction/response sections this project trained on before, written as a template, so the
exported tokenizer carries exactly what the model was trained on.
"""
from __future__ import annotations

from dataclasses import dataclass

from tpuft.records import Turn

IGNORE = -100

DOLLY_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'system' %}### System:\n{{ m['content'] }}\n\n"
    "{% elif m['role'] == 'assistant' %}### Response:\n{{ m['content'] }}{{ eos_token }}\n\n"
    "{% else %}### Instruction:\n{{ m['content'] }}\n\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}### Response:\n{% endif %}"
)
# The template's own words, for the built-in tokenizer's vocabulary (tpuft_workload.tiny).
TEMPLATE_WORDS = "### System: ### Instruction: ### Response:"


class RenderError(ValueError):
    """The chat template cannot give this conversation's training labels (what, and what to do)."""


@dataclass(frozen=True)
class Example:
    input_ids: list[int]
    labels: list[int]

    @property
    def trained(self) -> int:
        return sum(1 for label in self.labels if label != IGNORE)


def with_template(tokenizer):
    """The tokenizer, given DOLLY_TEMPLATE when it has no chat template of its own."""
    if not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = DOLLY_TEMPLATE
    return tokenizer


def _text(tokenizer, turns, generation_prompt: bool) -> str:
    messages = [{"role": t.role, "content": t.content} for t in turns]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False)


def _spans(tokenizer, turns: tuple[Turn, ...]) -> tuple[str, list[tuple[int, int]]]:
    """(the whole conversation's text, the character span of each trained assistant turn)."""
    whole = _text(tokenizer, turns, False)
    spans = []
    for i, turn in enumerate(turns):
        if not turn.trained:
            continue
        start, end = _text(tokenizer, turns[:i], True), _text(tokenizer, turns[:i + 1], False)
        if not (whole.startswith(start) and whole.startswith(end) and len(start) < len(end)):
            raise RenderError(
                f"the chat template renders the conversation up to turn {i + 1} differently once later turns "
                "follow, so that answer's tokens cannot be found as serving would build them; split the "
                "conversation into one record per trained answer, each ending with it")
        spans.append((len(start), len(end)))
    return whole, spans


def _offsets(tokenizer, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return list(encoded["input_ids"]), [tuple(o) for o in encoded["offset_mapping"]]


def render(tokenizer, turns: tuple[Turn, ...]) -> Example:
    """A conversation's token ids (as the endpoint tokenizes a rendered chat) and its labels."""
    whole, spans = _spans(tokenizer, turns)
    ids, offsets = _offsets(tokenizer, whole)
    labels = [IGNORE] * len(ids)
    for start, end in spans:
        for edge in (start, end):
            if any(a < edge < b for a, b in offsets):
                raise RenderError(f"a token crosses the chat template's turn boundary at character {edge}; "
                                  "the tokenizer merges the template's text with the turn's")
        for k, (a, _) in enumerate(offsets):
            if start <= a < end:
                labels[k] = ids[k]
    return Example(ids, labels)


def render_text(tokenizer, text: str) -> Example:
    """Plain text: the tokenizer's usual special tokens, then EOS; every token after the first trained."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise RenderError("the tokenizer has no eos_token: a text example needs one to end")
    ids = list(tokenizer(text, add_special_tokens=True)["input_ids"]) + [eos]
    return Example(ids, [IGNORE] + ids[1:])


def special_ids(tokenizer) -> set[int]:
    ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    for token_id, added in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(added, "special", False):
            ids.add(int(token_id))
    return ids


def turn_end_ids(tokenizer) -> list[int]:
    """The special tokens the template writes after an answer's content (the model learns to emit
    them; serving stops at them): rendered from a one-turn conversation."""
    answer = "ok"
    example = render(tokenizer, (Turn("user", "hi", False), Turn("assistant", answer, True)))
    content = set(tokenizer(answer, add_special_tokens=False)["input_ids"])   # an unknown word's UNK is not an end
    return sorted({t for t in example.labels if t != IGNORE and t in special_ids(tokenizer) and t not in content})
