"""How the laptop tooling reports progress: one line per step on stderr, prefixed "[tpuft]" and
flushed at once, so it keeps its place among the components' own output. Stdlib only."""
from __future__ import annotations

import sys


def say(msg: str) -> None:
    print(f"[tpuft] {msg}", file=sys.stderr, flush=True)
