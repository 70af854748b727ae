"""The operator package installs into a clean environment the way Dockerfile.operator
installs it: a wheel built from the Docker build context (what .dockerignore lets through),
installed with no extras into a fresh venv. Then the operator's modules import there, and
torch and Ray are absent.

Needs the package registry (pip resolves the base dependencies); about a minute. The same
environment runs the operator in tests/chart/test_chart_operator_as_sa.py.
"""
from __future__ import annotations

import email.parser
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.images.dockerfile_lib import REPO, operator_image_venv, run_clean as _run


def _ok(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 0, f"{' '.join(proc.args)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def _pip(venv: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), *args]


def _base_deps() -> set[str]:
    """Names in pyproject's [project].dependencies (the operator's runtime deps)."""
    import re
    import tomllib

    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    return {re.split(r"[\[<>=!~ ;]", d, maxsplit=1)[0].lower().replace("_", "-") for d in deps}


BASE_DEPS = _base_deps()
FORBIDDEN = ("torch", "torch-tpu", "torch_tpu", "libtpu", "ray", "transformers", "datasets", "jax")


@pytest.fixture(scope="module")
def operator_venv() -> tuple[Path, Path]:
    return operator_image_venv()


def test_wheel_requires_only_the_base_dependencies(operator_venv):
    _, wheel = operator_venv
    with zipfile.ZipFile(wheel) as z:
        meta_name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        meta = email.parser.Parser().parsestr(z.read(meta_name).decode())
        names = z.namelist()
    unconditional = set()
    for req in meta.get_all("Requires-Dist") or []:
        if "extra ==" in req:
            continue
        unconditional.add(re.split(r"[\[<>=!~ ;(]", req, maxsplit=1)[0].strip().lower().replace("_", "-"))
    assert unconditional == BASE_DEPS
    assert not unconditional & set(FORBIDDEN), "torch/ray must stay in the workload extra"
    assert any(n.startswith("tpuft/") for n in names)


def test_operator_modules_import_and_heavy_ones_do_not(operator_venv):
    venv, _ = operator_venv
    py = str(venv / "bin" / "python")
    _ok(_run([py, "-c", "import kopf, kubernetes, yaml, tpuft, tpuft.api.catalog, tpuft.api.constants"], cwd="/"))
    # the module the image's ENTRYPOINT loads (`kopf run ... -m tpuft.controller.handlers`)
    _ok(_run([py, "-c", "import tpuft.controller.handlers"], cwd="/"))
    for mod in ("torch", "ray", "transformers"):
        proc = _run([py, "-c", f"import {mod}"], cwd="/")
        assert proc.returncode != 0 and "ModuleNotFoundError" in proc.stderr, f"{mod} importable in the operator env"
    # the operator package came from the wheel, not from the checkout
    where = _ok(_run([py, "-c", "import tpuft; print(tpuft.__file__)"], cwd="/")).strip()
    assert str(venv) in where, where


def test_no_heavy_distributions_installed(operator_venv):
    venv, _ = operator_venv
    listed = _ok(_run(_pip(venv, "list", "--format=freeze")))
    names = {line.split("==")[0].lower() for line in listed.splitlines() if "==" in line}
    assert not names & set(FORBIDDEN), names & set(FORBIDDEN)
    assert {n.replace("_", "-") for n in BASE_DEPS} <= {n.replace("_", "-") for n in names}


def test_entrypoint_command_exists(operator_venv):
    """The image's ENTRYPOINT starts with `kopf run`; the kopf console script must be there."""
    venv, _ = operator_venv
    out = _ok(_run([str(venv / "bin" / "kopf"), "run", "--help"]))
    for flag in ("--standalone", "--liveness", "--all-namespaces", "--namespace"):
        assert flag in out
