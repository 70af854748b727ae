"""A small Dockerfile parser (enough for this repo's two Dockerfiles) and a .dockerignore
matcher with Docker's semantics (patterns match a path or any of its parent directories;
the last matching pattern wins; `!` re-includes). No Docker engine needed."""
from __future__ import annotations

import fcntl
import fnmatch
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


@dataclass
class Instruction:
    cmd: str       # upper-case keyword
    value: str     # the rest of the line, continuations joined
    line: int      # 1-based line of the keyword

    @property
    def json_args(self) -> list[str] | None:
        v = self.value.strip()
        if v.startswith("["):
            return json.loads(v)
        return None


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[Instruction] = field(default_factory=list)

    def all(self, cmd: str) -> list[Instruction]:
        return [i for i in self.instructions if i.cmd == cmd]


@dataclass
class Dockerfile:
    path: Path
    global_args: dict[str, str | None]
    stages: list[Stage]

    @property
    def final(self) -> Stage:
        return self.stages[-1]

    def runs(self) -> list[str]:
        return [i.value for s in self.stages for i in s.all("RUN")]


def parse(path: Path) -> Dockerfile:
    text = path.read_text()
    logical: list[tuple[int, str]] = []
    buf, start = "", 0
    for n, raw in enumerate(text.splitlines(), 1):
        stripped = raw.strip()
        if not buf and (not stripped or stripped.startswith("#")):
            continue  # comments and parser directives
        if buf and stripped.startswith("#"):
            continue  # comment lines inside a continued instruction are dropped
        if not buf:
            start = n
        if stripped.endswith("\\"):
            buf += stripped[:-1] + " "
            continue
        buf += stripped
        logical.append((start, buf))
        buf = ""
    assert not buf, f"{path}: dangling line continuation"

    global_args: dict[str, str | None] = {}
    stages: list[Stage] = []
    for line, entry in logical:
        cmd, _, value = entry.partition(" ")
        cmd = cmd.upper()
        value = value.strip()
        if cmd == "FROM":
            m = re.match(r"^(?:--platform=\S+\s+)?(\S+)(?:\s+AS\s+(\S+))?$", value, re.IGNORECASE)
            assert m, f"{path}:{line}: cannot parse FROM {value!r}"
            stages.append(Stage(base=m.group(1), name=m.group(2)))
        elif not stages:
            assert cmd == "ARG", f"{path}:{line}: only ARG may precede the first FROM"
            name, eq, default = value.partition("=")
            global_args[name] = _unquote(default) if eq else None
        else:
            stages[-1].instructions.append(Instruction(cmd, value, line))
    return Dockerfile(path, global_args, stages)


def _unquote(s: str) -> str:
    s = s.strip()
    if len(s) >= 2 and s[0] == s[-1] and s[0] in "\"'":
        return s[1:-1]
    return s


def pip_install_args(run: str) -> list[list[str]]:
    """The argument lists of every `pip install` in a RUN line (split on && || ; |)."""
    out = []
    # RUN's own flags (`--mount=type=cache,...`, `--network=...`) come before the command.
    run = re.sub(r"^\s*(?:--[a-z]+=\S+\s+)*", "", run)
    for part in re.split(r"&&|\|\||;|\|", run):
        try:
            words = shlex.split(part)
        except ValueError:
            words = part.split()
        # drop shell keywords and leading VAR=value assignments
        while words and (words[0] in ("then", "do", "else", "exec", "command")
                         or re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0])):
            words = words[1:]
        if len(words) >= 3 and re.fullmatch(r"python[\d.]*", words[0]) and words[1:3] == ["-m", "pip"]:
            words = words[3:]
        elif words and re.fullmatch(r"(?:.*/)?pip[\d.]*", words[0]):
            words = words[1:]
        else:
            continue
        if words and words[0] == "install":
            out.append(words[1:])
    return out


# --- .dockerignore ------------------------------------------------------------------

def _pattern_regex(pattern: str) -> re.Pattern:
    parts = []
    for seg in pattern.split("/"):
        if seg == "**":
            parts.append("(?:.*)")
        else:
            parts.append(fnmatch.translate(seg).removeprefix("(?s:").removesuffix(")\\Z"))
    rx = "/".join(parts).replace("(?:.*)/", "(?:.*/)?")
    return re.compile(f"^{rx}$", re.DOTALL)


