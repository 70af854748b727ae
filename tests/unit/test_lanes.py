"""tests/lanes.py, what `make test` runs: every test file is in some tier, and only in one."""
import ast
import subprocess
from pathlib import Path

from tests import lanes

TESTS = Path(lanes.REPO) / "tests"
CONTROL_PLANE_FIXTURES = {"control_plane", "kubeconfig", "kube_api", "kubectl", "namespace"}   # tests/conftest.py


def _paths(tier: lanes.Tier) -> list[str]:
    return [a for a in tier.argv if a.startswith("tests/")]


def _ignored(tier: lanes.Tier) -> set[str]:
    return {a.split("=", 1)[1] for a in tier.argv if a.startswith("--ignore=")}


def test_every_test_file_is_run_by_some_tier():
    covered = [(p, _ignored(t)) for t in lanes.all_tiers() if t.pytest for p in _paths(t)]
    ignored = set().union(*(_ignored(t) for t in lanes.all_tiers()))
    for path in sorted(TESTS.rglob("test_*.py")):
        rel = path.relative_to(lanes.REPO).as_posix()
        hits = [c for c, skip in covered if (rel == c or rel.startswith(c.rstrip("/") + "/")) and rel not in skip]
        assert hits, f"{rel} is run by no tier of tests/lanes.py"
        if rel == lanes.DOWN_TEST:
            continue
        # tests/cluster is split by marker between two tiers; everything else is in exactly one
        assert len(hits) == 1 or (rel.startswith("tests/cluster/") and rel not in ignored), (rel, hits)


def test_the_workload_modules_run_off_the_ray_lane_start_no_ray():
    """They run beside the Ray tier, so none may take the host-wide Ray lock (tests/workload/conftest.py)."""
    for rel in lanes.WORKLOAD_WITHOUT_RAY:
        text = (Path(lanes.REPO) / rel).read_text()
        assert "ray_cluster" not in text and "ray.init" not in text and "serve.run" not in text, rel


def test_the_ray_lane_asks_for_no_control_plane():
    """It starts beside a cold `cluster up` that is still building kube-apiserver: a control-plane
    fixture there would wait on the build lock inside a test, past pytest's timeout."""
    ray_lane = [t for t in lanes.LANES["workload"] if t.pytest]
    ignored = set().union(*(_ignored(t) for t in ray_lane))
    for path in sorted((TESTS / "workload").glob("test_*.py")):
        rel = path.relative_to(lanes.REPO).as_posix()
        if rel not in ignored:
            asked = {a.arg for f in ast.walk(ast.parse(path.read_text())) if isinstance(f, ast.FunctionDef)
                     for a in f.args.args}
            assert not asked & CONTROL_PLANE_FIXTURES, rel
    assert not any(t.needs_cluster for t in lanes.LANES["workload"])


def test_the_cluster_tiers_split_tests_cluster_by_the_real_node_marker():
    simulated = [t for t in lanes.all_tiers() if "tests/cluster" in t.argv]
    assert [t.argv[t.argv.index("-m") + 1] for t in simulated] == ["cluster and not real_node"]
    assert f"--ignore={lanes.DOWN_TEST}" in simulated[0].argv
    real = [t for t in lanes.all_tiers() if t.argv[:2] == lanes.REAL_NODE]
    files = sorted(p for t in real for p in _paths(t))
    # every file holding a real_node test is in one of the real-node tiers, and only those
    marked = sorted(p.relative_to(lanes.REPO).as_posix() for p in (TESTS / "cluster").glob("test_*.py")
                    if "pytest.mark.real_node" in p.read_text())
    assert files == marked


def test_tiers_needing_the_cluster_come_after_cluster_up_or_wait_for_it():
    # up beside the fast tiers (before every lane), then the leftovers of earlier sessions cleared
    # first in the cluster lane, before any test on the cluster
    assert all(lanes.CLUSTER_UP not in tiers for tiers in lanes.LANES.values())
    for name, tiers in lanes.LANES.items():
        if lanes.LEFTOVERS in tiers:
            assert tiers[0] is lanes.LEFTOVERS, name
        else:
            cluster_tests = [t for t in tiers if "tests/cluster" in t.argv or "tests/images/test_images.py" in t.argv]
            assert all(t.needs_cluster for t in cluster_tests), name


