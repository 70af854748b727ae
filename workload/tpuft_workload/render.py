"""One prompt renderer for training and serving: a conversation becomes token ids through the
model's own chat template, the same text the endpoint builds (tpuft_workload.chat_api.prompt_ids:
`apply_chat_template(..., add_generation_prompt=True)`, tokenized without added special tokens).

Labels are the tokens each trained assistant turn adds: its content and whatever the template
writes to end the turn (`<end_of_turn>`, `<|eot_id|>`, `<|im_end|>`, EOS); everything else is -100.
The spans come from rendering the conversation prefix by prefix: the text up to a turn with the
generation prompt (which must be a prefix of the whole conversation's text), and up to the end of
that turn. A turn's span ends where that second text stops agreeing with the whole conversation's
(their longest common prefix, on a token boundary): templates such as Phi-3's write EOS after the
last turn of a conversation only, so a conversation cut after a middle answer ends in text the
whole one does not have there. The answer's content must lie inside the span; a template that
renders earlier turns differently once later ones follow (some strip reasoning from past answers)
is refused loudly (RenderError), never silently mislabelled. A conversation the template itself
refuses (its raise_exception: Gemma 1/2 given a system message, roles that do not alternate) is a
RenderError quoting the template.

Llama 3.2 and 3.3 templates write today's date into the system block (strftime_now, unless the
caller gives `date_string`). Training gives date_string TRAINING_DATE, so the same records give the
same tokens on any day (the packed rows a resumed attempt keeps, the tests); serving renders with the
day's date, as transformers does. The date is in the system block, never in a label.

A tokenizer without a chat template gets DOLLY_TEMPLATE (`with_template`, at load): the
instruction/response sections this project trained on before, written as a template, so the
exported tokenizer carries exactly what the model was trained on.
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import date

from tpuft.api.records import Turn

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
# The date_string Llama 3 templates get while training: the one they fall back to where strftime_now
# is not defined (transformers turns a callable passed to a template into text: no strftime_now of ours).
TRAINING_DATE = date(2024, 7, 26)
DATE_FORMAT = "%d %b %Y"    # as Llama 3's templates write it: 26 Jul 2024


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
    from jinja2.exceptions import TemplateError, TemplateSyntaxError

    messages = [{"role": t.role, "content": t.content} for t in turns]
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False,
                                             date_string=TRAINING_DATE.strftime(DATE_FORMAT))
    except TemplateSyntaxError:   # the template itself is broken, not this conversation
        raise
    except TemplateError as e:
        roles = ", ".join(t.role for t in turns)
        raise RenderError(f"the model's chat template refuses this conversation ({roles}): {e}; change the record "
                          "to what the template accepts (e.g. no system message for Gemma 1 and 2, user and "
                          "assistant turns alternating), or train a model whose template takes it") from None


def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    return next((k for k in range(n) if a[k] != b[k]), n)


@dataclass(frozen=True)
class _Span:
    start: int
    end: int
    exact: bool     # the turn's own text ends here; else where it stops agreeing with the whole conversation's


def _spans(tokenizer, turns: tuple[Turn, ...]) -> tuple[str, list[_Span]]:
    """(the whole conversation's text, the character span of each trained assistant turn)."""
    whole = _text(tokenizer, turns, False)
    spans = []
    for i, turn in enumerate(turns):
        if not turn.trained:
            continue
        start, upto = _text(tokenizer, turns[:i], True), _text(tokenizer, turns[:i + 1], False)
        end = _common_prefix(upto, whole)
        if not (whole.startswith(start) and turn.content.strip() in whole[len(start):end]):
            raise RenderError(
                f"the chat template renders the conversation up to turn {i + 1} differently once later turns "
                "follow, so that answer's tokens cannot be found as serving would build them; split the "
                "conversation into one record per trained answer, each ending with it")
        spans.append(_Span(len(start), end, end == len(upto)))
    return whole, spans


def _offsets(tokenizer, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return list(encoded["input_ids"]), [tuple(o) for o in encoded["offset_mapping"]]


def render(tokenizer, turns: tuple[Turn, ...]) -> Example:
    """A conversation's token ids (as the endpoint tokenizes a rendered chat) and its labels."""
    whole, spans = _spans(tokenizer, turns)
    ids, offsets = _offsets(tokenizer, whole)
    labels = [IGNORE] * len(ids)
    for span in spans:
        end = span.end
        if not span.exact:   # where two texts stop agreeing can fall inside a token of the later turn: before it
            end = max((b for a, b in offsets if b <= end), default=span.start)
        for edge in (span.start, end):
            if any(a < edge < b for a, b in offsets):
                raise RenderError(f"a token crosses the chat template's turn boundary at character {edge}; "
                                  "the tokenizer merges the template's text with the turn's")
        for k, (a, _) in enumerate(offsets):
            if span.start <= a < end:
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
