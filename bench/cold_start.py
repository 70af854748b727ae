"""A newcomer's first `make demo`, timed stage by stage: a bare clone of this repository with every
cache empty (the dependency venvs, the Go build and module caches, pip's, the images, the Go tools,
the local cluster's state), then optionally the same again warm, after `tpuft cluster down`.

    python3 bench/cold_start.py --warm --out bench/results/cold_start.json

Stdlib only and run with the machine's python3: nothing is installed when it starts. Each cache goes
under --root, at the paths a fresh machine would use below it: `.cache/tpuft` (TPUFT_CACHE),
`.tpuft` (TPUFT_HOME), `.cache/go-build` (GOCACHE), `go/pkg/mod` (GOMODCACHE), `.cache/pip`
(PIP_CACHE_DIR). The default --root is a new folder under /var/tmp, removed at the end; one you
name is kept (`--root ~` after deleting those five folders leaves this machine's own caches warm).
A cache folder that is not empty is refused: the run would not be cold.

It needs the machine alone: no local cluster or test control plane running (their ports and
bridge), and ~45 GB of disk under --root. Each line `make demo` prints is echoed with the seconds
since the start; the stages are read off those lines (the Go builds' `building`/`built`, the images'
`building`/`built`, `cluster up in`, the demo's [1/3]..[3/3]). At the end the bench runs
`tpuft cluster down` (also on failure or timeout), and writes --out (JSON) and the table beside it
(.txt). Debian packages are timed only when the run installs them (the machine may have them).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# Below --root, where each cache lives (the defaults of a fresh machine below $HOME).
CACHES = {"TPUFT_CACHE": ".cache/tpuft", "TPUFT_HOME": ".tpuft", "GOCACHE": ".cache/go-build",
          "GOMODCACHE": "go/pkg/mod", "PIP_CACHE_DIR": ".cache/pip"}
# A running control plane would share ports and the bridge with the one the bench starts.
CLUSTER_PROCESSES = ("kube-apiserver", "etcd", "kubelet")
DEMO_STEP = re.compile(r"\[\s*[\d.]+s\] \[(\d)/3\]")


@dataclass
class Stage:
    name: str
    start_s: float
    end_s: float | None = None

    @property
    def seconds(self) -> float | None:
        return None if self.end_s is None else round(self.end_s - self.start_s, 1)


@dataclass
class Run:
    kind: str                      # cold | warm
    rc: int
    wall_s: float
    log: str
    stages: list[Stage] = field(default_factory=list)


def say(msg: str) -> None:
    print(f"[cold_start] {msg}", file=sys.stderr, flush=True)


def running_cluster() -> list[str]:
    """Processes of a local cluster or a test control plane, by PID and name."""
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                name = (proc / "comm").read_text().strip()
            except OSError:
                continue
            if name in CLUSTER_PROCESSES:
                found.append(f"{name} (pid {proc.name})")
    return found


def not_empty(root: Path) -> list[str]:
    return [f"{var}={root / rel}" for var, rel in CACHES.items()
            if (root / rel).is_dir() and any((root / rel).iterdir())]


def environment(root: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("KUBECONFIG", "VIRTUAL_ENV")}
    env.update({var: str(root / rel) for var, rel in CACHES.items()})
    return env


def stages_of(lines: list[tuple[float, str]]) -> list[Stage]:
    """What each step took, from `make demo`'s own lines (see the module docstring)."""
    open_stages: dict[str, Stage] = {}
    done: list[Stage] = []

    def begin(name: str, at: float) -> None:
        open_stages.setdefault(name, Stage(name, at))

    def end(name: str, at: float) -> None:
        stage = open_stages.pop(name, None) or Stage(name, at)
        stage.end_s = at
        done.append(stage)

    begin("make venv + prepare (side by side)", 0.0)
    for at, line in lines:
        if m := DEMO_STEP.search(line):
            step = int(m.group(1))
            if step == 1:
                end("make venv + prepare (side by side)", at)
                begin("cluster up", at)
            elif step == 2:
                end("cluster up", at)
                begin("demo (apply to answers)", at)
        elif line.startswith("[venv] installing the dependencies"):
            begin("venv: dependencies (pip)", at)
        elif line.startswith("[venv] installed the dependencies"):
            end("venv: dependencies (pip)", at)
        elif "[tpuft] installing Debian packages" in line:
            begin("Debian packages (apt)", at)
        elif "[tpuft] installed Debian packages" in line:
            end("Debian packages (apt)", at)
        elif m := re.search(r"\[tpuft\] building (.+?) \(first time", line):
            begin(f"go: {m.group(1)}", at)
        elif m := re.search(r"\[tpuft\] built (.+?) in \d+m\d+s", line):
            end(f"go: {m.group(1)}", at)
        elif re.search(r"\[tpuft\] downloading etcd ", line):
            begin("etcd (PyPI wheel)", at)
        elif re.search(r"\[tpuft\] etcd \S+ -> ", line) and "etcd (PyPI wheel)" in open_stages:
            end("etcd (PyPI wheel)", at)
        elif m := re.search(r"\[tpuft\] (\w+): building \S+ \(inputs", line):
            begin(f"image: {m.group(1)}", at)
        elif m := re.search(r"\[tpuft\] (\w+): \S+ [\d.]+ MB in \d+ s", line):
            end(f"image: {m.group(1)}", at)
            if m.group(1) != "base":   # the base is built on the way, never exported
                begin(f"image export: {m.group(1)}", at)
        elif m := re.search(r"\[tpuft\] (\w+): \S+ [\d.]+ MB, built, ", line):
            if f"image export: {m.group(1)}" in open_stages:
                end(f"image export: {m.group(1)}", at)
        elif m := re.search(r"\[tpuft\] imported (\S+) into the node's containerd", line):
            done.append(Stage(f"containerd import: {m.group(1)}", at, at))
    last = lines[-1][0] if lines else 0.0
    for stage in open_stages.values():
        if stage.name.startswith("demo"):
            stage.end_s = last
        done.append(stage)
    return sorted(done, key=lambda s: (s.start_s, s.name))