def load_dockerignore(path: Path) -> list[tuple[bool, re.Pattern, str]]:
    rules = []
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pat = line[1:].strip() if negate else line
        pat = pat.strip("/") or "."
        rules.append((negate, _pattern_regex(pat), pat))
    return rules


def ignored(rel: str, rules: list[tuple[bool, re.Pattern, str]]) -> bool:
    """Docker semantics: a pattern matches the path or any parent; the last match decides."""
    parts = rel.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    result = False
    for negate, rx, _ in rules:
        if any(rx.match(p) for p in prefixes):
            result = not negate
    return result


def build_context(root: Path) -> list[str]:
    """Relative paths of every file the Docker build context would contain."""
    rules = load_dockerignore(root / ".dockerignore")
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath).relative_to(root).as_posix()
        here = "" if here == "." else here + "/"
        keep = []
        for d in dirnames:
            rel = here + d
            # Skip an ignored directory unless a `!pattern` could re-include something in it.
            if ignored(rel, rules) and not any(
                neg and (pat.startswith(rel + "/") or pat.startswith("**")) for neg, _, pat in rules
            ):
                continue
            keep.append(d)
        dirnames[:] = sorted(keep)
        out += [here + f for f in sorted(filenames) if not ignored(here + f, rules)]
    return out


# --- the operator image's Python environment, without Docker -----------------------------

def run_clean(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    """Run with no PYTHONPATH/VIRTUAL_ENV leaking in from the test environment."""
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    env.pop("PYTHONPATH", None)
    env.pop("VIRTUAL_ENV", None)
    kw.setdefault("timeout", 300)
    return subprocess.run(cmd, capture_output=True, text=True, env=env, **kw)


def _ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, f"{' '.join(map(str, proc.args))} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"


OPERATOR_VENVS_KEPT = 2


def operator_image_venv() -> tuple[Path, Path]:
    """Build, once per build context, what Dockerfile.operator installs: a wheel of the build
    context (.dockerignore applied), installed with no extras into a fresh venv. Returns (venv,
    wheel). Kept under the tool cache by the context's hash, as the images are: the fast tier's
    wheel test builds it and the chart tier, minutes later in another pytest process, uses it
    (building it again there took 214 s beside the other lanes); an edit to the context builds anew."""
    from tpuft_local.images import files_hash
    from tpuft_local.toolchain import cache_dir

    files = build_context(REPO)
    parent = cache_dir() / "operator-image-venv"
    root = parent / files_hash(REPO, files)[:16]
    root.mkdir(parents=True, exist_ok=True)
    root.touch()
    for old in sorted((p for p in parent.iterdir() if p.is_dir()), key=lambda p: p.stat().st_mtime)[:-OPERATOR_VENVS_KEPT]:
        shutil.rmtree(old, ignore_errors=True)
    venv, wheels, done = root / "venv", root / "wheels", root / "done"
    with open(root / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            for p in (root / "src", wheels, venv):
                shutil.rmtree(p, ignore_errors=True)
            # 1. The build context, as Docker would send it (the builder COPYs all of it).
            for rel in files:
                dest = root / "src" / rel
                dest.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(REPO / rel, dest)
            # 2. A wheel of the project only (the Dockerfile also collects dependency wheels).
            _ok(run_clean([sys.executable, "-m", "pip", "wheel", "--no-deps", "--wheel-dir", str(wheels),
                           str(root / "src")]))
            # 3. A fresh venv, no extras: base dependencies only. (--without-pip, then this pip
            # drives it with --python: skips ensurepip, same result.)
            _ok(run_clean([sys.executable, "-m", "venv", "--without-pip", str(venv)]))
            built = sorted(wheels.glob("tpufinetune_operator-*.whl"))
            assert len(built) == 1, list(wheels.iterdir())
            _ok(run_clean([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"),
                           "install", "-q", str(built[0])]))
            done.write_text("ok\n")
    (wheel,) = sorted(wheels.glob("tpufinetune_operator-*.whl"))
    return venv, wheel
