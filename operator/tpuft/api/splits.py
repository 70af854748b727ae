"""Which records a split in datasets' slicing syntax reads, as far as the spec alone says: whether a
training split and an eval split of the same dataset share records. Pure.

The syntax (datasets' ReadInstruction): NAME, NAME[FROM:TO] with each bound absolute (`train[:1000]`),
counted from the end when negative (`train[-200:]`) or a percent (`train[10%:20%]`), optionally
`(pct1_dropremainder)`, and parts joined with `+`. A split's records are unknown here (N), so each
bound is a*N + b, clamped to [0, N]: two parts of the same split are compared at every size where
their answer could change. Different split names are different records (a dataset's splits are
disjoint); a name not in this syntax cannot be compared.
"""
from __future__ import annotations

import enum
import hashlib
import math
import re
from dataclasses import dataclass
from fractions import Fraction

_PART = re.compile(r"^(?P<split>\w+(?:\.\w+)*)"
                   r"(?:\[(?:(?P<start>-?\d+)(?P<start_pct>%)?)?:(?:(?P<stop>-?\d+)(?P<stop_pct>%)?)?\])?"
                   r"(?:\((?P<rounding>closest|pct1_dropremainder)\))?$")
_PLUS = re.compile(r"\s*\+\s*")
_LARGE = 10 ** 12    # a split larger than any bound written


@dataclass(frozen=True)
class Bound:
    """a * N + b records, for a split of N records."""
    a: Fraction
    b: int

    def at(self, n: int) -> Fraction:
        return min(max(self.a * n + self.b, Fraction(0)), Fraction(n))


@dataclass(frozen=True)
class Part:
    split: str
    start: Bound
    stop: Bound

    def records(self, n: int) -> tuple[Fraction, Fraction]:
        return self.start.at(n), self.stop.at(n)


def _bound(number: str | None, pct: str | None, default: Bound) -> Bound:
    if number is None:
        return default
    value = int(number)
    if pct:
        return Bound(Fraction(value, 100) + (1 if value < 0 else 0), 0)
    return Bound(Fraction(1 if value < 0 else 0), value)


def parse(text: str) -> tuple[Part, ...] | None:
    """The parts a split reads; None when it is not in datasets' slicing syntax."""
    parts = []
    for piece in _PLUS.split(text.strip()):
        m = _PART.fullmatch(piece)
        if m is None:
            return None
        parts.append(Part(m["split"], _bound(m["start"], m["start_pct"], Bound(Fraction(0), 0)),
                          _bound(m["stop"], m["stop_pct"], Bound(Fraction(1), 0))))
    return tuple(parts)


class Overlap(enum.Enum):
    NONE = "none"           # no record in both, whatever the split's size
    ALWAYS = "always"       # a record in both at every size where both read any
    UNKNOWN = "unknown"     # it depends on the split's size (or a split cannot be read)


def _sizes(bounds: list[Bound]) -> list[int]:
    """Sizes at which every comparison between the bounds, 0 and N has been seen on both sides."""
    lines = bounds + [Bound(Fraction(0), 0), Bound(Fraction(1), 0)]
    sizes = {1, 2, _LARGE}
    for i, p in enumerate(lines):
        for q in lines[i + 1:]:
            if p.a != q.a:
                x = Fraction(q.b - p.b) / (p.a - q.a)
                sizes.update(k for k in range(math.floor(x) - 1, math.ceil(x) + 2) if k >= 1)
    return sorted(sizes)


def overlap(first: str, second: str) -> Overlap:
    """Whether two splits of one dataset read records in common."""
    a, b = parse(first), parse(second)
    if a is None or b is None:
        return Overlap.UNKNOWN
    pairs = [(p, q) for p in a for q in b if p.split == q.split]
    if not pairs:
        return Overlap.NONE
    seen = set()
    for n in _sizes([x for p, q in pairs for x in (p.start, p.stop, q.start, q.stop)]):
        if not (any(lo < hi for lo, hi in (p.records(n) for p in a))
                and any(lo < hi for lo, hi in (q.records(n) for q in b))):
            continue   # one of them reads nothing at this size
        seen.add(any(max(p.records(n)[0], q.records(n)[0]) < min(p.records(n)[1], q.records(n)[1])
                     for p, q in pairs))
    if seen == {True}:
        return Overlap.ALWAYS
    return Overlap.NONE if seen <= {False} else Overlap.UNKNOWN


def complement(split: str) -> str | None:
    """The other end of a one-sided slice (train[-200:] -> train[:-200]), for a message's advice."""
    parts = parse(split)
    if not parts or len(parts) != 1:
        return None
    m = _PART.fullmatch(split.strip())
    assert m is not None
    start = (m["start"] or "") + (m["start_pct"] or "")
    stop = (m["stop"] or "") + (m["stop_pct"] or "")
    if bool(start) == bool(stop):
        return None
    return f"{m['split']}[{stop}:]" if stop else f"{m['split']}[:{start}]"


FINGERPRINT_MAX_LENGTH = 96


def eval_set_fingerprint(dataset: str, dataset_split: str, fraction: float | None, eval_dataset: str | None,
                         eval_split: str | None, seed: int) -> str:
    """A short, stable name for the records an eval set reads, so that two eval losses are compared
    only when they were measured on the same records (spec.publish). Held out of spec.dataset: the
    fraction, the seed that chooses it and the split it is held out of; else the eval dataset (default
    spec.dataset's) and split. Readable when short; a long one keeps its head and a hash of the whole."""
    if fraction is not None:
        text = f"heldout:{fraction:g}:seed{seed}:{dataset}[{dataset_split}]"
    else:
        text = f"split:{eval_dataset or dataset}[{eval_split or dataset_split}]"
    if len(text) <= FINGERPRINT_MAX_LENGTH:
        return text
    digest = hashlib.sha256(text.encode()).hexdigest()[:12]
    return f"{text[:FINGERPRINT_MAX_LENGTH - 13]}~{digest}"
