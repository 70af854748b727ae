"""Platform table, TPU env check, CLI contract with the operator, fault specs, status reporting."""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys

import pytest
import yaml

from tpuft_workload import __main__ as cli
from tpuft_workload import faults, platform
from tpuft_workload.report import TRAINING_KEYS, VERIFICATION_KEYS, StatusReporter


@pytest.mark.parametrize("acc,topo,slices,kind,backend,device,world", [
    ("v6e", "4x4", 1, "tpu", "tpu_dist", "tpu", 16),
    ("TPU-V6E", "4x4", 2, "tpu", "tpu_dist", "tpu", 32),
    ("tpu7x", "2x2x2", 1, "tpu", "tpu_dist", "tpu", 16),     # 2 devices per chip
    ("v5e", "2x4", 1, "tpu", "tpu_dist", "tpu", 8),
    ("cpu", "2", 1, "cpu", "gloo", "cpu", 2),
    ("gpu", "4", 1, "gpu", "nccl", "cuda", 4),
])
def test_platform_selection(acc, topo, slices, kind, backend, device, world):
    t = platform.resolve_target(acc, topo, slices)
    assert (t.platform.kind, t.platform.backend, t.platform.device_type, t.world_size) == \
        (kind, backend, device, world)
    assert t.platform.mixed_precision is (kind != "cpu")


def test_tpu_env_check_names_missing_variables():
    multi = platform.resolve_target("v6e", "4x4").shape
    single = platform.resolve_target("v6e", "2x2").shape
    env = {"TPU_WORKER_ID": "0", "TORCH_TPU_TOPOLOGY": "4,4,1"}
    assert platform.missing_tpu_env(multi, env) == ["TPU_WORKER_HOSTNAMES", "TORCH_TPU_SLICEBUILDER_ADDRESSES"]
    assert platform.missing_tpu_env(single, env) == ["TORCH_TPU_SLICEBUILDER_ADDRESSES"]  # one host: no list
    full = {**env, "TPU_WORKER_HOSTNAMES": "a,b,c,d", "TORCH_TPU_SLICEBUILDER_ADDRESSES": "a:8471"}
    assert platform.missing_tpu_env(multi, full) == []
    msg = platform.tpu_env_error(["TORCH_TPU_TOPOLOGY"], "host-1")
    assert "TORCH_TPU_TOPOLOGY" in msg and "webhook" in msg and "host-1" in msg


def test_cpu_path_never_imports_torch_tpu():
    import sys

    platform.load_backend(platform.PLATFORMS["cpu"])
    assert "torch_tpu" not in sys.modules


def test_the_driver_turns_ray_train_s_preemption_watcher_off_polls_every_half_second_and_ray_train_passes_both_on(
        monkeypatch):
    """Ray Train's PreemptionWatcher is an actor process in some worker pod (about 110 MiB) that watches
    for node drains nothing here makes: the driver turns it off. Its controller's poll, which each
    report waits for, comes every 0.5 s, not 2. A value the user set in spec.env stays, and Ray Train
    hands the driver's values to its controller, which reads them."""
    from ray._private import ray_constants
    from ray.train.v2._internal import constants as train

    watcher, interval = train.ENABLE_PREEMPTION_WATCHER_ENV_VAR, train.HEALTH_CHECK_INTERVAL_S_ENV_VAR
    env: dict[str, str] = {}
    cli.driver_environment(env)
    assert env == {watcher: "0", interval: "0.5"}
    chosen = {watcher: "1", interval: "3"}
    cli.driver_environment(chosen)
    assert chosen == {watcher: "1", interval: "3"}
    for name in (watcher, interval):
        monkeypatch.delenv(name, raising=False)
    cli.driver_environment(os.environ)
    assert {k: train.get_env_vars_to_propagate()[k] for k in (watcher, interval)} == {watcher: "0", interval: "0.5"}
    assert ray_constants.env_bool(watcher, train.DEFAULT_ENABLE_PREEMPTION_WATCHER) is False   # as the controller reads it
    assert float(os.getenv(interval, train.DEFAULT_HEALTH_CHECK_INTERVAL_S)) == 0.5


