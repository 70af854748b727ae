"""`make test`: every test tier, fast ones first, the slow ones in parallel lanes.

    python -m tests.lanes [--only TIER ...] [--logs DIR]

1. `fast`: tests/unit, and beside it (two pytest processes at once) local, packaging and the
   Dockerfile checks: about a minute; a failure here stops the run, so a broken unit test fails CI
   in a minute, not an hour. `tpuft cluster up` starts beside them and runs on in the background
   (a fast tier that fails takes the cluster down again once it is up): on a cold machine it builds
   the Go tools and images for some 25 minutes, much of it waiting on disk and network.
2. Four lanes at once, as soon as the fast tiers pass, each a list of tiers run one after another
   (the integration lane's first waits for the Go tools; the Ray lane needs nothing from `up`):
     cluster      once the cluster is up, tests/leftovers.py (deletes the runs an earlier session
                  left on the cluster: its state outlives `down`), then the tests marked
                  `real_node` (they train on the real node): the demo, then the one run through
                  every disruption, one after the other (beside each other, up to five RayClusters
                  shared the node's 2 cores and their deadlines passed);
     simulated    once the cluster is up and cleared: the cluster tests that do not train (KWOK
                  slices, which mostly wait; the CLI; the operator's image), then the image tests;
     integration  integration and chart (their own control planes; not niced: they bound the
                  operator's reaction times), then the workload modules that start no Ray, in the
                  background (a cpu cgroup weighing 128 against the pods' 2048: BACKGROUND_SHARES);
     workload     the rest of the workload tier (real Ray and torch), not niced (and its Ray
                  workers at niceness 0: tests/workload/conftest.py says why).
   The workload tier and the real node's tests never run at the same time (CPU_HEAVY): the
   workload tier goes first, the real node's tests wait for it.
3. `down`: tests/cluster/test_zz_down.py, after every lane, whenever the cluster came up (after
   an `up` that failed, `tpuft cluster down --keep-packages`, so the host is left as it was).

Each tier is one pytest process with its own log and JUnit file under --logs (default
.test-logs/); a lane's logs are printed whole when it ends, then one table of every tier's time
and the 30 slowest tests of the whole run. Exit status: 0 only if every tier passed.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import re
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable
HEARTBEAT_S = 120
SLOWEST = 30
DOWN_TEST = "tests/cluster/test_zz_down.py"   # takes the cluster down: after every lane, alone
WITHOUT_DOWN = [f"--ignore={DOWN_TEST}"]


@dataclasses.dataclass(frozen=True)
class Tier:
    name: str
    argv: tuple[str, ...]          # a pytest command line (after `python -m pytest`), or a command
    pytest: bool = True
    nice: int = 0
    background: bool = False       # in a cgroup of its own weighing BACKGROUND_SHARES (see there)
    needs_cluster: bool = False    # starts once `cluster up` has succeeded
    exclusive: str = ""            # tiers naming the same group never run at the same time (CPU_HEAVY)


def _pytest(name: str, *args: str, nice: int = 0, background: bool = False, needs_cluster: bool = False,
            exclusive: str = "") -> Tier:
    return Tier(name, args, nice=nice, background=background, needs_cluster=needs_cluster, exclusive=exclusive)


# A background tier takes the CPU the others leave. Niceness cannot do that beside the real node: the
# kubelet's pods are a cgroup of their own (cpu.shares 2048 for 2 cores), and a nice value weighs a
# process only against the processes of its own cgroup. Beside the Ray-free workload modules at nice 5
# the real node's run queue stood near 30 and the CPU 2% idle; alone, the same real-node tests left
# 57% of it idle (vmstat, clean-clone CI of 2026-12-08). So the background tier gets a cgroup (v1's cpu
# controller, as this machine and the kubelet have) weighing 128 against the pods' 2048, made for
# the tier and removed after it; where there is none (cgroup v2, not root) it runs as it did, niced.
CPU_CGROUPS = Path("/sys/fs/cgroup/cpu")
BACKGROUND_SHARES = 128


def in_cgroup(argv: list[str], procs: Path) -> list[str]:
    """`argv` run by a shell that first moves itself into the cgroup whose cgroup.procs is `procs`
    (exec keeps the PID; children inherit the cgroup). Not preexec_fn: the lanes are threads."""
    return ["sh", "-c", f'echo $$ > "{procs}" && exec "$@"', "sh", *argv]


@contextlib.contextmanager
def _background_cgroup(slug: str):
    """The cgroup.procs of a new cpu cgroup for one tier (None where there can be none); removed after,
    once its processes have ended (a straggler is moved to the parent first)."""
    group = CPU_CGROUPS / f"tpuft-lanes-{slug}"
    try:
        group.mkdir(exist_ok=True)
        (group / "cpu.shares").write_text(str(BACKGROUND_SHARES))
    except OSError as e:
        _say(f"{slug}: no background cgroup ({e}); it runs niced only")
        yield None
        return
    try:
        yield group / "cgroup.procs"
    finally:
        for pid in (group / "cgroup.procs").read_text().split():
            with contextlib.suppress(OSError):
                (CPU_CGROUPS / "cgroup.procs").write_text(pid)
        with contextlib.suppress(OSError):
            group.rmdir()


# The Ray tier and the real node's tests each keep both cores busy (torch and Ray workers; Ray
# clusters in pods). Side by side they thrashed: 1634 s and 1574 s in a warm clean-clone run of
# 2026-12-04, against 545 s and 722 s when each overlapped only the lighter lanes (a cold run of
# 2026-12-05). One after the other (the Ray tier first: it needs no cluster) they end sooner.
CPU_HEAVY = "cpu-heavy"
_GROUPS: dict[str, threading.Lock] = {}


# The fast tiers, two pytest processes side by side on the 2 cores (about 50 s of tests each; one
# process took 116 s in a clean-clone run of 2026-12-03): every lane waits for them.
FAST = (_pytest("fast (unit)", "tests/unit"),
        _pytest("fast (packaging)", "tests/local", "tests/packaging", "tests/images/test_dockerfiles.py",
                "tests/images/test_operator_wheel.py"))
# Started beside the fast tiers and not waited for by the lanes that do not need it: warm, it takes
# a minute (mostly waiting on processes and image imports); cold, it builds for some 25 minutes.
# With Argo CD (tests/cluster/test_argocd.py, and the demo test's served base comes through it).
CLUSTER_UP = Tier("cluster up", (PY, "-m", "tpuft.cli", "cluster", "up", "--argocd"), pytest=False)
# What an earlier session left running on the cluster (its state outlives `down`), deleted before
# any cluster test starts: see tests/leftovers.py.
LEFTOVERS = Tier("leftovers", (PY, "-m", "tests.leftovers"), pytest=False)
# The Go tools the integration and chart tiers' own control planes run (kube-apiserver, helm, ...):
# on a cold machine `cluster up` is building them (minutes), and a test fixture waiting on the
# build lock would hit pytest's per-test timeout first. This waits for (or builds) them without
# one: a second when they are cached.
TOOLS = Tier("tools", (PY, "-m", "tpuft.cli", "cluster", "tools"), pytest=False)
REAL_NODE = ("-m", "cluster and real_node")
# The real-node tests one after another: the demo holds up to three RayClusters (two served models
# and a third run); with the disruption runs beside it the node's 2 cores ran five, and a run's
# provisioning deadline passed (a clean-clone run of 2026-12-02).
REAL_NODE_FILES = ("tests/cluster/test_demo.py", "tests/cluster/test_lifecycle.py")
# tests/workload modules that start no local Ray (torch, transformers, jax, a control plane):
# tests/unit/test_lanes.py checks that none of them uses the Ray fixture.
WORKLOAD_WITHOUT_RAY = ("tests/workload/test_jax_model.py", "tests/workload/test_jax_parity.py",
                        "tests/workload/test_jax_lora.py",
                        "tests/workload/test_platform_cli.py",
                        "tests/workload/test_data.py", "tests/workload/test_batching.py",
                        "tests/workload/test_model.py", "tests/workload/test_metrics_log.py",
                        "tests/workload/test_preemption.py", "tests/workload/test_loop.py",
                        "tests/workload/test_lora.py", "tests/workload/test_engine_process.py",
                        "tests/workload/test_render.py", "tests/workload/test_learning.py",
                        "tests/workload/test_sharded_load.py", "tests/workload/test_elastic.py",
                        "tests/workload/test_checkpoint_request.py", "tests/workload/test_object_store.py",
                        "tests/workload/test_adapters.py", "tests/workload/test_objective.py",
                        "tests/workload/test_tiny_chat.py", "tests/workload/test_safetensors_ranges.py",
                        "tests/workload/test_serve_config.py")
LANES: dict[str, list[Tier]] = {
    "cluster": [LEFTOVERS, _pytest("real node", *REAL_NODE, *REAL_NODE_FILES, exclusive=CPU_HEAVY)],
    "simulated": [_pytest("cluster (simulated)", "-m", "cluster and not real_node", "tests/cluster", *WITHOUT_DOWN,
                          needs_cluster=True),
                  _pytest("images", "tests/images/test_images.py", needs_cluster=True)],
    # Their own control planes and an in-process operator whose reaction times the tests bound
    # (a deadline plus 4 s): not niced (at nice 5 beside four busy lanes it missed them by 6 s).
    # Then the workload modules that start no Ray (they need not wait for the host-wide Ray lock),
    # off the longest lane.
    "integration": [TOOLS, _pytest("integration+chart", "tests/integration", "tests/chart"),
                    _pytest("workload (no Ray)", *WORKLOAD_WITHOUT_RAY, nice=5, background=True)],
    # The longest lane. Not niced, and its Ray workers at niceness 0, not Ray's 15
    # (tests/workload/conftest.py): the real node's pods share one cgroup weighing two busy
    # processes, and at 15 (CPU weight 36) these workers got a fifth of the CPU they need (a killed
    # run 544 s that takes 101 s alone; one passed pytest's 900 s timeout at 19). Its Ray driver,
    # raylet and GCS at 0 also keep ray.init inside Ray's 30 s startup window (missed twice at nice 10).
    "workload": [_pytest("workload", "tests/workload", *(f"--ignore={f}" for f in WORKLOAD_WITHOUT_RAY),
                         exclusive=CPU_HEAVY)],
}
# The cluster is ready for the tiers marked needs_cluster once CLUSTER_UP (beside the fast tiers)
# and then LEFTOVERS (first in the cluster lane) have passed.
DOWN = _pytest("down", DOWN_TEST)
# After an `up` that failed part way: undo what it did to the host without the test's checks.
DOWN_AFTER_FAILED_UP = Tier("down (up failed)", (PY, "-m", "tpuft.cli", "cluster", "down", "--keep-packages"),
                            pytest=False)
# After a fast tier failed beside an `up` that succeeded: no lane runs, the host is left as it was.
DOWN_AFTER_FAILED_FAST = Tier("down (fast failed)", (PY, "-m", "tpuft.cli", "cluster", "down"), pytest=False)


@dataclasses.dataclass
class Result:
    tier: Tier
    seconds: float
    rc: int
    log: Path
    junit: Path | None


def _run(tier: Tier, logs: Path) -> Result:
    slug = re.sub(r"[^a-z0-9]+", "-", tier.name.lower()).strip("-")   # "cluster (real node)" -> cluster-real-node
    log, junit = logs / f"{slug}.log", logs / f"{slug}.xml"
    if tier.pytest:
        argv = [PY, "-m", "pytest", "-q", f"--junitxml={junit}", "--durations=10", *tier.argv]
    else:
        argv, junit = list(tier.argv), None
    if tier.nice:
        argv = ["nice", "-n", str(tier.nice), *argv]
    group = _GROUPS.setdefault(tier.exclusive, threading.Lock()) if tier.exclusive else contextlib.nullcontext()
    with group, (_background_cgroup(slug) if tier.background else contextlib.nullcontext()) as procs:
        _say(f"start {tier.name}: {' '.join(argv[argv.index('-m') + 1:] if '-m' in argv else argv)}  (log {log})"
             + (f" in {procs.parent} (cpu.shares {BACKGROUND_SHARES})" if procs else ""))
        start = time.monotonic()
        with open(log, "w") as out:
            rc = subprocess.run(in_cgroup(argv, procs) if procs else argv, cwd=REPO, stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL).returncode
    res = Result(tier, time.monotonic() - start, rc, log, junit if junit and junit.exists() else None)
    _say(f"{'ok  ' if rc == 0 else 'FAIL'} {tier.name}: {res.seconds:.0f} s (exit {rc})")
    return res


T0 = time.monotonic()
_print_lock = threading.Lock()


def _say(msg: str) -> None:
    with _print_lock:
        print(f"[lanes {time.monotonic() - T0:6.0f}s] {msg}", flush=True)


def _show(results: list[Result]) -> None:
    with _print_lock:
        for r in results:
            print(f"\n===== {r.tier.name} ({r.seconds:.0f} s, exit {r.rc}): {r.log} =====", flush=True)
            print(r.log.read_text(errors="replace").rstrip(), flush=True)


def _lane(tiers: list[Tier], logs: Path, results: list[Result], up_done: threading.Event,
          up_ok: threading.Event, up_future: Future | None = None) -> None:
    """Run `tiers` one after another; the cluster lane (`up_future` given) first waits for `up`."""
    mine: list[Result] = []
    if up_future is not None:
        up = up_future.result()
        mine.append(up)
        if up.rc != 0:
            up_done.set()   # the other lanes' tiers that need the cluster are skipped
            _say("skip the cluster lane: the cluster did not come up")
            tiers = []
    for i, tier in enumerate(tiers):
        if tier.needs_cluster:
            up_done.wait()
            if not up_ok.is_set():
                _say(f"skip {', '.join(t.name for t in tiers[i:])}: the cluster did not come up")
                break
        res = _run(tier, logs)
        mine.append(res)
        if tier is LEFTOVERS:
            if res.rc == 0:
                up_ok.set()
            up_done.set()
            if res.rc != 0:
                break
    results.extend(mine)
    _show(mine)


def _in_parallel(tiers: tuple[Tier, ...], logs: Path) -> list[Result]:
    with ThreadPoolExecutor(max_workers=max(len(tiers), 1)) as pool:
        return list(pool.map(lambda tier: _run(tier, logs), tiers))


def all_tiers() -> list[Tier]:
    return [*FAST, CLUSTER_UP, *(t for lane in LANES.values() for t in lane), DOWN]


def _slowest(results: list[Result], n: int = SLOWEST) -> list[tuple[float, str]]:
    rows = []
    for r in results:
        if r.junit is None:
            continue
        for case in ET.parse(r.junit).getroot().iter("testcase"):
            rows.append((float(case.get("time") or 0), f"{case.get('classname')}::{case.get('name')}"))
    return sorted(rows, reverse=True)[:n]


def _report(results: list[Result], wall: float) -> None:
    print(f"\n===== time per tier (wall {wall:.0f} s = {wall / 60:.1f} min) =====")
    for r in results:
        print(f"{r.tier.name:<24} {r.seconds:7.0f} s  {'passed' if r.rc == 0 else f'FAILED (exit {r.rc})'}")
    print(f"\n===== {SLOWEST} slowest tests (setup + call + teardown) =====")
    for secs, name in _slowest(results):
        print(f"{secs:8.1f} s  {name}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.lanes", description=__doc__.split("\n\n")[0])
    ap.add_argument("--logs", type=Path, default=REPO / ".test-logs")
    ap.add_argument("--only", nargs="+", choices=["fast", *LANES, "down"],
                    help="run these parts only (default: all, in the order above)")
    args = ap.parse_args(argv)
    args.logs.mkdir(parents=True, exist_ok=True)
    want = set(args.only or ["fast", *LANES, "down"])
    results: list[Result] = []

    # `up` beside everything: on a cold machine it builds the Go tools and images for half an hour,
    # much of it waiting on disk and network, and the lanes that need no cluster run meanwhile.
    background = ThreadPoolExecutor(max_workers=1)
    up_future = background.submit(_run, CLUSTER_UP, args.logs) if "cluster" in want else None
    got = _in_parallel(FAST if "fast" in want else (), args.logs)
    results.extend(got)
    _show(got)
    if any(r.rc != 0 for r in got):
        if up_future is not None:
            up = up_future.result()
            results.append(up)
            _show([up])
            res = _run(DOWN_AFTER_FAILED_FAST if up.rc == 0 else DOWN_AFTER_FAILED_UP, args.logs)
            results.append(res)
            _show([res])
        _report(results, time.monotonic() - T0)
        return 1

    up_done, up_ok = threading.Event(), threading.Event()
    if up_future is None:   # --only simulated/down: a cluster the developer brought up themselves
        up_ok.set()
        up_done.set()
    threads = [threading.Thread(target=_lane, args=(LANES[name], args.logs, results, up_done, up_ok,
                                                    up_future if name == "cluster" else None),
                                name=name, daemon=True) for name in LANES if name in want]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        for t in threads:
            t.join(timeout=HEARTBEAT_S / max(len(threads), 1))
        running = [t.name for t in threads if t.is_alive()]
        if running:
            _say(f"still running: {', '.join(running)}")

    if "down" in want and (up_ok.is_set() or "cluster" in want):
        res = _run(DOWN if up_ok.is_set() else DOWN_AFTER_FAILED_UP, args.logs)
        results.append(res)
        _show([res])
    _report(results, time.monotonic() - T0)
    return 0 if results and all(r.rc == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
