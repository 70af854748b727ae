"""Static checks of Dockerfile.operator, Dockerfile.workload and .dockerignore (no Docker
engine here: parsed, not built)."""
from __future__ import annotations

import re

import pytest

from tests.images.dockerfile_lib import REPO, build_context, parse, pip_install_args

OPERATOR = parse(REPO / "Dockerfile.operator")
WORKLOAD = parse(REPO / "Dockerfile.workload")
TORCH_TPU_BASE = "us-docker.pkg.dev/ml-oss-artifacts-transient/torch-tpu-docker-container/torch-tpu:nightly"
HEAVY = re.compile(r"^(torch|torch[-_]tpu|libtpu(?:[-_]nightly)?|ray|jax|jaxlib|transformers|datasets)\b", re.I)


def _requirements(args: list[str]) -> list[str]:
    """Positional package arguments of a `pip install` (options and their values dropped)."""
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
            continue
        if a in ("-c", "--constraint", "-r", "--requirement", "-f", "--find-links", "-i", "--index-url",
                 "--extra-index-url", "-t", "--target", "--prefix", "--root"):
            skip = True
            continue
        if a.startswith("-"):
            continue
        out.append(a)
    return out


# --- operator image ----------------------------------------------------------------

def test_operator_is_multi_stage_on_python_311_slim():
    assert len(OPERATOR.stages) >= 2
    assert OPERATOR.global_args.get("PYTHON_IMAGE") == "python:3.11-slim"
    for st in OPERATOR.stages:
        assert st.base in ("${PYTHON_IMAGE}", "python:3.11-slim")
    builder = OPERATOR.stages[0]
    assert builder.name, "the builder stage is named"
    assert any("pip wheel" in r.value for r in builder.all("RUN")), "the builder builds wheels"
    copies = [c.value for c in OPERATOR.final.all("COPY")]
    assert copies and all(c.startswith(f"--from={builder.name} ") for c in copies), \
        "the final stage takes only the builder's wheels, not the source tree"


def test_operator_installs_no_torch_no_ray_no_extras():
    installs = [a for r in OPERATOR.final.all("RUN") for a in pip_install_args(r.value)]
    assert installs, "the final stage installs the wheel"
    for args in installs:
        for req in _requirements(args):
            assert "[" not in req, f"extras requested: {req}"
            assert not HEAVY.match(req), f"heavy dependency in the operator image: {req}"
    assert "--no-index" in installs[-1], "installs from the builder's wheelhouse only"
    text = OPERATOR.path.read_text()
    assert "[workload]" not in text.replace("`tpufinetune-operator[workload]`", "")


def test_operator_runs_as_numeric_non_root_user():
    users = OPERATOR.final.all("USER")
    assert users, "final stage sets USER"
    user = users[-1].value.split(":")
    assert user[0].isdigit() and int(user[0]) == 65532
    assert len(user) == 1 or (user[1].isdigit() and int(user[1]) != 0)
    # nothing runs as root after USER
    last_user_line = users[-1].line
    assert not [r for r in OPERATOR.final.all("RUN") if r.line > last_user_line]


def test_operator_entrypoint_is_kopf_standalone():
    ep = OPERATOR.final.all("ENTRYPOINT")[-1].json_args
    assert ep == ["kopf", "run", "--standalone", "--liveness=http://0.0.0.0:8080/healthz", "-m", "tpuft.controller.handlers"]
    # the namespace scope comes from the chart's args; CMD is only the `docker run` default
    cmd = OPERATOR.final.all("CMD")
    assert not cmd or cmd[-1].json_args == ["--all-namespaces"]


def test_chart_uses_the_image_uid():
    import yaml
    values = yaml.safe_load((REPO / "charts" / "tpufinetune-operator" / "values.yaml").read_text())
    assert values["podSecurityContext"]["runAsUser"] == 65532
    assert values["securityContext"]["runAsUser"] == 65532


# --- workload image ------------------------------------------------------------------

def test_workload_base_image_is_a_build_arg_defaulting_to_torchtpu():
    assert WORKLOAD.global_args["BASE_IMAGE"] == TORCH_TPU_BASE
    assert [s.base for s in WORKLOAD.stages] == ["${BASE_IMAGE}"]
    text = WORKLOAD.path.read_text()
    assert "cuda" in text.lower() and "cpu" in text.lower(), "both alternative bases are documented"


def test_workload_installs_wget_and_pins_ray_260():
    runs = WORKLOAD.runs()
    assert any(re.search(r"apt-get install .*\bwget\b", r) for r in runs)
    reqs = [q for r in runs for a in pip_install_args(r) for q in _requirements(a)]
    ray = [q for q in reqs if q.lower().startswith("ray")]
    assert ray == ["ray[default,train,serve]==2.60.*"]
    assert any(q.startswith("transformers") for q in reqs)
    assert any(q.startswith("datasets") for q in reqs)


def test_workload_never_pip_installs_torch_tpu_or_libtpu_or_torch():
    for r in WORKLOAD.runs():
        for args in pip_install_args(r):
            for q in _requirements(args):
                name = re.split(r"[\[<>=!~ ;]", q, maxsplit=1)[0].lower()
                assert name not in {"torch-tpu", "torch_tpu", "libtpu", "libtpu-nightly", "libtpu_nightly"}, q
                # torch only through the opt-in TORCH_SPEC arg for bases without torch
                assert name != "torch", f"the base's torch must not be replaced: {q}"


