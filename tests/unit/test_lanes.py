"""tests/lanes.py, what `make test` runs: every test file is in some tier, and only in one."""
from pathlib import Path

from tests import lanes

TESTS = Path(lanes.REPO) / "tests"


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
    for name, tiers in lanes.LANES.items():
        if lanes.CLUSTER_UP in tiers:
            # up, then the leftovers of earlier sessions cleared, before any test on the cluster
            assert tuple(tiers[:len(lanes.UP_TIERS)]) == lanes.UP_TIERS, name
        else:
            cluster_tests = [t for t in tiers if "tests/cluster" in t.argv or "tests/images/test_images.py" in t.argv]
            assert all(t.needs_cluster for t in cluster_tests), name
