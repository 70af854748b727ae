"""tpuft.api.splits: whether two splits of one dataset, in datasets' slicing syntax, share records,
decided from the spec alone (the split's size unknown)."""
from __future__ import annotations

import pytest

from tpuft.api import splits
from tpuft.api.splits import Overlap


@pytest.mark.parametrize("train, held, expected", [
    ("train", "train[-200:]", Overlap.ALWAYS),              # spec.py's old example: the eval set is trained on
    ("train", "train", Overlap.ALWAYS),
    ("train[:-200]", "train[-200:]", Overlap.NONE),
    ("train[:1000]", "train[500:1500]", Overlap.ALWAYS),
    ("train[:100]", "train[100:200]", Overlap.NONE),
    ("train[:-100]", "train[-200:]", Overlap.ALWAYS),
    ("train[:-200]", "train[-100:]", Overlap.NONE),
    ("train[:1000]", "train[-200:]", Overlap.UNKNOWN),      # apart only with at least 1200 records
    ("train[10%:20%]", "train[:10%]", Overlap.NONE),
    ("train[:15%]", "train[10%:20%]", Overlap.ALWAYS),
    ("train[:50%]", "train[-100:]", Overlap.UNKNOWN),       # percent against a count: the size decides
    ("train[:10%]+train[20%:]", "train[10%:20%]", Overlap.NONE),
    ("train[:10%](pct1_dropremainder)", "train[5%:]", Overlap.ALWAYS),
    ("train", "test", Overlap.NONE),                        # a dataset's splits are disjoint
    ("train[:1024]", "validation[-200:]", Overlap.NONE),
    ("train", "train[{x}]", Overlap.UNKNOWN),               # not in the syntax: cannot tell
])
def test_overlap_as_far_as_the_spec_says(train, held, expected):
    assert splits.overlap(train, held) == expected
    assert splits.overlap(held, train) == expected


def test_the_complement_of_a_one_sided_slice_is_the_advice():
    assert splits.complement("train[-200:]") == "train[:-200]"
    assert splits.complement("train[:10%]") == "train[10%:]"
    assert splits.overlap(splits.complement("train[-200:]"), "train[-200:]") == Overlap.NONE
    assert splits.complement("train[10:20]") is None and splits.complement("train") is None


def test_the_eval_set_fingerprint_is_stable_short_and_tells_eval_sets_apart():
    fp = splits.eval_set_fingerprint
    assert fp("d", "train", 0.1, None, None, 42) == fp("d", "train", 0.1, None, None, 42) == "heldout:0.1:seed42:d[train]"
    assert len({fp("d", "train", 0.1, None, None, 42), fp("d", "train", 0.2, None, None, 42),
                fp("d", "train", 0.1, None, None, 7), fp("d", "train[:100]", 0.1, None, None, 42),
                fp("d", "train", None, None, "test", 42), fp("d", "train", None, "e", "test", 42)}) == 6
    assert fp("d", "train", None, None, "test", 1) == fp("d", "x", None, "d", "test", 2) == "split:d[test]"
    long = "gs://bucket/" + "a" * 300
    a, b = fp(long + "1", "train", 0.1, None, None, 42), fp(long + "2", "train", 0.1, None, None, 42)
    assert a != b and len(a) == len(b) == splits.FINGERPRINT_MAX_LENGTH
