"""`python -m tpuft_workload verify|train|publish|unpublish ...`: the entrypoints the operator's RayJobs run.

The operator passes the run as one JSON document (`--spec`, tpuft.api.spec.workload_document), read
here with the parser the operator uses (tpuft.api.spec.parse_run). By hand, each of the document's
fields is also a flag, made from the same declarations (tpuft.api.spec; a flag overrides --spec).
publish/unpublish put a LoRA export into a served base's adapters root and take it out
(tpuft_workload.adapters); they print one JSON line saying what they did.
Exit codes: 0 passed, 1 failed, 2 bad arguments, 3 timeout (verify).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import MutableMapping
from typing import Any

from tpuft.api import fields, records, spec as speclib
from tpuft.api.catalog import CatalogError
from tpuft.api.constants import TrainingFramework
from tpuft.api.kuberay import (RAY_TRAIN_HEALTH_CHECK_INTERVAL_ENV, RAY_TRAIN_HEALTH_CHECK_INTERVAL_S,
                               RAY_TRAIN_PREEMPTION_WATCHER_ENV)
from tpuft_workload.command import Command
from tpuft_workload.platform import Target, resolve_target

EXIT_USAGE = 2


# The document's sections, as the flags' dotted destinations ("" for the spec's top level).
_FLAG_SECTIONS: tuple[tuple[str, type], ...] = (
    ("", speclib.Spec), ("dataset", speclib.Dataset), ("training", speclib.Training),
    ("training.lora", speclib.Lora), ("checkpoint", speclib.Checkpoint), ("export", speclib.Export),
    ("evaluation", speclib.Evaluation))


def _kebab(name: str) -> str:
    return "".join(f"-{ch.lower()}" if ch.isupper() else ch for ch in name)


def _column(v: str) -> tuple[str, str]:
    try:
        return records.column_pair(v)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _names(v: str) -> list[str]:
    """a,b,c -> ["a", "b", "c"]"""
    return [n.strip() for n in v.split(",") if n.strip()]


def _add_declared(p: argparse.ArgumentParser, section: str, cls: type) -> None:
    """One flag per workload field of a section, from its declaration; dest is its dotted JSON path."""
    for d in fields.declared(cls):
        if not d.api.workload:
            continue
        dest = f"{section}.{d.name}" if section else d.name
        flag = "--" + (d.api.flag or _kebab(d.name))
        metavar = flag[2:].upper().replace("-", "_")
        default = f" (default {d.api.default})" if d.api.default is not None else ""
        help_text = d.api.description.replace("%", "%%") + default
        kind = fields.scalar_type(d) if fields.is_scalar(d) else ""
        if kind == "boolean":
            p.add_argument(flag, dest=dest, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        elif d.name == "columns":
            p.add_argument(flag, dest=dest, type=_column, action="append", default=None, metavar="KEY=COLUMN",
                           help=help_text + " Repeatable.")
        elif d.name == "targetModules":
            p.add_argument(flag, dest=dest, type=_names, default=None, metavar="A,B", help=help_text)
        else:
            convert = {"integer": int, "number": float}.get(kind, str)
            choices = list(d.api.enum) if d.api.enum else None
            p.add_argument(flag, dest=dest, type=convert, choices=choices, default=None, help=help_text,
                           metavar=None if choices else metavar)


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--spec", default=None, metavar="JSON",
                   help="the run as one JSON document (what the operator passes: tpuft.api.spec.workload_document)")
    p.add_argument("--accelerator", dest="accelerator", default=None,
                   help="TPU generation (v4, v5e, v5p, v6e, tpu7x; Ray/GKE spellings accepted), gpu or cpu")
    p.add_argument("--topology", dest="topology", default=None,
                   help="slice shape such as 4x4 or 2x2x2; with cpu/gpu, the worker count")
    p.add_argument("--log-file", default=None,
                   help="also write the driver's log (stdout and stderr) to this local path or gs:// URI "
                        "(the operator passes {storagePath}/{run}/logs/<job>.log)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m tpuft_workload",
                                     description="TPUFinetune workload: verify collectives, fine-tune.")
    sub = parser.add_subparsers(dest="command", required=True)

    v = sub.add_parser("verify", help="check every device of the slice with DTensor TP + all_reduce")
    _add_common(v)
    slices = fields.field_of(speclib.Spec, "slices")
    v.add_argument("--slices", dest="slices", type=int, default=None, help=slices.api.description)
    timeout = fields.field_of(speclib.Verification, "timeout_seconds")
    v.add_argument("--timeout-seconds", dest="verification.timeoutSeconds", type=int, default=None,
                   help=timeout.api.description + " Bounds the whole check, placement included "
                        f"(default {timeout.api.default}).")
    v.add_argument("--collective-timeout-seconds", type=float, default=None,
                   help="bound on the collectives alone, counted once every worker has started "
                        "(default: what is left of --timeout-seconds)")
    v.add_argument("--run-name", default=None,
                   help="with --spec's checkpoint.storagePath: first check that the run's directory there can "
                        "be written (the operator passes the training job's run name)")

    t = sub.add_parser("train", help="fine-tune a causal LM with Ray Train (TorchTrainer + FSDP2, or JaxTrainer)")
    _add_common(t)
    t.add_argument("--run-name", required=True,
                   help="run directory under --storage-path (the operator adds the object's UID); "
                        "re-submitting the same name resumes")
    t.add_argument("--after-verification", action="store_true",
                   help="start the trainer only once the TPUFinetune's CollectivesVerified condition is True (the "
                        "operator submits this job beside the slice's re-verification, so its setup overlaps it); "
                        "False, or not within the verification's timeout: exit failed")
    for section, cls in _FLAG_SECTIONS:
        _add_declared(t, section, cls)
    _add_adapter_commands(sub)
    return parser


ADAPTER_COMMANDS = ("publish", "unpublish")


def _add_adapter_commands(sub) -> None:
    root_help = "the served base's adapters root: <its storage root for the run>/adapters (a folder or gs:// URI)"
    name_help = "the adapter's name (a DNS-1123 label); clients ask for <base model id>:<name>"
    p = sub.add_parser("publish", help="copy a LoRA export into a served base's adapters root, its marker written last")
    p.add_argument("--export", required=True, help="the LoRA adapter export folder (status.training.exportedModel)")
    p.add_argument("--adapters-root", required=True, help=root_help)
    p.add_argument("--name", required=True, help=name_help)
    p.add_argument("--source", required=True, help="namespace/name of the fine-tune that trained it")
    p.add_argument("--uid", required=True, help="the fine-tune's metadata.uid (unpublish deletes only its own)")
    p.add_argument("--eval-set", required=True, help="the eval set's fingerprint (the eval loss was measured on it); "
                   "empty: published without an eval set (spec.publish.when always, no spec.evaluation)")
    p.add_argument("--eval-loss", type=float, default=None, help="the fine-tune's eval loss (none: not evaluated)")
    u = sub.add_parser("unpublish", help="remove an adapter from a served base's adapters root, if --uid published it")
    u.add_argument("--adapters-root", required=True, help=root_help)
    u.add_argument("--name", required=True, help=name_help)
    u.add_argument("--uid", required=True, help="the fine-tune's metadata.uid: another uid's publication is left alone")


def _adapter_command(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """publish or unpublish: one JSON line of what was done; 1 with the storage's failure, 2 for a bad name."""
    from tpuft_workload import adapters

    try:
        if args.command == "publish":
            done = adapters.publish(args.export, args.adapters_root, args.name, args.source, args.uid,
                                    args.eval_set, args.eval_loss)
        else:
            done = adapters.unpublish(args.adapters_root, args.name, args.uid)
    except ValueError as e:
        parser.error(str(e))
    except (adapters.PublishError, FileNotFoundError) as e:
        print(f"error: {args.command} {args.name}: {e}", file=sys.stderr)
        return 1
    print(json.dumps(done, sort_keys=True), flush=True)
    return 0


