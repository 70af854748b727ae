"""The verification verdict: exit codes, the JSON line on stdout, the CR status object."""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from tpuft.api.constants import VerificationStatus

RESULT_PREFIX = "TPUFT_VERIFY_RESULT"
EXIT_PASSED = 0
EXIT_FAILED = 1
EXIT_TIMEOUT = 3


@dataclass
class VerifyResult:
    passed: bool
    ranks: int
    hosts: int = 0
    all_reduce_sums: list = field(default_factory=list)  # per rank, in rank order
    expected_sum: float = 0.0
    max_abs_diff: float | None = None
    seconds: float = 0.0
    message: str = ""
    timed_out: bool = False
    per_rank: list = field(default_factory=list)
    storage_error: str | None = None   # the run's storage failed its check: nothing else ran

    @property
    def all_reduce_sum(self) -> float | None:
        """The value every rank agreed on, or None when they did not all agree."""
        vals = {v for s in self.all_reduce_sums for v in (s or [None])}
        return vals.pop() if len(vals) == 1 else None

    @property
    def exit_code(self) -> int:
        if self.passed:
            return EXIT_PASSED
        return EXIT_TIMEOUT if self.timed_out else EXIT_FAILED

    def to_status(self) -> dict:
        """The `status.verification` object (exactly these keys; the operator owns the rest)."""
        v = VerificationStatus
        return {
            v.PASSED.value: self.passed,
            v.RANKS.value: self.ranks,
            v.HOSTS.value: self.hosts,
            v.ALL_REDUCE_SUM.value: self.all_reduce_sum,
            v.EXPECTED_SUM.value: self.expected_sum,
            v.MAX_ABS_DIFF.value: self.max_abs_diff,
            v.SECONDS.value: round(self.seconds, 3),
            v.MESSAGE.value: self.message,
            v.STORAGE_ERROR.value: self.storage_error,   # None clears an earlier verification's
        }

    def to_json_line(self) -> str:
        body = self.to_status()
        body["allReduceSums"] = self.all_reduce_sums
        body["timedOut"] = self.timed_out
        return f"{RESULT_PREFIX} {json.dumps(body, sort_keys=True)}"


def storage_refused(ranks: int, error: str) -> VerifyResult:
    """The verdict when the run's storage cannot be written: failed before any TPU work, with the
    storage layer's message (the operator's reason StorageNotWritable, not a collective's)."""
    return VerifyResult(passed=False, ranks=ranks, message=f"storage check failed: {error}", storage_error=error)


def print_result(res: VerifyResult) -> None:
    for r in res.per_rank:
        print(f"Rank {r['rank']:2d}: all_reduce_sum={r['all_reduce_sum']} max_abs_diff={r['max_abs_diff']:.3g}")
    print(("PASSED: " if res.passed else "FAILED: ") + res.message)
    print(res.to_json_line(), flush=True)