def test_cli_train_flags_match_the_operator_contract():
    command, target = cli.parse_args([
        "train", "--accelerator", "v6e", "--topology", "4x4", "--slices", "1",
        "--model", "google/gemma-4-E2B-it", "--dataset", "databricks/databricks-dolly-15k",
        "--dataset-split", "train[:1024]", "--epochs", "3", "--batch-size-per-device", "4",
        "--max-seq-length", "512", "--learning-rate", "2e-05", "--storage-path", "gs://bucket/p",
        "--run-name", "run-1", "--no-packing", "--checkpoint-every-steps", "50",
        "--keep-checkpoints", "3", "--max-failures", "2", "--report-every-steps", "5", "--seed", "7"])
    run, training = command.run, command.run.training
    assert target.world_size == 16 and target.platform.backend == "tpu_dist"
    assert (run.model, run.dataset.split, training.epochs, training.batch_size_per_device) == \
        ("google/gemma-4-E2B-it", "train[:1024]", 3, 4)
    assert (training.max_seq_length, training.learning_rate, run.checkpoint.storage_path, command.run_name) == \
        (512, 2e-5, "gs://bucket/p", "run-1")
    assert training.packing is False and training.seed == 7
    assert (run.checkpoint.every_steps, run.checkpoint.keep, training.max_failures, training.report_every_steps) == \
        (50, 3, 2, 5)
    command, _ = cli.parse_args(["verify", "--accelerator", "cpu", "--topology", "2", "--timeout-seconds", "30"])
    assert command.run.verification.timeout_seconds == 30 and command.run.slices == 1


def test_the_operators_document_and_the_flags_give_the_same_run():
    """--spec (what the RayJobs carry) and the same fields as flags (by hand) parse to one Run; a
    flag given beside --spec wins."""
    document = {"accelerator": "cpu", "topology": "2", "model": "m", "dataset": {"name": "d", "columns": {
        "prompt": "q"}}, "training": {"epochs": 2, "method": "lora", "lora": {"rank": 4}},
                "checkpoint": {"storagePath": "/tmp/x"}}
    by_document, _ = cli.parse_args(["train", "--spec", json.dumps(document), "--run-name", "r"])
    by_flags, _ = cli.parse_args(["train", "--accelerator", "cpu", "--topology", "2", "--model", "m", "--dataset", "d",
                                  "--dataset-column", "prompt=q", "--epochs", "2", "--method", "lora",
                                  "--lora-rank", "4", "--storage-path", "/tmp/x", "--run-name", "r"])
    assert by_document == by_flags
    both, _ = cli.parse_args(["train", "--spec", json.dumps(document), "--run-name", "r", "--epochs", "5"])
    assert both.run.training.epochs == 5 and both.run.training.lora == by_document.run.training.lora


@pytest.mark.parametrize("argv,needle", [
    (["verify", "--accelerator", "v6e", "--topology", "3x3"], "--topology"),
    (["verify", "--accelerator", "v9", "--topology", "4x4"], "--accelerator"),
    (["verify", "--accelerator", "cpu", "--topology", "2", "--timeout-seconds", "0"],
     "--timeout-seconds (spec.verification.timeoutSeconds): Invalid value: 0"),
    (["train", "--accelerator", "cpu", "--topology", "2"], "required"),
    (["train", "--accelerator", "cpu", "--topology", "2", "--run-name", "r"],
     "--model (spec.model): Required value"),
    (["train", "--spec", "{not json", "--run-name", "r"], "--spec is not JSON"),
])
def test_cli_rejects_bad_arguments_with_exit_2(argv, needle, capsys):
    with pytest.raises(SystemExit) as e:
        cli.parse_args(argv)
    assert e.value.code == 2
    assert needle in capsys.readouterr().err


def test_fault_specs():
    assert faults.parse_faults("hang-rank:1, kill-rank:0:step:7, sigterm-rank:1:step:3") == [
        faults.Fault("hang", 1), faults.Fault("kill", 0, 7), faults.Fault("sigterm", 1, 3)]
    assert faults.parse_faults("") == []
    with pytest.raises(ValueError, match="hang-rank:R"):
        faults.parse_faults("hang:1")