def _document(args: argparse.Namespace) -> dict[str, Any]:
    """--spec, with every flag given set over it."""
    try:
        doc = json.loads(args.spec) if args.spec else {}
    except json.JSONDecodeError as e:
        raise ValueError(f"--spec is not JSON: {e}") from None
    for dest, value in vars(args).items():
        if value is None or dest in ("spec", "command", "run_name", "log_file", "collective_timeout_seconds",
                                         "after_verification"):
            continue
        if dest.endswith("columns"):
            value = dict(value)
        node = doc
        *parents, leaf = dest.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return doc


def _by_flag(parser: argparse.ArgumentParser, command: str, error: speclib.SpecError) -> str:
    """Each problem of the document, named by the flag that sets its field (when one does)."""
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    flags = {a.dest: a.option_strings[0] for a in sub._actions if a.option_strings}
    return "; ".join(f"{flags[p.field.removeprefix('spec.')] + ' (' + p.field + ')' if p.field.removeprefix('spec.') in flags else p.field}: {p.message}"
                     for p in error.problems)


def parse_args(argv: list[str] | None = None) -> tuple[Command, Target]:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        doc = _document(args)
        sections = speclib.TRAINING_SECTIONS if args.command == "train" else speclib.VERIFICATION_SECTIONS
        if args.command == "verify" and args.run_name:   # the storage check reads spec.checkpoint
            sections = (*sections, "checkpoint")
        run = speclib.parse_run(doc, sections)
        target = resolve_target(run.accelerator, run.topology, run.slices)
    except speclib.SpecError as e:
        parser.error(_by_flag(parser, args.command, e))
    except (ValueError, CatalogError) as e:
        parser.error(str(e))
    command = Command(args.command, run, getattr(args, "run_name", "") or "", args.log_file,
                      getattr(args, "collective_timeout_seconds", None), bool(getattr(args, "after_verification", False)))
    return command, target