def test_workload_installs_repo_without_deps_and_keeps_base_torch():
    installs = [a for r in WORKLOAD.runs() for a in pip_install_args(r)]
    repo_installs = [a for a in installs if any(q.startswith("/opt/tpufinetune/src") or q == "." for q in _requirements(a))]
    assert repo_installs and all("--no-deps" in a for a in repo_installs)
    # everything that resolves dependencies is constrained to the base's torch stack
    for a in installs:
        if "--no-deps" not in a and "${TORCH_SPEC}" not in a:
            assert "--constraint" in a or "-c" in a, a
    runs = " ".join(WORKLOAD.runs())
    assert "diff" in runs and "base-constraints.txt" in runs, "the build fails if torch changed"
    # importing torch at build time would auto-load torch_tpu (crashes without a TPU)
    for r in WORKLOAD.runs():
        if "import torch" in r:
            assert "TORCH_DEVICE_BACKEND_AUTOLOAD=0" in r


# Top-level modules the workload imports -> the requirement in Dockerfile.workload that
# provides them (directly or as a dependency of one listed there), or "base" for the image.
WORKLOAD_MODULE_SOURCES = {
    "torch": "base", "torch_tpu": "base",
    "ray": "ray", "pyarrow": "ray", "transformers": "transformers", "tokenizers": "transformers",
    "safetensors": "safetensors", "datasets": "datasets", "kubernetes": "kubernetes", "yaml": "pyyaml",
    "numpy": "transformers", "huggingface_hub": "transformers",
    "jax": "jax", "ml_dtypes": "jax", "optax": "optax", "orbax": "orbax-checkpoint",
    "fastapi": "ray", "pydantic": "ray",   # ray's `serve` extra (tpuft_workload.serve, chat_api)
    "jinja2": "ray",   # ray's `serve` extra too; chat templates render with it (chat_api's template refusals)
    "tensorboardX": "ray",   # ray's `train` extra (tpuft_workload.metrics_log)
    "peft": "peft",   # spec.training.method: lora (tpuft_workload.lora, serve)
}


def test_workload_image_covers_every_workload_import():
    import ast
    import sys

    first_party = {"tpuft", "tpuft_workload"}
    imported: dict[str, str] = {}
    for path in sorted((REPO / "workload").rglob("*.py")) + [REPO / "operator" / "tpuft" / "api" / "catalog.py",
                                                           REPO / "operator" / "tpuft" / "api" / "constants.py"]:
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            for n in names:
                top = n.split(".")[0]
                if top not in sys.stdlib_module_names and top not in first_party:
                    imported.setdefault(top, str(path.relative_to(REPO)))
    unknown = {m: where for m, where in imported.items() if m not in WORKLOAD_MODULE_SOURCES}
    assert not unknown, f"third-party imports with no source in Dockerfile.workload: {unknown}"
    reqs = {re.split(r"[\[<>=!~ ;]", q, maxsplit=1)[0].lower()
            for r in WORKLOAD.runs() for a in pip_install_args(r) for q in _requirements(a)}
    for module in imported:
        source = WORKLOAD_MODULE_SOURCES[module]
        assert source == "base" or source in reqs, f"{module} ({imported[module]}) needs {source} in Dockerfile.workload"


def test_workload_copies_both_packages():
    copies = " ".join(c.value for c in WORKLOAD.final.all("COPY"))
    assert "operator" in copies and "workload" in copies and "pyproject.toml" in copies


# --- build context --------------------------------------------------------------------

def test_dockerignore_keeps_context_to_the_package_sources():
    ctx = build_context(REPO)
    assert "pyproject.toml" in ctx
    assert any(p.startswith("operator/tpuft/") for p in ctx)
    assert any(p.startswith("workload/tpuft_workload/") for p in ctx)
    for p in ctx:
        assert p == "pyproject.toml" or p.startswith(("operator/", "workload/")), p
        assert "__pycache__" not in p and ".egg-info" not in p and not p.startswith(".venv/"), p


@pytest.mark.parametrize("dockerfile", [OPERATOR, WORKLOAD], ids=["operator", "workload"])
def test_every_copy_source_is_in_the_context(dockerfile):
    ctx = build_context(REPO)
    for st in dockerfile.stages:
        for c in st.all("COPY"):
            if c.value.startswith("--from="):
                continue
            *sources, _dest = c.value.split()
            for src in sources:
                src = src.rstrip("/")
                assert src in ctx or any(p.startswith(src + "/") for p in ctx), \
                    f"{dockerfile.path.name}:{c.line}: COPY {src} is missing from the build context"


# --- cross-check with Docker's own parser ---------------------------------------------

@pytest.mark.parametrize("df", [OPERATOR, WORKLOAD], ids=["operator", "workload"])
def test_docker_parser_reads_the_same_instructions(df):
    """`dockerfile` (PyPI) wraps BuildKit's Go parser: it must accept the file, and see the
    same instructions on the same lines as the small parser the other tests use."""
    import dockerfile as official  # the `test` extra in pyproject.toml

    theirs = official.parse_file(str(df.path))
    ours = [("ARG", None)] * len(df.global_args)
    for st in df.stages:
        ours.append(("FROM", None))
        ours += [(i.cmd, i.line) for i in st.instructions]
    assert [c.cmd.upper() for c in theirs] == [cmd for cmd, _ in ours]
    for c, (cmd, line) in zip(theirs, ours):
        if line is not None:
            assert c.start_line == line, (c, line)
    entry = [c for c in theirs if c.cmd.upper() == "ENTRYPOINT"]
    if df is OPERATOR:
        assert entry[-1].json and list(entry[-1].value) == OPERATOR.final.all("ENTRYPOINT")[-1].json_args
