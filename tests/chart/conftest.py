"""Fixtures for the Helm chart tests: the helm binary and `helm template` rendering.

helm comes from the project's toolchain (`tpuft.toolchain.tool_path("helm")`, built once
per machine and cached; `make test` runs `tpuft cluster tools` first).
"""
from __future__ import annotations

import json

import pytest
import yaml

from tests.chart.helmlib import CHART, RELEASE, RELEASE_NAMESPACE, Rendered, run_helm


@pytest.fixture(scope="session")
def helm() -> str:
    from tpuft.toolchain import tool_path

    return tool_path("helm")


@pytest.fixture(scope="session")
def render(helm, tmp_path_factory):
    """render(values: dict | None, *extra_args) -> Rendered objects of `helm template`."""

    def _render(values: dict | None = None, *extra: str) -> Rendered:
        args = ["template", RELEASE, str(CHART), "--namespace", RELEASE_NAMESPACE]
        if values:
            path = tmp_path_factory.mktemp("values") / "values.yaml"
            path.write_text(json.dumps(values))
            args += ["--values", str(path)]
        out = run_helm(helm, *args, *extra).stdout
        return Rendered(d for d in yaml.safe_load_all(out) if d)

    return _render


