"""tpuft.api.records: every record type users hold reads into one conversation shape; a record
that does not fit is named by its number, its field and what was expected."""
from __future__ import annotations

import pytest

from tpuft.api.constants import DatasetType
from tpuft.api import records
from tpuft.api.records import RecordError, Turn


@pytest.mark.parametrize("columns, kind", [
    (["messages"], DatasetType.MESSAGES),
    (["prompt", "completion"], DatasetType.PROMPT_COMPLETION),
    (["instruction", "context", "response", "category"], DatasetType.INSTRUCTION),   # dolly
    (["instruction", "input", "output"], DatasetType.INSTRUCTION),                   # alpaca
    (["text", "meta"], DatasetType.TEXT),
])
def test_the_columns_say_the_type(columns, kind):
    assert records.detect(columns).type == kind


def test_dolly_and_alpaca_read_the_same_conversation():
    dolly = records.detect(["instruction", "context", "response"])
    alpaca = records.detect(["instruction", "input", "output"])
    expected = (Turn("user", "Sum up.\n\nBees make honey.", False), Turn("assistant", "Honey.", True))
    assert records.read({"instruction": "Sum up.", "context": "Bees make honey.", "response": "Honey."}, dolly, 1) \
        == expected
    assert records.read({"instruction": "Sum up.", "input": "Bees make honey.", "output": "Honey."}, alpaca, 1) \
        == expected
    assert records.read({"instruction": "Hi", "input": "", "output": "Hello"}, alpaca, 1)[0].content == "Hi"


def test_a_column_mapping_reads_the_users_names():
    layout = records.detect(["question", "answer"], mapping={"prompt": "question", "completion": "answer"})
    assert layout.type == DatasetType.PROMPT_COMPLETION
    assert records.read({"question": "Why?", "answer": "Because."}, layout, 1) == (
        Turn("user", "Why?", False), Turn("assistant", "Because.", True))


def test_messages_multi_turn_with_a_system_prompt_and_an_untrained_turn():
    layout = records.detect(["messages"])
    turns = records.read({"messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello", "weight": 0}, {"role": "user", "content": "Bye"},
        {"role": "assistant", "content": "Bye!"}]}, layout, 3)
    assert [(t.role, t.trained) for t in turns] == [("system", False), ("user", False), ("assistant", False),
                                                    ("user", False), ("assistant", True)]


@pytest.mark.parametrize("record, where", [
    ({"messages": [{"role": "user", "content": "Hi"}]}, "messages: no assistant turn to train"),
    ({"messages": [{"role": "user", "content": "Hi"}, {"role": "bot", "content": "x"}]},
     "messages[1].role: unknown role 'bot'; expected one of system, user, assistant"),
    ({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": " "}]},
     "messages[1].content: missing or empty"),
    ({"messages": [{"role": "assistant", "content": "x"}]}, "messages: the first message after any system message must be"),
    ({"messages": "Hi"}, "messages: expected a non-empty list"),
    ({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "x", "weight": 2}]},
     "messages[1].weight: expected 0 or 1"),
])
def test_a_bad_record_is_named_by_number_and_field(record, where):
    with pytest.raises(RecordError) as e:
        records.check([{"messages": [{"role": "user", "content": "ok"}, {"role": "assistant", "content": "ok"}]},
                       record], records.detect(["messages"]))
    assert str(e.value).startswith(f"record 2: {where}")


def test_an_empty_answer_is_named():
    layout = records.detect(["prompt", "completion"])
    with pytest.raises(RecordError, match="record 7: completion: missing or empty; expected a non-empty string"):
        records.read({"prompt": "Why?", "completion": None}, layout, 7)


def test_columns_that_fit_no_type_say_what_would():
    with pytest.raises(ValueError, match=r"no record layout fits the columns \['question', 'answer'\].*"
                                         r"spec.dataset.columns"):
        records.detect(["question", "answer"])
    with pytest.raises(ValueError, match=r"spec.dataset.type promptCompletion reads column\(s\) \['completion'\]"):
        records.detect(["prompt", "answer"], declared="promptCompletion")
    with pytest.raises(ValueError, match="names column\\(s\\) \\['q'\\] the dataset does not have"):
        records.detect(["question"], mapping={"prompt": "q"})


def test_content_is_kept_as_written_and_whitespace_only_content_is_refused():
    """Serving renders a user's text untrimmed, and an indented code answer needs its indentation."""
    code = "    return 42\n"
    messages = records.detect(["messages"])
    turns = records.read({"messages": [{"role": "system", "content": " Be brief. "},
                                       {"role": "user", "content": "  what is it?\n"},
                                       {"role": "assistant", "content": code}]}, messages, 1)
    assert [t.content for t in turns] == [" Be brief. ", "  what is it?\n", code]
    pair = records.detect(["prompt", "completion"])
    assert records.read({"prompt": " Why?", "completion": code}, pair, 1) == (
        Turn("user", " Why?", False), Turn("assistant", code, True))
    with pytest.raises(RecordError, match="record 4: completion: missing or empty"):
        records.read({"prompt": "Why?", "completion": " \n\t"}, pair, 4)
