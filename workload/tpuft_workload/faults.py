"""Fault injection for tests: TPUFT_FAULT makes one rank misbehave on purpose.

Specs (comma-separated, read on the driver and passed to workers explicitly, because Ray
workers of an already-running cluster do not inherit the driver's environment):

  hang-rank:R              verify: rank R sleeps instead of joining the process group
  fail-rank:R              verify: rank R raises before joining the process group
  kill-rank:R:step:S       train: rank R exits the process hard at global step S, once
                           (a marker file under the run directory stops a second kill after
                           the restart, so resume-from-checkpoint can be tested)
  sigterm-rank:R:step:S    train: rank R's process gets a SIGTERM at global step S (before the
                           step runs), once, as a pod's preStop hook sends it
"""
from __future__ import annotations

import os
from dataclasses import dataclass

ENV_FAULT = "TPUFT_FAULT"


@dataclass(frozen=True)
class Fault:
    kind: str      # hang | fail | kill | sigterm
    rank: int
    step: int = -1


def parse_faults(spec: str | None) -> list[Fault]:
    faults = []
    for part in (spec or "").split(","):
        part = part.strip()
        if not part:
            continue
        bits = part.split(":")
        try:
            if bits[0] in ("hang-rank", "fail-rank") and len(bits) == 2:
                faults.append(Fault(bits[0].split("-")[0], int(bits[1])))
            elif bits[0] in ("kill-rank", "sigterm-rank") and len(bits) == 4 and bits[2] == "step":
                faults.append(Fault(bits[0].split("-")[0], int(bits[1]), int(bits[3])))
            else:
                raise ValueError
        except ValueError:
            raise ValueError(
                f"{ENV_FAULT}={spec!r}: cannot parse {part!r}; use hang-rank:R, fail-rank:R "
                "kill-rank:R:step:S or sigterm-rank:R:step:S"
            ) from None
    return faults


def from_env() -> str:
    return os.environ.get(ENV_FAULT, "")


def find(faults: list[Fault], kind: str, rank: int) -> Fault | None:
    for f in faults:
        if f.kind == kind and f.rank == rank:
            return f
    return None


def fire_train(faults: list[Fault], rank: int, step: int, run_dir: str) -> None:
    """The train faults, before global step `step` runs: kill-rank exits the process hard,
    sigterm-rank sends it a SIGTERM; each once (a marker file under `run_dir`, the run's local
    directory)."""
    import signal
    import sys

    for kind in ("kill", "sigterm"):
        f = find(faults, kind, rank)
        if f is None or f.step != step:
            continue
        marker = os.path.join(run_dir, f".tpuft-fault-{kind}-r{rank}-s{step}")
        if "://" in marker or os.path.exists(marker):
            continue  # already fired once (or remote storage: test hook is local-only)
        os.makedirs(run_dir, exist_ok=True)
        open(marker, "w").close()
        if kind == "kill":
            sys.stdout.write(f"[tpuft] injected fault: killing rank {rank} at step {step}\n")
            sys.stdout.flush()
            os._exit(17)
        sys.stdout.write(f"[tpuft] injected fault: SIGTERM to rank {rank} before step {step}\n")
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGTERM)