def run_make_demo(clone: Path, env: dict[str, str], log: Path, kind: str, timeout: float) -> Run:
    say(f"{kind}: make demo in {clone} (log {log})")
    start = time.monotonic()
    lines: list[tuple[float, str]] = []
    with open(log, "w") as out:
        proc = subprocess.Popen(["make", "demo"], cwd=clone, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, bufsize=1, start_new_session=True)

        def stop(*_):
            os.killpg(proc.pid, signal.SIGTERM)   # the group `make` leads: only what this bench started
        signal.signal(signal.SIGALRM, stop)
        signal.alarm(int(timeout))
        try:
            for line in proc.stdout:
                at = time.monotonic() - start
                lines.append((at, line.rstrip("\n")))
                stamped = f"[{at:7.1f}s] {line}"
                out.write(stamped)
                out.flush()
                sys.stderr.write(stamped)
            rc = proc.wait()
        finally:
            signal.alarm(0)
    wall = time.monotonic() - start
    if wall >= timeout:
        say(f"{kind}: stopped at the {timeout:.0f} s bound")
    return Run(kind, rc, round(wall, 1), str(log), stages_of(lines))


def cluster_down(clone: Path, env: dict[str, str]) -> None:
    tpuft = clone / ".venv" / "bin" / "tpuft"
    if tpuft.exists():
        say("tpuft cluster down")
        subprocess.run([str(tpuft), "cluster", "down"], cwd=clone, env=env, timeout=600, check=False)


def table(runs: list[Run]) -> str:
    rows = []
    for run in runs:
        rows.append(f"## {run.kind} make demo: rc {run.rc}, {run.wall_s:.0f} s ({run.wall_s / 60:.1f} min)")
        rows.append(f"{'start s':>8} {'end s':>8} {'seconds':>8}  stage")
        for stage in run.stages:
            end = "-" if stage.end_s is None else f"{stage.end_s:.0f}"
            secs = "-" if stage.seconds is None else f"{stage.seconds:.0f}"
            rows.append(f"{stage.start_s:>8.0f} {end:>8} {secs:>8}  {stage.name}")
        rows.append("")
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", type=Path, help="where the caches go (default: a new folder under /var/tmp, "
                                                  "removed at the end; a named one is kept)")
    parser.add_argument("--ref", default="HEAD", help="the commit of this repository to clone (default HEAD)")
    parser.add_argument("--warm", action="store_true",
                        help="then `tpuft cluster down` and `make demo` again in a second fresh clone, caches kept")
    parser.add_argument("--timeout", type=float, default=3600, help="bound on each `make demo`, seconds")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "cold_start.json")
    args = parser.parse_args()

    if busy := running_cluster():
        say(f"a local cluster or control plane is running ({', '.join(busy[:4])}): stop it first "
            "(`tpuft cluster down`); the bench needs the machine alone")
        return 2
    made_root = args.root is None
    root = Path(tempfile.mkdtemp(prefix="tpuft-cold-", dir="/var/tmp")) if made_root else args.root.expanduser()
    if stale := not_empty(root):
        say(f"not a cold start, these caches are not empty: {', '.join(stale)}; empty them or pick another --root")
        return 2
    env = environment(root)
    rev = subprocess.run(["git", "rev-parse", args.ref], cwd=REPO, capture_output=True, text=True,
                         check=True).stdout.strip()
    result = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), "commit": rev,
              "cpus": os.cpu_count(), "load_average_before": os.getloadavg(), "root": str(root),
              "caches": {var: str(root / rel) for var, rel in CACHES.items()}, "runs": []}
    runs: list[Run] = []
    work = Path(tempfile.mkdtemp(prefix="tpuft-cold-clones-", dir="/var/tmp"))
    try:
        for kind in ("cold", "warm") if args.warm else ("cold",):
            clone = work / kind
            subprocess.run(["git", "clone", "--quiet", "--no-local", str(REPO), str(clone)], check=True)
            subprocess.run(["git", "checkout", "--quiet", rev], cwd=clone, check=True)
            try:
                runs.append(run_make_demo(clone, env, work / f"{kind}.log", kind, args.timeout))
            finally:
                cluster_down(clone, env)
            kept = args.out.with_name(f"{args.out.stem}_{kind}.log")
            kept.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(work / f"{kind}.log", kept)
            runs[-1].log = str(kept)
            if runs[-1].rc != 0:
                break
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if made_root:
            shutil.rmtree(root, ignore_errors=True)
    result["runs"] = [dict(asdict(run), stages=[dict(asdict(s), seconds=s.seconds) for s in run.stages])
                      for run in runs]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    text = table(runs)
    args.out.with_suffix(".txt").write_text(text + "\n")
    print(text)
    return 0 if runs and all(run.rc == 0 for run in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
