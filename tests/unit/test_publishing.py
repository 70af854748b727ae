"""tpuft.controller.publishing, pure: which adapter a base serves under a name, and the gate a new fine-tune
passes to replace it (ifBetter with a margin, never across eval sets; always)."""
from __future__ import annotations

import pytest

from tpuft.controller import publishing
from tpuft.controller.observed import PublishedObs

SET = "split:d[test]"


def served(loss: float | None = 1.0, eval_set: str = SET, source: str = "ns/old", uid: str = "u-old",
           at: str = "2026-01-01T11:00:00Z", adapter: str = "a") -> PublishedObs:
    return PublishedObs(source, uid, "base", adapter, loss, eval_set, at)


GATE = [
    ("ifBetter", 0.0, 0.9, SET, None, True, "no adapter is served"),
    ("ifBetter", 0.0, 0.9, SET, served(1.0), True, "beats the served ns/old's 1.0000"),
    ("ifBetter", 0.0, 1.0, SET, served(1.0), False, "does not beat the served ns/old's 1.0000"),
    ("ifBetter", 0.0, 1.1, SET, served(1.0), False, "eval loss 1.1000 does not beat"),
    ("ifBetter", 0.2, 0.85, SET, served(1.0), False, "margin 0.2"),
    ("ifBetter", 0.2, 0.79, SET, served(1.0), True, "by more than the margin 0.2"),
    ("ifBetter", 0.0, 0.1, SET, served(1.0, "heldout:0.1:seed42:d[train]"), False,
     "this fine-tune's eval set is 'split:d[test]', the served ns/old's is 'heldout:0.1:seed42:d[train]'"),
    ("ifBetter", 0.0, None, SET, served(1.0), False, "eval loss none cannot be compared"),
    ("ifBetter", 0.0, 0.5, SET, served(None), False, "served ns/old's none"),
    ("always", 0.0, 9.0, "other", served(1.0), True, "replaces ns/old"),
]


@pytest.mark.parametrize("when,margin,loss,eval_set,current,promote,words", GATE,
                         ids=[f"{g[0]}-{g[1]}-{g[2]}-{g[5]}" for g in GATE])
def test_the_gate_promotes_only_a_better_loss_on_the_same_eval_set(when, margin, loss, eval_set, current, promote,
                                                                   words):
    verdict = publishing.gate(when, margin, loss, eval_set, current)
    assert verdict.promote is promote and words in verdict.message


def test_the_newest_publication_of_another_fine_tune_is_the_served_one():
    old, new = served(at="2026-01-01T11:00:00Z"), served(source="ns/new", uid="u-new", at="2026-01-01T12:00:00Z")
    other_name = served(source="ns/b", uid="u-b", adapter="b", at="2026-01-01T13:00:00Z")
    assert publishing.served((old, new, other_name), "a", "u-me") == new
    assert publishing.served((old, new), "a", "u-new") == old   # its own publication is not what it competes with
    assert publishing.newer((old, new), "a", "u-old", old.published_at, old.source) == new
    assert publishing.newer((old, new), "a", "u-new", new.published_at, new.source) is None
    assert publishing.latest_per_adapter((old, other_name, new)) == (new, other_name)
