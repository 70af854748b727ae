"""tpuft.controller.kube: the API I/O module takes its types from tpuft.controller.observed, not from the decision module."""
import ast
from pathlib import Path

from tpuft.controller import kube
from tpuft.controller.observed import Action, Op


def test_kube_does_not_import_the_decision_module():
    tree = ast.parse(Path(kube.__file__).read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert "tpuft.controller.phases" not in imported and "tpuft.controller.observed" in imported


class _Custom:
    def __init__(self):
        self.deletes = []

    def delete_namespaced_custom_object(self, group, version, ns, plural, name, **kw):
        self.deletes.append((plural, name, kw["propagation_policy"]))


def test_a_rayjob_is_deleted_in_the_foreground_other_children_in_the_background():
    """Foreground: the RayJob is gone only once its submitter Job and pods are, so the RayCluster
    deleted after it cannot fail a submitter still following the job (phases.jobs._release)."""
    k = kube.Kube.__new__(kube.Kube)
    k.custom, k.timeout = _Custom(), 30.0
    for kind, name in (("RayJob", "ft-train"), ("RayCluster", "ft-ray"), ("RayService", "ft-serve")):
        k.perform("team-a", "u-1", Action(Op.DELETE, kind, name))
    assert k.custom.deletes == [("rayjobs", "ft-train", "Foreground"), ("rayclusters", "ft-ray", "Background"),
                                ("rayservices", "ft-serve", "Background")]
