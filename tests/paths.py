"""Where tests find the repo and the read-only ../shared reference beside it."""
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
KUBERAY_REF = SHARED / "reference" / "kuberay-v1.7.0"
SEED_TUTORIAL = SHARED / "seeds" / "000_1c0cde7d1de87025.txt"
EXAMPLES = REPO / "examples"
GOLDEN = REPO / "tests" / "golden"
