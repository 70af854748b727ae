"""Every benchmark, and every bench command the docs write, starts from a fresh clone.

A clone's venv holds only the clone (hack/venv.sh: the dependencies live in a shared venv it sees
through a .pth file), so its bin/ has `python` and `tpuft` but no `kopf` or `ray`: a script that
starts a dependency's program from beside the interpreter fails at once there. Each bench/*.py, and
each `<venv>/bin/python bench/<script>.py ...` the docs write, runs here with --help instead of its
arguments (those start control planes and clusters for minutes) and must print its usage, naming
every option the docs pass it; each venv program the docs name must be in that venv.
"""
from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench"
DOCS = [REPO / "README.md", BENCH / "README.md", *sorted((REPO / "docs").rglob("*.md")),
        *sorted((REPO / "charts").glob("*/README.md"))]
HELP_TIMEOUT_S = 60
FENCE = re.compile(r"^```.*?^```", re.M | re.S)
BENCH_COMMAND = re.compile(r"(\.venv[\w-]*)/bin/python +(bench/\w+\.py)([^`#|\n]*)")
VENV_PROGRAM = re.compile(r"(?<![\w/.-])(\.venv[\w-]*)/bin/([\w.-]+)")
OPTION = re.compile(r"(?<![\w-])--[a-z][\w-]*")


def _code(path: Path) -> list[str]:
    """The text a doc shows as commands: fenced blocks, and prose with each inline code span on one
    line (a span may wrap); for a bench script, its docstring's usage lines."""
    text = path.read_text()
    if path.suffix == ".py":
        return [ast.get_docstring(ast.parse(text)) or ""]
    prose = re.sub(r"`[^`]*`", lambda m: " ".join(m.group(0).split()), FENCE.sub("", text))
    return [*FENCE.findall(text), prose]


def documented_bench_commands() -> dict[tuple[str, str], tuple[set[str], set[str]]]:
    """(venv, script) -> (the options the docs pass it, where they write it)."""
    found: dict[tuple[str, str], tuple[set[str], set[str]]] = {}
    for path in [*DOCS, *sorted(BENCH.glob("*.py"))]:
        for chunk in _code(path):
            for venv, script, args in BENCH_COMMAND.findall(chunk):
                options, where = found.setdefault((venv, script), (set(), set()))
                options.update(OPTION.findall(args))
                where.add(str(path.relative_to(REPO)))
    return found


def _interpreter(venv: str) -> str:
    return os.path.abspath(REPO / venv / "bin" / "python")


def help_cases() -> list[tuple[str, str, frozenset[str], str]]:
    """(interpreter, script, documented options, where): each bench script under this interpreter,
    and each documented one under the venv the docs name (the same run when that is this one)."""
    cases: dict[tuple[str, str], tuple[set[str], set[str]]] = {
        (os.path.abspath(sys.executable), f"bench/{p.name}"): (set(), {"bench/"}) for p in sorted(BENCH.glob("*.py"))}
    for (venv, script), (options, where) in documented_bench_commands().items():
        into = cases.setdefault((_interpreter(venv), script), (set(), set()))
        into[0].update(options)
        into[1].update(where)
    return [(python, script, frozenset(options), ", ".join(sorted(where)))
            for (python, script), (options, where) in sorted(cases.items())]


def _help(case: tuple[str, str, frozenset[str], str]) -> subprocess.CompletedProcess | None:
    python, script, _, _ = case
    if not Path(python).exists():
        return None
    return subprocess.run([python, script, "--help"], cwd=REPO, capture_output=True, text=True,
                          timeout=HELP_TIMEOUT_S, stdin=subprocess.DEVNULL)


CASES = help_cases()


@pytest.fixture(scope="module")
def helped() -> dict[tuple[str, str], subprocess.CompletedProcess | None]:
    """Every case's --help, two at a time (the machine has 2 cores; torch imports dominate)."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        return {(c[0], c[1]): res for c, res in zip(CASES, pool.map(_help, CASES))}


@pytest.mark.parametrize("case", CASES, ids=[f"{Path(c[0]).parent.parent.name}:{c[1]}" for c in CASES])
def test_each_bench_command_starts_and_takes_the_documented_options(helped, case):
    python, script, options, where = case
    res = helped[(python, script)]
    if res is None:
        pytest.skip(f"{python} is not built in this clone (`make venv` / `make unit`); documented in {where}")
    out = res.stdout
    assert res.returncode == 0 and out.startswith("usage: "), \
        f"`{python} {script} --help` (documented in {where}) exited {res.returncode}:\n{res.stderr[-3000:]}"
    unknown = sorted(o for o in options if not re.search(rf"(?<![\w-]){re.escape(o)}(?![\w-])", out))
    assert unknown == [], f"{where} pass {script} options its --help does not list"


def test_the_docs_write_bench_commands_for_the_performance_page_and_the_bench_readme():
    where = {w for _, places in documented_bench_commands().values() for w in places}
    assert {"docs/performance.md", "bench/README.md"} <= where


def test_every_venv_program_the_docs_name_is_in_the_clones_venv():
    missing, checked = [], 0
    for path in DOCS:
        for chunk in _code(path):
            for venv, program in set(VENV_PROGRAM.findall(chunk)):
                if not (REPO / venv).is_dir():
                    continue   # a venv this clone has not built (`make unit` builds .venv-unit)
                checked += 1
                if not (REPO / venv / "bin" / program).exists():
                    missing.append(f"{path.relative_to(REPO)}: {venv}/bin/{program}")
    assert checked and missing == [], f"not in the clone's venv (start it as `python -m ...`): {missing}"


# A dependency's program at a path beside the interpreter; this clone's own `tpuft` is there.
BESIDE_INTERPRETER = re.compile(r"Path\(sys\.executable\)\.(?:with_name\(|parent\s*/\s*)[\"'](?!tpuft[\"'])")


def test_no_script_starts_a_dependencys_program_from_beside_the_interpreter():
    found = [f"{p.relative_to(REPO)}:{n}" for top in ("bench", "local", "tests") for p in sorted((REPO / top).rglob("*.py"))
             for n, line in enumerate(p.read_text().splitlines(), start=1) if BESIDE_INTERPRETER.search(line)]
    assert found == [], f"start these as [sys.executable, '-m', MODULE, ...]: {found}"


def test_the_benchmarks_operator_command_starts_here():
    """bench/operator_burst.py's (and failure_detection.py's) operator command, with --help for its
    namespace: kopf as this interpreter's module."""
    probe = ("import subprocess, sys; sys.path.insert(0, 'bench'); import operator_burst as ob; "
             "argv = ob.operator_argv('ns'); "
             "sys.exit(subprocess.run([*argv[:argv.index('run') + 1], '--help'], timeout=60).returncode)")
    res = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True,
                         timeout=HELP_TIMEOUT_S * 2, stdin=subprocess.DEVNULL)
    assert res.returncode == 0 and "--standalone" in res.stdout, res.stdout[-2000:] + res.stderr[-3000:]
