"""tpuft.kube: the API I/O module takes its types from tpuft.observed, not from the decision module."""
import ast
from pathlib import Path

from tpuft import kube


def test_kube_does_not_import_the_decision_module():
    tree = ast.parse(Path(kube.__file__).read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert "tpuft.phases" not in imported and "tpuft.observed" in imported
