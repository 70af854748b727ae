"""tpuft.splits: whether two splits of one dataset, in datasets' slicing syntax, share records,
decided from the spec alone (the split's size unknown)."""
from __future__ import annotations

import pytest

from tpuft import splits
from tpuft.splits import Overlap


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
