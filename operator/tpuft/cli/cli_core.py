"""`tpuft topology`, `tpuft validate`, `tpuft render`: the pure core, from the command line.

Bad input exits 2 with one line per problem on stderr, never a traceback.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import sys
from pathlib import Path

import yaml

from tpuft.controller import builders
from tpuft.api import catalog, model_sizes, records
from tpuft.api.constants import DATASET_COLUMN_KEYS, KIND, DatasetType
from tpuft.api.spec import Problem, SpecError, TPUFinetune, spec_warnings
from tpuft.cli.strictfields import parse_strict

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
    p.add_argument("files", nargs="*", type=Path, help="YAML files (multi-document allowed); - for stdin")
    p.add_argument("--data", type=Path, default=None,
                   help="also check a local JSON lines (or Parquet, with pyarrow) training file record by record, "
                        "as the training driver does: read as the one manifest's spec.dataset says, else detected")
    p.add_argument("--type", dest="data_type", choices=[t.value for t in DatasetType], default=None,
                   help="with --data and no manifest: spec.dataset.type")
    p.add_argument("--column", dest="data_columns", action="append", default=[], metavar="KEY=COLUMN",
                   help=f"with --data and no manifest: spec.dataset.columns ({', '.join(DATASET_COLUMN_KEYS)}); "
                        "repeatable")
    p.add_argument("--model", dest="data_model", default=None, metavar="MODEL",
                   help="with --data: also render every record through this model's chat template, as the training "
                        "driver does (a model folder, a Hugging Face id or builtin:tiny-llama; needs the workload's "
                        "packages: pip install -e .[workload])")


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
    if not args.files and args.data is None:
        print("tpuft validate: give manifests, --data FILE, or both", file=sys.stderr)
        return EXIT_INVALID
    if args.data_model and args.data is None:
        print("tpuft validate: --model renders the records of --data FILE: give both", file=sys.stderr)
        return EXIT_INVALID
    failed, datasets = 0, []
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
            datasets.append(tft.spec.dataset)
            print(f"{label}: {tft.meta.ref}: valid ({tft.spec.accelerator} {tft.spec.slice.topology}, "
                  f"{tft.spec.slices} slice(s), {tft.spec.slice.hosts} host(s)/slice, {tft.spec.num_workers} workers)")
            for warning in spec_warnings(tft.spec) + fit_warnings(tft):   # told, never refused
                print(f"{label}: {tft.meta.ref}: {warning}", file=sys.stderr)
    if args.data is not None:
        failed += not _validate_data(args, datasets)
    return EXIT_INVALID if failed else 0


def fit_warnings(tft: TPUFinetune) -> list[str]:
    """Where spec.model is a model whose shape tpuft.api.model_sizes knows, or a folder on this machine
    with a config.json (a local cluster's hostPath): a line for each figure (HBM per chip, a worker
    pod's memory at load, in training (on CPU with a step of the spec's tokens), at export) that does
    not fit the slice."""
    shape = model_sizes.known(tft.spec.model) or _local_model_shape(tft.spec.model)
    if shape is None:
        return []
    training, lora = tft.spec.training, tft.spec.training.lora
    run = model_sizes.Run(method=training.method, rank=lora.rank if lora else 0,
                          targets=lora.target_modules if lora else (), framework=training.framework,
                          merged=builders.merges(tft), pod_memory=_worker_memory(tft),
                          tokens=training.batch_size_per_device * training.max_seq_length,
                          activation_checkpointing=bool(training.activation_checkpointing))
    if training.activation_checkpointing is None and not tft.spec.slice.is_tpu:   # left out: the workers' rule
        recompute = model_sizes.recompute_needed(shape, tft.spec.slice.devices, run.pod_memory or "", run)
        run = dataclasses.replace(run, activation_checkpointing=recompute)
    fit = model_sizes.fit(shape, tft.spec.slice, run)
    return model_sizes.warnings(tft.spec.model, fit)


def _local_model_shape(model_ref: str) -> model_sizes.ModelShape | None:
    """The shape in `model_ref`/config.json when that file is on this machine and says it; None otherwise."""
    config = Path(model_ref) / "config.json"
    try:
        return model_sizes.shape_of(json.loads(config.read_text()), model_ref)
    except (OSError, ValueError, AttributeError):   # not a local folder, or not a model's config
        return None


def _worker_memory(tft: TPUFinetune) -> str:
    """The worker container's memory limit, as the RayCluster builder sets it (spec.resources.worker
    over the catalog's default)."""
    group = builders.build_raycluster(tft)["spec"]["workerGroupSpecs"][0]
    return builders.worker_container(group)["resources"]["limits"]["memory"]