def driver_environment(env: MutableMapping[str, str]) -> None:
    """What the driver sets before Ray Train starts (a value the user set in spec.env stays).
    Ray Train's PreemptionWatcher is off: it sees only Ray Core's node drains, which nothing here
    makes (tpuft_workload.preemption listens for the pod's SIGTERM instead), and its actor process
    costs a worker pod about 110 MiB: what a 1.1B LoRA step in a 4Gi CPU pod was killed for
    (docs/performance.md). Its controller polls the workers every 0.5 s, not 2: each report waits for
    that poll (tpuft.api.kuberay), and a pod's SIGTERM handler runs at the next one."""
    env.setdefault(RAY_TRAIN_PREEMPTION_WATCHER_ENV, "0")
    env.setdefault(RAY_TRAIN_HEALTH_CHECK_INTERVAL_ENV, RAY_TRAIN_HEALTH_CHECK_INTERVAL_S)


def _ray_init() -> None:
    import ray

    if not ray.is_initialized():
        # In a RayJob, RAY_ADDRESS points at the cluster; locally this starts a private Ray.
        ray.init(log_to_driver=True)


def main(argv: list[str] | None = None) -> int:
    # The driver never needs torch_tpu (workers import it explicitly on the TPU path); keep
    # `import torch` on a TPU image's CPU-only head pod from auto-loading it.
    os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
    driver_environment(os.environ)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command in ADAPTER_COMMANDS:
        return _adapter_command(parser, args)
    command, target = parse_args(argv)
    from tpuft_workload import driver_log

    with driver_log.tee(command.log_file, command.name):
        # inside the tee: the handler writes to the stderr that also goes to the log file
        logging.basicConfig(level=os.environ.get("TPUFT_LOG_LEVEL", "INFO"),
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        return _run(command, target)


def _run(command: Command, target: Target) -> int:
    from tpuft_workload import faults
    from tpuft_workload.report import StatusReporter

    try:
        faults.parse_faults(faults.from_env())
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE

    run = command.run
    if command.name == "verify":
        from tpuft_workload import verify

        error = _storage_error(run.checkpoint.storage_path, command.run_name) if command.run_name else None
        if error is not None:   # before Ray reserves the slice: a storage problem is not the slice's
            res = verify.storage_refused(target.world_size, error)
        else:
            _ray_init()
            res = verify.run_verification(target, float(run.verification.timeout_seconds), faults.from_env(),
                                           command.collective_timeout_seconds)
        verify.print_result(res)
        StatusReporter().verification(res.to_status())
        return res.exit_code

    from tpuft_workload import train

    storage_path = run.checkpoint.storage_path
    # before Ray and any worker: a bad storage path fails in seconds, with its name
    error = _storage_error(storage_path, command.run_name, run.training.framework == TrainingFramework.JAX.value)
    if error is not None:
        return _refuse(error)
    _ray_init()
    if run.training.framework == TrainingFramework.JAX.value:
        from tpuft_workload import jax_train  # the torch path never imports jax

        return jax_train.run_training(command, target, faults.from_env())
    return train.run_training(command, target, faults.from_env())


def _storage_error(storage_path: str, run_name: str, jax: bool = False) -> str | None:
    """Why the run's directory under storage_path cannot be written (checkpoint.StorageError's message:
    the bucket and the identity named), or None. jax: Orbax's own filesystem layer is checked too."""
    from tpuft_workload import checkpoint

    try:
        if jax:
            from tpuft_workload import jax_checkpoint

            jax_checkpoint.check_storage(storage_path)
        checkpoint.check_writable(checkpoint.join(storage_path, run_name))
    except checkpoint.StorageError as e:
        return str(e)
    return None


def _refuse(error: str) -> int:
    """A run refused before Ray starts, its storage not writable: the result line, and status.training's
    message and storageError when reporting (the operator's reason StorageNotWritable)."""
    from tpuft_workload.report import StatusReporter
    from tpuft_workload.train import RESULT_PREFIX

    StatusReporter().training(message=error, storageError=error)
    print(f"{RESULT_PREFIX} " + json.dumps({"succeeded": False, "error": error}), flush=True)
    return 1


if __name__ == "__main__":
    sys.exit(main())
