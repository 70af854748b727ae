"""Fixtures for the Helm chart tests: the helm binary, `helm template` rendering, and helm
against the real local control plane (tests/conftest.py's control_plane, kubectl, namespace).

helm comes from the project's toolchain (`tpuft_local.toolchain.tool_path("helm")`, built once
per machine and cached; `make test` runs `tpuft cluster tools` first).
"""
from __future__ import annotations

import json
import subprocess

import pytest
import yaml

from tests.chart.helmlib import CHART, RELEASE, RELEASE_NAMESPACE, Rendered, run_helm


@pytest.fixture(scope="session")
def helm() -> str:
    from tpuft_local.toolchain import tool_path

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


@pytest.fixture
def helm_env(control_plane, tmp_path):
    env = control_plane.env()
    for var in ("HELM_CACHE_HOME", "HELM_CONFIG_HOME", "HELM_DATA_HOME"):
        env[var] = str(tmp_path / var.lower())
    return env


@pytest.fixture
def helm_cli(helm, helm_env, kubeconfig):
    def run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
        proc = subprocess.run([helm, f"--kubeconfig={kubeconfig}", *args], capture_output=True, text=True,
                              env=helm_env, timeout=180)
        if check:
            assert proc.returncode == 0, f"helm {' '.join(args)}:\n{proc.stdout}\n{proc.stderr}"
        return proc

    return run


@pytest.fixture
def extra_namespace(kubectl, namespace):
    """A second fresh namespace (named after the first), deleted afterwards."""
    created = []

    def make(suffix: str) -> str:
        name = f"{namespace[:50]}-{suffix}"
        kubectl("create", "namespace", name, check=True)
        created.append(name)
        return name

    yield make
    for name in created:
        kubectl("delete", "namespace", name, "--wait=false", "--ignore-not-found")
