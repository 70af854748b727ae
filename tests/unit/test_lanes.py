"""tests/lanes.py, what `make test` runs: every test file is in some tier, and only in one."""
from pathlib import Path

from tests import lanes

TESTS = Path(lanes.REPO) / "tests"


def _paths(tier: lanes.Tier) -> list[str]:
    return [a for a in tier.argv if a.startswith("tests/")]


def test_every_test_file_is_run_by_some_tier():
    covered = [p for t in lanes.all_tiers() if t.pytest for p in _paths(t)]
    ignored = {a.split("=", 1)[1] for t in lanes.all_tiers() for a in t.argv if a.startswith("--ignore=")}
    for path in sorted(TESTS.rglob("test_*.py")):
        rel = path.relative_to(lanes.REPO).as_posix()
        hits = [c for c in covered if rel == c or rel.startswith(c.rstrip("/") + "/")]
        assert hits, f"{rel} is run by no tier of tests/lanes.py"
        if rel == lanes.DOWN_TEST:
            continue
        # tests/cluster is split by marker between two tiers; everything else is in exactly one
        assert len(hits) == 1 or (rel.startswith("tests/cluster/") and rel not in ignored), (rel, hits)


def test_the_cluster_tiers_split_tests_cluster_by_the_real_node_marker():
    cluster_tiers = [t for t in lanes.all_tiers() if "tests/cluster" in t.argv]
    assert sorted(t.argv[t.argv.index("-m") + 1] for t in cluster_tiers) == \
        ["cluster and not real_node", "cluster and real_node"]
    assert all(f"--ignore={lanes.DOWN_TEST}" in t.argv for t in cluster_tiers)


def test_tiers_needing_the_cluster_come_after_cluster_up_or_wait_for_it():
    for name, tiers in lanes.LANES.items():
        if lanes.CLUSTER_UP in tiers:
            assert tiers[0] is lanes.CLUSTER_UP, name
        else:
            cluster_tests = [t for t in tiers if "tests/cluster" in t.argv or "tests/images/test_images.py" in t.argv]
            assert all(t.needs_cluster for t in cluster_tests), name
