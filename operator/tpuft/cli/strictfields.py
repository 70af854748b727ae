"""Unknown fields, refused offline as the API server refuses them (kubectl's default strict
field validation): `tpuft validate` / `tpuft render` reject `spec.trainng` instead of printing
"valid" for a manifest the server would refuse.

The allowed names come from the CRD's own schema (`tpuft.api.crd.crd()`), walked the way the
server's structural pruning walks it: an object with `properties` admits only those names;
`additionalProperties` is a map (any key, values checked against its schema);
`x-kubernetes-preserve-unknown-fields` admits anything below it (beside its declared
properties); arrays check every item. metadata is checked against ObjectMeta's field names
(the kubernetes client's model), as the server decodes it.
"""
from __future__ import annotations

import difflib
from functools import lru_cache
from typing import Any, Mapping

from tpuft.api.spec import Problem, SpecError, TPUFinetune, parse


@lru_cache(maxsize=1)
def schema() -> dict:
    from tpuft.api import crd  # the generator imports spec; imported late so spec never imports this module

    return crd.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


@lru_cache(maxsize=1)
def object_meta_fields() -> frozenset[str]:
    from kubernetes.client import V1ObjectMeta

    return frozenset(V1ObjectMeta.attribute_map.values())


def _problem(path: str, key: str, allowed: list[str]) -> Problem:
    near = difflib.get_close_matches(key, allowed, n=1, cutoff=0.6)
    if not near:  # case slips (storagepath) score low on raw ratio
        folded = {a.lower(): a for a in allowed}
        near = [folded[m] for m in difflib.get_close_matches(key.lower(), list(folded), n=1, cutoff=0.6)]
    hint = f"; did you mean {near[0]}?" if near else f"; known fields: {', '.join(sorted(allowed))}"
    return Problem(f"{path}.{key}" if path else key, f"unknown field{hint}")


def unknown_fields(value: Any, node: Mapping | None = None, path: str = "") -> list[Problem]:
    """Every field of `value` (a whole TPUFinetune by default) that the CRD schema does not know."""
    node = schema() if node is None else node
    out: list[Problem] = []
    if isinstance(value, list):
        items = node.get("items")
        if isinstance(items, Mapping):
            for i, item in enumerate(value):
                out += unknown_fields(item, items, f"{path}[{i}]")
        return out
    if not isinstance(value, Mapping):
        return out
    props: Mapping = node.get("properties") or {}
    extra = node.get("additionalProperties")
    open_ = node.get("x-kubernetes-preserve-unknown-fields") is True
    for key, sub in value.items():
        here = f"{path}.{key}" if path else str(key)
        if path == "" and key == "metadata":
            if isinstance(sub, Mapping):
                allowed = object_meta_fields()
                out += [_problem("metadata", str(k), sorted(allowed)) for k in sub if k not in allowed]
            continue
        if key in props:
            out += unknown_fields(sub, props[key], here)
        elif isinstance(extra, Mapping):
            out += unknown_fields(sub, extra, here)
        elif not open_ and extra is not True:
            out.append(_problem(path, str(key), list(props)))
    return out


def parse_strict(obj: Mapping[str, Any]) -> TPUFinetune:
    """`spec.parse`, plus unknown fields as problems (all reported in one pass)."""
    unknown = unknown_fields(obj) if isinstance(obj, Mapping) else []
    try:
        tft = parse(obj)
    except SpecError as e:
        raise SpecError(unknown + e.problems, e.where) from None
    if unknown:
        raise SpecError(unknown, tft.meta.ref)
    return tft
