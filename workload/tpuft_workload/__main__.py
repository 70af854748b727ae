"""`python -m tpuft_workload verify|train ...`: the entrypoints the operator's RayJobs run.

Flag names are a contract with the operator's RayJob builder; keep them stable.
Exit codes: 0 passed, 1 failed, 2 bad arguments, 3 timeout (verify).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from tpuft import records
from tpuft.catalog import CatalogError
from tpuft.spec import DEFAULTS as D  # one source: a flag left out means what the field left out means
from tpuft.spec import LORA_DEFAULTS as LD  # spec.training.lora's, once the object is there

from tpuft.constants import (DATASET_COLUMN_KEYS, DatasetFormat, DatasetType, Overlong, TrainingFramework,
                             TrainingMethod)
from tpuft_workload.platform import Target, resolve_target

EXIT_USAGE = 2


def _positive_int(v: str) -> int:
    n = int(v)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1 (got {v})")
    return n


def _non_negative_int(v: str) -> int:
    n = int(v)
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 (got {v})")
    return n


def _positive_float(v: str) -> float:
    x = float(v)
    if not x > 0:
        raise argparse.ArgumentTypeError(f"must be > 0 (got {v})")
    return x


def _dropout(v: str) -> float:
    x = float(v)
    if not 0 <= x < 1:
        raise argparse.ArgumentTypeError(f"must be >= 0 and < 1 (got {v})")
    return x


def _column(v: str) -> tuple[str, str]:
    try:
        return records.column_pair(v)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _names(v: str) -> tuple[str, ...]:
    """a,b,c -> ("a", "b", "c"); empty: ()"""
    return tuple(n.strip() for n in v.split(",") if n.strip())


def _add_lora_args(t: argparse.ArgumentParser) -> None:
    """spec.training.method and spec.training.lora (tpuft_workload.lora); the lora flags and
    --merge-export mean something with --method lora only."""
    t.add_argument("--method", choices=[m.value for m in TrainingMethod], default=D["training.method"],
                   help="full: every weight; lora: low-rank adapters beside the frozen base "
                        f"(default {D['training.method']})")
    t.add_argument("--lora-rank", type=_positive_int, default=LD["training.lora.rank"],
                   help=f"the adapters' rank (default {LD['training.lora.rank']})")
    t.add_argument("--lora-alpha", type=_positive_int, default=LD["training.lora.alpha"],
                   help=f"their scale is alpha / rank (default {LD['training.lora.alpha']})")
    t.add_argument("--lora-dropout", type=_dropout, default=LD["training.lora.dropout"],
                   help=f"dropout on the adapters' input, 0 <= x < 1 (default {LD['training.lora.dropout']})")
    t.add_argument("--lora-target-modules", type=_names, default=(),
                   help="comma-separated linear layers to adapt (default: the model_type's, "
                        "tpuft.constants.LORA_DEFAULT_TARGET_MODULES)")
    t.add_argument("--merge-export", action="store_true", default=D["export.merge"],
                   help="also write the merged full weights to {run}/export-merged")


def _add_slice_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--accelerator", required=True,
                   help="TPU generation (v4, v5e, v5p, v6e, tpu7x; Ray/GKE spellings accepted), gpu or cpu")
    p.add_argument("--topology", required=True,
                   help="slice shape such as 4x4 or 2x2x2; with cpu/gpu, the worker count")
    p.add_argument("--slices", type=_positive_int, default=D["slices"],
                   help=f"number of slices (default {D['slices']})")
    p.add_argument("--log-file", default=None,
                   help="also write the driver's log (stdout and stderr) to this local path or gs:// URI "
                        "(the operator passes {storagePath}/{run}/logs/<job>.log)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m tpuft_workload",
                                     description="TPUFinetune workload: verify collectives, fine-tune.")
    sub = parser.add_subparsers(dest="command", required=True)

    v = sub.add_parser("verify", help="check every device of the slice with DTensor TP + all_reduce")
    _add_slice_args(v)
    v.add_argument("--timeout-seconds", type=_positive_float, default=float(D["verification.timeoutSeconds"]),
                   help=f"hard bound on the whole check, placement included (default {D['verification.timeoutSeconds']})")
    v.add_argument("--collective-timeout-seconds", type=_positive_float, default=None,
                   help="bound on the collectives alone, counted once every worker has started "
                        "(default: what is left of --timeout-seconds)")

    t = sub.add_parser("train", help="fine-tune a causal LM with Ray Train (TorchTrainer + FSDP2, or JaxTrainer)")
    _add_slice_args(t)
    t.add_argument("--model", required=True,
                   help="hub name, local path, gs:// URI, or builtin:tiny-llama")
    t.add_argument("--dataset", required=True,
                   help="hub name, local file/dir, gs:// URI (json/jsonl/parquet/csv), or builtin:dolly-mini")
    t.add_argument("--dataset-split", default=D["dataset.split"], help="datasets split syntax, e.g. 'train[:1024]'")
    t.add_argument("--dataset-format", choices=[f.value for f in DatasetFormat], default=None,
                   help="json (JSON lines) or parquet, when --dataset's suffix does not say")
    t.add_argument("--dataset-type", choices=[k.value for k in DatasetType], default=None,
                   help="what a record holds (messages, promptCompletion, instruction, text); detected from the "
                        "columns when left out")
    t.add_argument("--dataset-column", dest="dataset_columns", type=_column, action="append", default=[],
                   metavar="KEY=COLUMN", help=f"read KEY ({', '.join(DATASET_COLUMN_KEYS)}) from the dataset's "
                                              "COLUMN; repeatable")
    t.add_argument("--overlong", choices=[o.value for o in Overlong], default=D["dataset.overlong"],
                   help="an example longer than --max-seq-length: truncate it or drop it "
                        f"(default {D['dataset.overlong']})")
    t.add_argument("--epochs", type=_positive_int, default=D["training.epochs"])
    t.add_argument("--batch-size-per-device", type=_positive_int, default=D["training.batchSizePerDevice"])
    t.add_argument("--max-seq-length", type=_positive_int, default=D["training.maxSeqLength"])
    t.add_argument("--learning-rate", type=_positive_float, default=D["training.learningRate"])
    t.add_argument("--storage-path", required=True, help="local path or gs:// URI for checkpoints and export")
    t.add_argument("--run-name", required=True,
                   help="run directory under --storage-path (the operator adds the object's UID); "
                        "re-submitting the same name resumes")
    t.add_argument("--resume-from", default=None,
                   help="an earlier run's checkpoint_step_* or run directory to continue from "
                        "(spec.checkpoint.resumeFrom); only when --run-name has no checkpoint of its own")
    t.add_argument("--no-packing", dest="packing", action="store_false",
                   help="pad every example to --max-seq-length (as the GKE tutorial does) instead of packing")
    t.add_argument("--checkpoint-every-steps", type=_non_negative_int, default=D["checkpoint.everySteps"],
                   help="sharded checkpoint every K optimizer steps (0: only at epoch end)")
    t.add_argument("--keep-checkpoints", type=_positive_int, default=D["checkpoint.keep"],
                   help=f"checkpoints to keep (default {D['checkpoint.keep']})")
    t.add_argument("--max-failures", type=_non_negative_int, default=D["training.maxFailures"],
                   help="worker-group restarts from the latest checkpoint before giving up "
                        f"(default {D['training.maxFailures']})")
    t.add_argument("--report-every-steps", type=_positive_int, default=D["training.reportEverySteps"],
                   help="log and report metrics every K steps (and at every epoch end)")
    t.add_argument("--framework", choices=[f.value for f in TrainingFramework], default=D["training.framework"],
                   help="torch: TorchTrainer + FSDP2, one worker per device; jax: JaxTrainer, one worker per "
                        f"host (default {D['training.framework']})")
    _add_lora_args(t)
    t.add_argument("--seed", type=int, default=42)
    return parser


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, Target]:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        target = resolve_target(args.accelerator, args.topology, args.slices)
    except CatalogError as e:
        parser.error(str(e))
    return args, target


def _ray_init() -> None:
    import ray

    if not ray.is_initialized():
        # In a RayJob, RAY_ADDRESS points at the cluster; locally this starts a private Ray.
        ray.init(log_to_driver=True)


def main(argv: list[str] | None = None) -> int:
    # The driver never needs torch_tpu (workers import it explicitly on the TPU path); keep
    # `import torch` on a TPU image's CPU-only head pod from auto-loading it.
    os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
    args, target = parse_args(argv)
    from tpuft_workload import driver_log

    with driver_log.tee(args.log_file, args.command):
        # inside the tee: the handler writes to the stderr that also goes to the log file
        logging.basicConfig(level=os.environ.get("TPUFT_LOG_LEVEL", "INFO"),
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        return _run(args, target)


def _run(args: argparse.Namespace, target: Target) -> int:
    from tpuft_workload import faults
    from tpuft_workload.report import StatusReporter

    try:
        faults.parse_faults(faults.from_env())
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE

    if args.command == "verify":
        from tpuft_workload import verify

        _ray_init()
        res = verify.run_verification(target, args.timeout_seconds, faults.from_env(),
                                       args.collective_timeout_seconds)
        verify.print_result(res)
        StatusReporter().verification(res.to_status())
        return res.exit_code

    refusal = _refused_method(args)
    if refusal:
        return _refuse(refusal)
    from tpuft_workload import checkpoint, train

    try:  # before Ray and any worker: a bad storage path fails in seconds, with its name
        if args.framework == TrainingFramework.JAX.value:
            from tpuft_workload import jax_checkpoint

            jax_checkpoint.check_storage(args.storage_path)
        checkpoint.check_writable(checkpoint.join(args.storage_path, args.run_name))
    except checkpoint.StorageError as e:
        return _refuse(str(e))
    _ray_init()
    if args.framework == TrainingFramework.JAX.value:
        from tpuft_workload import jax_train  # the torch path never imports jax

        return jax_train.run_training(args, target, faults.from_env())
    return train.run_training(args, target, faults.from_env())


def _refused_method(args: argparse.Namespace) -> str:
    """Why spec.training.method cannot run on this framework ("" when it can)."""
    if args.method == TrainingMethod.LORA.value and args.framework == TrainingFramework.JAX.value:
        from tpuft_workload.lora import JAX_REFUSAL

        return JAX_REFUSAL
    return ""


def _refuse(error: str) -> int:
    """A run refused before Ray starts: the result line (and the status message, when reporting)."""
    from tpuft_workload.report import StatusReporter
    from tpuft_workload.train import RESULT_PREFIX

    StatusReporter().training(message=error)
    print(f"{RESULT_PREFIX} " + json.dumps({"succeeded": False, "error": error}), flush=True)
    return 1


if __name__ == "__main__":
    sys.exit(main())