def _orchestrate(monkeypatch, tmp_path, failing: set[str]) -> list[str]:
    """main() with every tier's run replaced by a record of its name (exit 1 for those in `failing`)."""
    ran: list[str] = []

    def fake_run(tier, logs):
        ran.append(tier.name)
        log = tmp_path / "x.log"
        log.write_text("")
        return lanes.Result(tier, 0.0, 1 if tier.name in failing else 0, log, None)

    monkeypatch.setattr(lanes, "_run", fake_run)
    monkeypatch.setattr(lanes, "_show", lambda results: None)
    rc = lanes.main(["--logs", str(tmp_path)])
    assert rc == (1 if failing else 0)
    return ran


def test_a_failed_fast_tier_runs_no_lane_and_takes_the_cluster_it_brought_up_down(monkeypatch, tmp_path):
    ran = _orchestrate(monkeypatch, tmp_path, {lanes.FAST[0].name})
    assert sorted(ran) == sorted([*(t.name for t in lanes.FAST), lanes.CLUSTER_UP.name,
                                  lanes.DOWN_AFTER_FAILED_FAST.name])
    assert ran[-1] == lanes.DOWN_AFTER_FAILED_FAST.name


def test_an_up_that_failed_skips_every_tier_needing_the_cluster_and_keeps_the_packages(monkeypatch, tmp_path):
    ran = _orchestrate(monkeypatch, tmp_path, {lanes.CLUSTER_UP.name})
    needing = {t.name for tiers in lanes.LANES.values() for t in tiers if t.needs_cluster}
    assert not needing & set(ran) and lanes.LEFTOVERS.name not in ran
    assert lanes.TOOLS.name in ran and ran[-1] == lanes.DOWN_AFTER_FAILED_UP.name


def test_all_green_runs_every_tier_once_then_down(monkeypatch, tmp_path):
    ran = _orchestrate(monkeypatch, tmp_path, set())
    assert sorted(ran) == sorted(t.name for t in lanes.all_tiers()) and ran[-1] == lanes.DOWN.name


def test_the_two_cpu_heavy_tiers_never_overlap(monkeypatch, tmp_path):
    """The Ray tier and the real node's tests take the same group lock: one runs, then the other."""
    import threading
    import time as _time

    heavy = [t for t in lanes.all_tiers() if t.exclusive == lanes.CPU_HEAVY]
    assert sorted(t.name for t in heavy) == ["real node", "workload"]
    running, overlaps = set(), []
    guard = threading.Lock()

    def fake_subprocess_run(argv, **kw):
        name = next(t.name for t in heavy if list(t.argv)[-1] == argv[-1])
        with guard:
            overlaps.append(bool(running))
            running.add(name)
        _time.sleep(0.2)
        with guard:
            running.discard(name)
        return lanes.subprocess.CompletedProcess(argv, 0)

    monkeypatch.setattr(lanes.subprocess, "run", fake_subprocess_run)
    threads = [threading.Thread(target=lanes._run, args=(t, tmp_path)) for t in heavy]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert overlaps == [False, False]


def test_only_the_ray_free_workload_modules_run_in_the_background():
    background = [t.name for lane in lanes.LANES.values() for t in lane if t.background]
    assert background == ["workload (no Ray)"]


def test_a_background_command_runs_in_its_cgroup_under_its_own_pid(tmp_path):
    procs = tmp_path / "cgroup.procs"
    out = subprocess.run(lanes.in_cgroup(["sh", "-c", 'echo "$$ $0"', "argv0 kept"], procs),
                         capture_output=True, text=True, check=True).stdout.split(maxsplit=1)
    assert procs.read_text().split() == [out[0]]      # the shell moved itself, then exec'd the command
    assert out[1].strip() == "argv0 kept"            # the command's arguments passed through as given


def test_without_a_cpu_cgroup_controller_a_background_tier_runs_as_before(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(lanes, "CPU_CGROUPS", tmp_path / "no-such-controller")
    with lanes._background_cgroup("workload-no-ray") as procs:
        assert procs is None
    assert "runs niced only" in capsys.readouterr().out