def _validate_data(args: argparse.Namespace, datasets: list) -> bool:
    """--data: the layout and every record, as the training driver checks them (tpuft.api.records)."""
    if len(datasets) > 1 or (datasets and (args.data_type or args.data_columns)):
        print("tpuft validate --data: give one manifest (its spec.dataset says how to read the file) or "
              "--type/--column, not both", file=sys.stderr)
        return False
    if datasets:
        declared, mapping = datasets[0].type, dict(datasets[0].columns)
    else:
        try:
            mapping = dict(records.column_pair(c) for c in args.data_columns)
        except ValueError as e:
            print(f"tpuft validate --data: --column: {e}", file=sys.stderr)
            return False
        declared = args.data_type
    label = str(args.data)
    try:
        rows = _data_records(args.data)
        names = list(dict.fromkeys(k for row in rows[:1000] for k in row))
        layout = records.detect(names, declared, mapping)
        count = records.check(rows, layout)
        if args.data_model:
            _render_records(args.data_model, rows, layout)
    except (OSError, ValueError) as e:   # RecordError is a ValueError: the record's number and field
        print(f"{label}: {e}", file=sys.stderr)
        return False
    columns = ", ".join(f"{k}={v}" if k != v else k for k, v in layout.columns.items())
    rendered = f", rendered through {args.data_model}'s chat template" if args.data_model else ""
    print(f"{label}: {count} records of type {layout.type.value} ({columns}){rendered}: valid")
    return True


def _render_records(model: str, rows: list[dict], layout: records.Layout) -> None:
    """--model: every record rendered through the model's tokenizer as the training driver's tokenize
    stage renders it (tpuft_workload.render); ValueError naming the first the template refuses or
    cannot label. The workload's modules are named as strings: the operator image has no transformers."""
    try:
        modellib = importlib.import_module("tpuft_workload.model")
        datalib = importlib.import_module("tpuft_workload.data")
        renderlib = importlib.import_module("tpuft_workload.render")
    except ImportError as e:
        raise ValueError(f"--model renders through the workload's code, which is not installed here ({e}): "
                         "pip install -e .[workload], or leave --model out") from None
    try:
        tokenizer = modellib.load_tokenizer(model)
    except (OSError, ValueError) as e:
        raise ValueError(f"--model {model}: cannot load its tokenizer: {e}") from None
    for number, row in enumerate(rows, start=1):
        try:
            datalib.example_of(tokenizer, row, layout, number)
        except renderlib.RenderError as e:
            raise ValueError(f"record {number}: {e}") from None


def _data_records(path: Path) -> list[dict]:
    """A local file's records: JSON lines (blank lines skipped), a JSON array, or Parquet (pyarrow)."""
    if path.suffix.lower() == ".parquet":
        try:
            import pyarrow.parquet as pq  # type: ignore[import-not-found,unused-ignore]
        except ImportError:
            raise ValueError("reading Parquet needs pyarrow (pip install pyarrow)") from None
        return pq.read_table(path).to_pylist()
    text = path.read_text()
    if text.lstrip().startswith("["):
        rows = json.loads(text)
    else:
        rows = []
        for number, line in enumerate((t for t in text.splitlines() if t.strip()), start=1):
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"record {number}: not JSON ({e.msg})") from None
    if not rows:
        raise ValueError("no records")
    bad = next((n for n, row in enumerate(rows, start=1) if not isinstance(row, dict)), None)
    if bad is not None:
        raise ValueError(f"record {bad}: expected a JSON object of columns")
    return rows


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
