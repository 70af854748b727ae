"""Where tests find the repo and the reference data they need (all inside the repo)."""
import functools
import gzip
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "tests" / "data"
# KubeRay v1.7.0's CRDs (gzipped, for schema validation) and TPU samples, copied from its release.
KUBERAY_REF = DATA / "kuberay-v1.7.0"
# The NetworkPolicy schemas of Kubernetes v1.35.3's OpenAPI v3 document (api/openapi-spec/v3/
# apis__networking.k8s.io__v1_openapi.json in kubernetes/kubernetes, the local cluster's version):
# NetworkPolicy and every schema it refers to, nothing else.
NETWORK_POLICY_OPENAPI = DATA / "kubernetes-v1.35.3" / "networking.k8s.io_v1_networkpolicy.openapi.json"
TUTORIAL_RAYCLUSTERS = DATA / "gke-tutorial-rayclusters.yaml"
EXAMPLES = REPO / "examples"
GOLDEN = REPO / "tests" / "golden"


def kuberay_crd(name: str) -> dict:
    """A KubeRay v1.7.0 CRD by file name, e.g. ray.io_rayclusters.yaml (a fresh copy each call)."""
    return yaml.load(_kuberay_crd_text(name), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


@functools.cache
def _kuberay_crd_text(name: str) -> bytes:
    # Parsed per call (callers may edit the result), but read and unzipped once: the CRDs are ~1 MB of YAML.
    return gzip.decompress((KUBERAY_REF / f"{name}.gz").read_bytes())
