"""What a workload command runs: the run's document parsed (tpuft.api.spec.Run) and what only the job knows."""
from __future__ import annotations

from dataclasses import dataclass

from tpuft.api.spec import Run


@dataclass(frozen=True)
class Command:
    name: str                       # verify or train (publish and unpublish need no run: __main__)
    run: Run
    run_name: str = ""              # the run's directory under checkpoint.storagePath (verify: checked only)
    log_file: str | None = None
    collective_timeout_seconds: float | None = None   # verify
    # train: submitted beside a re-verification (after a lost host); the trainer starts once it passed
    after_verification: bool = False