def test_status_reporter_is_a_no_op_without_the_cr_identity(monkeypatch):
    monkeypatch.delenv("TPUFT_NAMESPACE", raising=False)
    monkeypatch.delenv("TPUFT_NAME", raising=False)
    r = StatusReporter()
    assert not r.enabled and r.training(step=1) is False and r.failures == 0


def test_status_reporter_swallows_api_errors(monkeypatch, tmp_path):
    bad = tmp_path / "kubeconfig"
    bad.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "x",
        "clusters": [{"name": "x", "cluster": {"server": "http://127.0.0.1:9"}}],
        "contexts": [{"name": "x", "context": {"cluster": "x", "user": "x"}}],
        "users": [{"name": "x", "user": {"token": "secret-token-never-logged"}}]}))
    monkeypatch.setenv("KUBECONFIG", str(bad))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    r = StatusReporter("ns", "name", timeout_s=2)
    assert r.training(step=3, loss=1.0) is False          # connection refused: logged, not raised
    assert r.failures == 1 and "secret-token" not in (r.last_error or "")


def test_status_reporter_writes_status_subresource(kubeconfig, namespace, kube_api, monkeypatch):
    from pathlib import Path

    from kubernetes import client

    from tpuft.api.constants import GROUP, PLURAL, VERSION

    api = client.CustomObjectsApi(kube_api)
    example = yaml.safe_load((Path(__file__).resolve().parents[2] / "examples" / "local-cpu.yaml").read_text())
    example["metadata"] = {"name": "status-test"}
    api.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, example)
    # the operator owns the other status keys: they must survive our patches
    api.patch_namespaced_custom_object_status(GROUP, VERSION, namespace, PLURAL, "status-test",
                                              {"status": {"phase": "Training"}},
                                              _content_type="application/merge-patch+json")
    monkeypatch.setenv("KUBECONFIG", kubeconfig)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("TPUFT_NAMESPACE", namespace)
    monkeypatch.setenv("TPUFT_NAME", "status-test")
    r = StatusReporter()
    assert r.verification({"passed": False, "ranks": 2, "message": "storage check failed: x", "storageError": "x"})
    stored = api.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "status-test")["status"]
    assert stored["verification"]["storageError"] == "x"   # the CRD keeps it (an undeclared key is pruned)
    assert r.verification({"passed": True, "ranks": 2, "hosts": 1, "allReduceSum": 3.0, "expectedSum": 3.0,
                           "maxAbsDiff": 2e-7, "seconds": 4.2, "message": "ok", "extra": "dropped"})
    assert r.training(epoch=1, epochs=3, step=10, totalSteps=30, loss=2.5, tokensPerSecond=100.0,
                      paddedTokensPerSecond=120.0, stepTimeSeconds=0.1, padFraction=0.17,
                      lastCheckpoint="/ckpt/checkpoint_step_0000010")
    assert r.training(step=20, loss=2.0, exportedModel="/ckpt/export")  # merges, keeps epoch etc.
    with pytest.raises(ValueError, match="not a status.training key"):
        r.training(phase="Succeeded")
    status = api.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "status-test")["status"]
    assert status["phase"] == "Training"
    # every key, but a passing verification's storageError: sent as null, it clears the earlier one
    assert set(status["verification"]) == set(VERIFICATION_KEYS) - {"storageError"}
    assert status["verification"]["allReduceSum"] == 3.0
    assert set(status["training"]) <= set(TRAINING_KEYS)
    assert status["training"]["epoch"] == 1 and status["training"]["step"] == 20
    assert status["training"]["exportedModel"] == "/ckpt/export" and status["training"]["updatedAt"].endswith("Z")


def test_tpu_rank_layout(monkeypatch):
    from tpuft_workload.verify import _slice_index, tpu_rank

    v6e = platform.resolve_target("v6e", "4x4").shape       # 4 hosts x 4 devices
    assert [tpu_rank(v6e, 0, w, d) for w, d in ((0, 0), (1, 0), (3, 3))] == [0, 4, 15]
    assert tpu_rank(v6e, 1, 0, 0) == 16                      # second slice starts after the first
    x7 = platform.resolve_target("tpu7x", "2x2x2").shape     # 2 hosts x 8 devices (2 per chip)
    assert tpu_rank(x7, 0, 1, 7) == 15
    assert _slice_index(20, 16) == 1                         # no TPU_NAME: bundle order
    # TPU_NAME as the webhook names replica 1 of one group, and as the operator names slice 1's own group
    # under Kueue TAS (builders._group_per_slice): the same slice either way
    monkeypatch.setenv("TPU_NAME", "v6e-16-1")
    assert _slice_index(0, 16) == 1


