"""`tpuft topology`, `tpuft validate`, `tpuft render`: the pure core, from the command line.

Bad input exits 2 with one line per problem on stderr, never a traceback.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml

from tpuft import builders, catalog
from tpuft.constants import KIND
from tpuft.spec import Problem, SpecError
from tpuft.strictfields import parse_strict

EXIT_INVALID = 2


def add_topology_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--accelerator", required=True, help="v4, v5e, v5p, v6e, tpu7x (or Ray/GKE spelling), cpu")
    p.add_argument("--topology", required=True, help="e.g. 4x4, 2x2x2; with cpu the worker count")


def run_topology(args: argparse.Namespace) -> int:
    try:
        shape = catalog.resolve_slice(args.accelerator, args.topology, "--accelerator", "--topology")
    except catalog.CatalogError as e:
        print(f"tpuft topology: {e}", file=sys.stderr)
        return EXIT_INVALID
    print(json.dumps(shape.as_dict(), indent=2))
    return 0


def add_validate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("files", nargs="+", type=Path, help="YAML files (multi-document allowed); - for stdin")


def add_render_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", type=Path, help="a TPUFinetune YAML file; - for stdin")
    p.add_argument("--namespace", "-n", default=None, help="namespace when the manifest has none")


def _documents(path: Path) -> list[tuple[str, dict]]:
    """(label, document) for every TPUFinetune in the file; raises SpecError for unreadable input."""
    label = str(path)
    try:
        text = sys.stdin.read() if label == "-" else path.read_text()
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
    except (OSError, yaml.YAMLError) as e:
        raise SpecError([Problem("<file>", f"cannot read {label}: {e}".replace("\n", " "))], label) from None
    out = []
    for i, d in enumerate(docs):
        if isinstance(d, dict) and d.get("kind") not in (None, KIND):
            continue  # other kinds in the same file (a Secret, a namespace) are not ours to check
        out.append((f"{label}[{i}]" if len(docs) > 1 else label, d))
    if not out:
        raise SpecError([Problem("<file>", f"no {KIND} found in {label}")], label)
    return out


def run_validate(args: argparse.Namespace) -> int:
    failed = 0
    for path in args.files:
        try:
            docs = _documents(path)
        except SpecError as e:
            print(str(e), file=sys.stderr)
            failed += 1
            continue
        for label, doc in docs:
            try:
                tft = parse_strict(doc)
            except SpecError as e:
                failed += 1
                for problem in e.problems:
                    print(f"{label}: {e.where}: {problem}", file=sys.stderr)
                continue
            print(f"{label}: {tft.meta.ref}: valid ({tft.spec.accelerator} {tft.spec.slice.topology}, "
                  f"{tft.spec.slices} slice(s), {tft.spec.slice.hosts} host(s)/slice, {tft.spec.num_workers} workers)")
    return EXIT_INVALID if failed else 0


def run_render(args: argparse.Namespace) -> int:
    try:
        docs = _documents(args.file)
        rendered = []
        for _, doc in docs:
            if args.namespace and isinstance(doc, dict):
                doc.setdefault("metadata", {}).setdefault("namespace", args.namespace)
            rendered.extend(builders.build_children(parse_strict(doc)))
    except SpecError as e:
        for problem in e.problems:
            print(f"tpuft render: {e.where}: {problem}", file=sys.stderr)
        return EXIT_INVALID
    sys.stdout.write(yaml.safe_dump_all(rendered, sort_keys=False, width=120))
    return 0
