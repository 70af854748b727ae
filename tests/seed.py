"""Reads the RayCluster manifests out of the GKE tutorial seed (../shared/seeds), for golden checks."""
import re

import yaml

from tests.paths import SEED_TUTORIAL

_TOP_KEY = re.compile(r"^[A-Za-z]+:")


def seed_rayclusters() -> dict[str, dict]:
    """{worker group name: RayCluster dict} for every RayCluster manifest in the tutorial."""
    lines = SEED_TUTORIAL.read_text().splitlines()
    found = {}
    i = 0
    while i < len(lines):
        if lines[i].strip() == "apiVersion: ray.io/v1" and i + 1 < len(lines) and "kind: RayCluster" in lines[i + 1]:
            block = []
            while i < len(lines) and (not lines[i] or lines[i][0] in " -#" or _TOP_KEY.match(lines[i])):
                block.append(lines[i])
                i += 1
            doc = yaml.safe_load("\n".join(block))
            found[doc["spec"]["workerGroupSpecs"][0]["groupName"]] = doc
        i += 1
    return found


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
        out.append(f"{path}: seed {expected!r} != ours {actual!r}")
    return out