@pytest.mark.parametrize("acc,topo,slices,workers,ray_type", [
    ("v6e", "4x4", 1, 16, "TPU-V6E"),
    ("v6e", "4x4", 2, 32, "TPU-V6E"),
    ("tpu7x", "2x2x2", 1, 16, "TPU-V7X"),
])
def test_tpu_scaling_config_passes_ray_validation(acc, topo, slices, workers, ray_type, monkeypatch):
    """Ray's ScalingConfig validates TPU worker counts at construction: ours must agree."""
    from tpuft_workload import train

    if acc == "tpu7x":
        monkeypatch.setenv("RAY_TPU_RESOURCE_PER_CHIP", "2")   # the operator sets it on every pod
    else:
        monkeypatch.delenv("RAY_TPU_RESOURCE_PER_CHIP", raising=False)
    _, target = cli.parse_args(["train", "--accelerator", acc, "--topology", topo, "--slices", str(slices),
                                   "--model", "m", "--dataset", "d", "--storage-path", "gs://bucket/p",
                                   "--run-name", "r"])
    sc = train.scaling_config(target)
    assert (sc.use_tpu, sc.topology, sc.accelerator_type, sc.num_workers, sc.resources_per_worker) == \
        (True, topo, ray_type, workers, {"TPU": 1})


# --- the run's storage, checked before any TPU work; its own status key (reason StorageNotWritable) ---

def _storage_cli(command: str, storage: str, env: dict) -> tuple[subprocess.CompletedProcess, dict]:
    """`python -m tpuft_workload <command>` as the operator's RayJob runs it, with an unwritable storage path."""
    from tests.factories import MINIMUM
    from tpuft.controller import builders
    from tpuft.api import spec as speclib

    doc = {**MINIMUM, "metadata": {"name": "st", "namespace": "storage", "uid": "u"},
           "spec": {**MINIMUM["spec"], "accelerator": "cpu", "topology": "2", "model": "builtin:tiny-llama",
                    "dataset": {"name": "builtin:dolly-mini"}, "checkpoint": {"storagePath": storage}}}
    entrypoint = (builders.verify_entrypoint if command == "verify" else builders.train_entrypoint)(speclib.parse(doc))
    argv = shlex.split(entrypoint)[3:]   # after python -m tpuft_workload
    argv[argv.index("--log-file") + 1] = os.devnull
    proc = subprocess.run([sys.executable, "-m", "tpuft_workload", *argv], capture_output=True, text=True, timeout=120,
                          # os.environ: the status recorder's KUBECONFIG; env: the session's Ray token
                          env={**os.environ, **env, "TPUFT_NAMESPACE": "storage", "TPUFT_NAME": "st"})
    prefix = "TPUFT_VERIFY_RESULT " if command == "verify" else "TPUFT_TRAIN_RESULT "
    line = next(x for x in proc.stdout.splitlines() if x.startswith(prefix))
    return proc, json.loads(line[len(prefix):])


def test_verify_refuses_an_unwritable_storage_before_ray_and_reports_it_as_storage(tmp_path, ray_auth_env,
                                                                                     status_recorder):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    status_recorder.take()
    proc, result = _storage_cli("verify", str(blocker), ray_auth_env)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert result["passed"] is False and str(blocker) in result["storageError"]
    assert "Started a local Ray instance" not in proc.stderr + proc.stdout   # no slice time spent
    [patch] = status_recorder.take("verification")
    assert patch["storageError"] == result["storageError"] and patch["passed"] is False


def test_train_refuses_an_unwritable_storage_and_reports_it_as_storage(tmp_path, ray_auth_env, status_recorder):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    status_recorder.take()
    proc, result = _storage_cli("train", str(blocker), ray_auth_env)
    assert proc.returncode == 1 and "not writable" in result["error"], proc.stderr[-2000:]
    [patch] = status_recorder.take("training")
    assert patch["storageError"] == patch["message"] == result["error"]
