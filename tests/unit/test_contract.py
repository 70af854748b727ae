"""One source for each fact the operator and the workload share: the workload CLI's defaults are
the spec's, and the status keys the workload writes, the CRD's status schema and what the demo
reads are one list (tpuft.api.constants.TrainingStatus / VerificationStatus)."""
from __future__ import annotations

import ast
import inspect

from tpuft.api import crd, fields
from tpuft.api.constants import TrainingStatus, VerificationStatus
from tpuft.api.spec import DEFAULTS, LORA_DEFAULTS
from tpuft_local import demo
from tpuft_workload import __main__ as workload_cli
from tpuft_workload.report import TRAINING_KEYS, VERIFICATION_KEYS
from tpuft_workload.verify_result import VerifyResult

def test_workload_cli_defaults_are_the_spec_defaults():
    """The workload's flags have no defaults of their own: what is left out means what the field
    left out means (the declarations' defaults, through tpuft.api.spec.parse_run)."""
    command, _ = workload_cli.parse_args(["train", "--accelerator", "cpu", "--topology", "2", "--model", "m",
                                          "--dataset", "d", "--storage-path", "/tmp/x", "--run-name", "r"])
    run = command.run
    given = {"slices": run.slices, **{f"{name}.{key}": value for name in ("dataset", "training", "checkpoint",
                                                                          "export", "verification")
                                      for key, value in fields.to_json(getattr(run, name)).items()}}
    workload_keys = {key for key in DEFAULTS if not key.startswith(("serve.", "recovery.")) and key not in (
        "provisioningTimeoutSeconds", "suspend", "ttlSecondsAfterFinished")}
    assert {key: given[key] for key in workload_keys} == {key: DEFAULTS[key] for key in workload_keys}
    assert (run.checkpoint.keep, run.training.max_failures) == (1, 1)  # were 2 and 0 (issue 18)
    lora, _ = workload_cli.parse_args(["train", "--accelerator", "cpu", "--topology", "2", "--model", "m",
                                       "--dataset", "d", "--storage-path", "/tmp/x", "--run-name", "r",
                                       "--method", "lora"])
    adapters = fields.to_json(lora.run.training.lora)
    assert adapters.pop("targetModules") == [] and adapters == {   # none given: the model_type's, at load
        key.removeprefix("training.lora."): value for key, value in LORA_DEFAULTS.items()}
    verify, _ = workload_cli.parse_args(["verify", "--accelerator", "cpu", "--topology", "2"])
    assert verify.run.verification.timeout_seconds == DEFAULTS["verification.timeoutSeconds"]
    assert verify.run.slices == DEFAULTS["slices"]


def _status_properties() -> dict:
    return crd.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]


def test_status_keys_are_one_list():
    status = _status_properties()
    assert TRAINING_KEYS == tuple(k.value for k in TrainingStatus) == tuple(status["training"]["properties"])
    assert VERIFICATION_KEYS == tuple(k.value for k in VerificationStatus) == tuple(status["verification"]["properties"])
    result = VerifyResult(passed=True, ranks=2, hosts=1, all_reduce_sums=[[3.0], [3.0]], expected_sum=3.0,
                          max_abs_diff=0.0, seconds=1.0, message="ok")
    assert tuple(result.to_status()) == VERIFICATION_KEYS


def _demo_lookups() -> tuple[set[str], list[str]]:
    """(TR.X / VER.X members the demo reads, string literals it uses as keys of tr/ver)."""
    tree = ast.parse(inspect.getsource(demo))
    members, literals = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in ("TR", "VER"):
            members.add(f"{node.value.id}.{node.attr}")
        target = None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" and node.args:
            target, key = node.func.value, node.args[0]
        elif isinstance(node, ast.Subscript):
            target, key = node.value, node.slice
        if isinstance(target, ast.Name) and target.id in ("tr", "ver") and isinstance(key, ast.Constant):
            literals.append(f"{target.id}[{key.value!r}]")
    return members, literals


def test_the_demo_reads_only_keys_the_workload_writes():
    members, literals = _demo_lookups()
    assert literals == [], f"spell status keys through tpuft.api.constants: {literals}"
    known = {f"TR.{m.name}" for m in TrainingStatus} | {f"VER.{m.name}" for m in VerificationStatus}
    assert members and members <= known, sorted(members - known)
    line = demo._training_line({"epoch": 2, "epochs": 3, "step": 20, "totalSteps": 30, "loss": 1.23456,
                                "tokensPerSecond": 99.44, "padFraction": 0.125})
    assert line == "Epoch 2/3 | step 20/30 | loss=1.2346 | tokens/s=99.4 (real) | pad=12.5%"


def test_dataset_formats_are_one_list():
    """spec.dataset.format's CRD enum, the parser's and the workload's --dataset-format choices."""
    from tpuft.api.constants import DatasetFormat

    spec = crd.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    values = [f.value for f in DatasetFormat]
    assert spec["dataset"]["properties"]["format"]["enum"] == values
    sub = next(a for a in workload_cli.build_parser()._subparsers._group_actions[0].choices["train"]._actions
               if a.dest == "dataset.format")
    assert list(sub.choices) == values


def test_training_frameworks_are_one_list():
    """spec.training.framework's CRD enum and default, the parser's and the workload's --framework."""
    from tpuft.api.constants import TrainingFramework
    from tpuft.api.spec import DEFAULTS

    spec = crd.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    values = [f.value for f in TrainingFramework]
    field = spec["training"]["properties"]["framework"]
    assert field["enum"] == values and field["default"] == DEFAULTS["training.framework"] == "torch"
    sub = next(a for a in workload_cli.build_parser()._subparsers._group_actions[0].choices["train"]._actions
               if a.dest == "training.framework")
    assert list(sub.choices) == values and sub.default is None   # left out: the field's default
