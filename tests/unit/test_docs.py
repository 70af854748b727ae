"""The docs cannot drift from the code: the shell examples they mark as checked are run and their
output compared; every docs page and anchor the repo's files name exists; the README holds nothing the
docs do not. (`make docs`, in `make lint`, checks the links between pages: mkdocs build --strict.)"""
from __future__ import annotations

import contextlib
import glob
import io
import re
import shlex

import pytest

from tests.paths import REPO
from tpuft import cli

DOCS = REPO / "docs"
README = REPO / "README.md"
# A checked example: the marker line, then a console block of one `$ tpuft ...` command and what it
# prints (stdout and stderr as a terminal shows them); `...` alone on a line stands for any lines.
MARKER = re.compile(r"^<!-- checked example(?:: exit (\d+))? -->\n```console\n(.*?)^```$", re.M | re.S)
FENCE = re.compile(r"^```.*?^```$", re.M | re.S)


def _examples():
    for page in sorted(DOCS.rglob("*.md")):
        text = page.read_text()
        for m in MARKER.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            yield pytest.param(int(m.group(1) or 0), m.group(2), id=f"{page.relative_to(DOCS)}:{line}")


def _run(command: str) -> tuple[int, str]:
    """`tpuft ARGS` in this process (no interpreter start per example), globs expanded as a shell would."""
    argv = shlex.split(command)
    assert argv[0] == "tpuft", f"a checked example runs tpuft, not {argv[0]}"
    args = [a for x in argv[1:] for a in (sorted(glob.glob(x)) if glob.has_magic(x) else [x])]
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            rc = cli.main(args)
        except SystemExit as e:   # argparse's own refusals
            rc = e.code if isinstance(e.code, int) else 1
    return rc, out.getvalue()


def _pattern(expected: list[str]) -> str:
    return "".join(r"(?:.*\n)*?" if line == "..." else re.escape(line) + r"\n" for line in expected)


@pytest.mark.parametrize("exit_status,block", list(_examples()))
def test_a_checked_example_prints_what_the_docs_show(exit_status, block, monkeypatch):
    monkeypatch.chdir(REPO)   # the docs' paths are the repository root's
    first, *expected = block.splitlines()
    assert first.startswith("$ ") and not any(x.startswith("$ ") for x in expected), "one command per block"
    rc, output = _run(first[2:])
    assert re.fullmatch(_pattern(expected), output), f"`{first[2:]}` now prints:\n{output}"
    assert rc == exit_status


def test_the_docs_have_checked_examples_of_each_offline_tool():
    commands = {block.split()[2] for _, block in (p.values for p in _examples())}
    assert commands >= {"topology", "validate", "render"}


def _slug(heading: str) -> str:
    """The id Python-Markdown's toc (MkDocs) and GitHub give a heading, for the headings used here."""
    text = re.sub(r"`|\*\*", "", heading)
    return re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", text).strip().lower())


def _anchors(page) -> set[str]:
    text = FENCE.sub("", page.read_text())
    explicit = set(re.findall(r"\{#([\w-]+)\}", text))
    return explicit | {_slug(h) for h in re.findall(r"^#+ (.*?)(?: \{#[\w-]+\})?$", text, re.M)}


SOURCES = ["README.md", "pyproject.toml", "Makefile", ".ci", "operator", "workload", "local", "tests", "charts",
           "bench", "hack", "examples"]


def test_every_docs_page_and_anchor_named_in_the_repo_exists():
    missing = []
    for top in SOURCES:
        path = REPO / top
        for f in [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file()):
            if f.suffix in (".gz", ".png", ".pyc", ".json"):
                continue
            for page, anchor in re.findall(r"\bdocs/([\w/-]+\.md)(?:#([\w-]+))?", f.read_text(errors="replace")):
                target = DOCS / page
                if not target.is_file() or (anchor and anchor not in _anchors(target)):
                    missing.append(f"{f.relative_to(REPO)}: docs/{page}{'#' + anchor if anchor else ''}")
    assert missing == []


def test_the_readme_is_short_and_holds_nothing_the_docs_do_not():
    text = README.read_text()
    assert len(text.splitlines()) < 150
    docs = "\n".join(p.read_text() for p in DOCS.rglob("*.md"))
    for block in FENCE.findall(text):
        for line in block.splitlines()[1:-1]:
            assert line == "..." or line in docs, f"README.md shows a line no page of docs/ has: {line}"
