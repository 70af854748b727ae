"""Every module of each package imports in a fresh venv holding only what that package declares.

One distribution (tpufinetune-operator) ships three packages, each with its own needs:
  tpuft           the operator:        [project] dependencies
  tpuft_local     the laptop tooling:  dependencies + the `local` extra
  tpuft_workload  the RayJobs' code:   dependencies + the `workload` extra
An import of something undeclared (tpuft_local.kubepki importing cryptography while only the
workload extra happened to pull it in) then fails here instead of on a user's `pip install -e .`.

No network and no pip: the fresh venv (`python -m venv --without-pip`) gets the declared
requirements and their own requirements, transitively, by symlinking each distribution's files
(its RECORD) from the venv running the tests. A package not in that closure is simply absent.
"""
from __future__ import annotations

import importlib.metadata as md
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]

# package -> (source folders it needs on the path, extras it declares beyond the base dependencies)
PACKAGES = {
    "tpuft": (["operator"], []),
    "tpuft_local": (["operator", "local"], ["local"]),
    "tpuft_workload": (["operator", "workload"], ["workload"]),
}

IMPORT_ALL = """
import importlib, pkgutil, sys, traceback
pkg = importlib.import_module(sys.argv[1])
failed = []
for m in sorted(pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."), key=lambda m: m.name):
    try:
        importlib.import_module(m.name)
    except Exception as e:
        failed.append(f"{m.name}: {type(e).__name__}: {e}")
print("\\n".join(failed) or "ok")
sys.exit(1 if failed else 0)
"""


def _requirements(extras: list[str]) -> list[Requirement]:
    reqs = [Requirement(r) for r in PROJECT["dependencies"]]
    for extra in extras:
        reqs += [Requirement(r) for r in PROJECT["optional-dependencies"][extra]]
    return reqs


def closure(reqs: list[Requirement]) -> dict[str, md.Distribution]:
    """The installed distributions these requirements need, with their own requirements, transitively."""
    env = default_environment()
    out: dict[str, md.Distribution] = {}
    todo = [(r, frozenset()) for r in reqs]
    seen: set[tuple[str, frozenset]] = set()
    while todo:
        req, _ = todo.pop()
        name = canonicalize_name(req.name)
        if (name, frozenset(req.extras)) in seen:
            continue
        seen.add((name, frozenset(req.extras)))
        dist = out.get(name) or md.distribution(req.name)
        out[name] = dist
        for sub in map(Requirement, dist.requires or []):
            extras = {""} | set(req.extras)
            if sub.marker is None or any(sub.marker.evaluate({**env, "extra": e}) for e in extras):
                todo.append((sub, frozenset()))
    return out


def fresh_venv(root: Path, dists: dict[str, md.Distribution], sources: list[str]) -> Path:
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True, timeout=120)
    site = Path(subprocess.run([str(root / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                               check=True, capture_output=True, text=True).stdout.strip())
    for dist in dists.values():
        # the site dir this distribution is installed in: this venv's, or the shared dependency
        # venv its .pth adds (hack/venv.sh)
        here = Path(dist.locate_file("")).resolve()
        for f in dist.files or []:
            if "__pycache__" in f.parts or f.suffix == ".pth":
                continue
            src = Path(dist.locate_file(f)).resolve()
            try:
                rel = src.relative_to(here)
            except ValueError:
                continue   # scripts and data outside site-packages
            dst = site / rel
            if src.exists() and not dst.exists():
                dst.parent.mkdir(parents=True, exist_ok=True)
                os.symlink(src, dst)
    (site / "tpuft-sources.pth").write_text("".join(f"{REPO / s}\n" for s in sources))
    return root / "bin" / "python"


def import_all(tmp_path: Path, package: str, sources: list[str], extras: list[str]) -> subprocess.CompletedProcess:
    tmp_path.mkdir(parents=True, exist_ok=True)
    python = fresh_venv(tmp_path / "venv", closure(_requirements(extras)), sources)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"
    return subprocess.run([str(python), "-I", "-c", IMPORT_ALL, package], capture_output=True, text=True,
                          timeout=600, env=env, cwd=tmp_path)


@pytest.mark.parametrize("package", ["tpuft", "tpuft_local"])
def test_every_module_imports_with_only_the_declared_dependencies(tmp_path, package):
    sources, extras = PACKAGES[package]
    res = import_all(tmp_path, package, sources, extras)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stdout + res.stderr


def test_the_operators_environment_has_no_workload_or_laptop_dependencies(tmp_path):
    names = set(closure(_requirements([])))
    assert not names & {"torch", "ray", "transformers", "datasets", "cryptography"}, sorted(names)


def test_an_undeclared_import_fails_here(tmp_path):
    """The fresh venv really lacks what is not declared: a module importing cryptography (the `local`
    extra's) fails with only the base dependencies, and imports with the extra."""
    probe = tmp_path / "src" / "tpuft_probe"
    probe.mkdir(parents=True)
    (probe / "__init__.py").write_text("")
    (probe / "pki.py").write_text("import cryptography.x509\n")
    res = import_all(tmp_path / "base", "tpuft_probe", [str(probe.parent)], [])
    assert res.returncode == 1 and "tpuft_probe.pki: ModuleNotFoundError: No module named 'cryptography'" in res.stdout, \
        res.stdout + res.stderr
    res = import_all(tmp_path / "local", "tpuft_probe", [str(probe.parent)], ["local"])
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stdout + res.stderr


@pytest.mark.slow
def test_every_workload_module_imports_with_only_the_declared_dependencies(tmp_path):
    """Slow: imports torch and Ray (about a minute on 2 cores); needs the full venv (`make venv`)."""
    sources, extras = PACKAGES["tpuft_workload"]
    res = import_all(tmp_path, "tpuft_workload", sources, extras)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stdout + res.stderr
