"""The RayCluster manifests of GKE's Ray-on-TPU tutorial (tests/data/gke-tutorial-rayclusters.yaml), for golden checks."""
import yaml

from tests.paths import TUTORIAL_RAYCLUSTERS


def tutorial_rayclusters() -> dict[str, dict]:
    """{worker group name: RayCluster dict} for every RayCluster manifest in the tutorial."""
    docs = yaml.safe_load_all(TUTORIAL_RAYCLUSTERS.read_text())
    return {doc["spec"]["workerGroupSpecs"][0]["groupName"]: doc for doc in docs}


def missing_from(expected, actual, path="") -> list[str]:
    """Paths where `actual` lacks a value `expected` sets (lists of named dicts match by name)."""
    out = []
    if isinstance(expected, dict):
        if not isinstance(actual, dict):
            return [f"{path}: expected an object, got {actual!r}"]
        for k, v in expected.items():
            out += missing_from(v, actual.get(k), f"{path}.{k}") if k in actual else [f"{path}.{k}: missing"]
    elif isinstance(expected, list):
        if not isinstance(actual, list):
            return [f"{path}: expected a list, got {actual!r}"]
        named = all(isinstance(e, dict) and "name" in e for e in expected)
        for idx, e in enumerate(expected):
            if named:
                match = [a for a in actual if isinstance(a, dict) and a.get("name") == e["name"]]
                out += missing_from(e, match[0], f"{path}[{e['name']}]") if match else [f"{path}[{e['name']}]: missing"]
            else:
                out += missing_from(e, actual[idx], f"{path}[{idx}]") if idx < len(actual) else [f"{path}[{idx}]: missing"]
    elif str(expected) != str(actual):
        out.append(f"{path}: tutorial {expected!r} != ours {actual!r}")
    return out
