"""Where a run keeps its files: a checkpoint path that cannot be written fails in seconds, with its
name, before Ray starts; and on gs://, against a real GCS API (fake-gcs-server) with the token from
the GKE metadata server's path (tests/gcs_fixtures.py), everything a run keeps gets there."""
import base64
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from tpuft_workload import checkpoint, storage


def test_writable_local_path_is_created_and_left_clean(tmp_path):
    target = tmp_path / "bucket" / "run"
    checkpoint.check_writable(str(target))
    assert target.is_dir() and list(target.iterdir()) == []


def test_a_path_under_a_file_is_reported_with_its_name(tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    with pytest.raises(checkpoint.StorageError) as err:
        checkpoint.check_writable(str(blocker / "run"))
    assert str(blocker / "run") in str(err.value) and "not writable" in str(err.value)
    assert "spec.checkpoint.storagePath" in str(err.value)


def test_train_cli_fails_fast_on_an_unwritable_storage_path(tmp_path, ray_auth_env):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    proc = subprocess.run(
        [sys.executable, "-m", "tpuft_workload", "train", "--accelerator", "cpu", "--topology", "2",
         "--model", "builtin:tiny-llama", "--dataset", "builtin:dolly-mini", "--storage-path", str(blocker),
         "--run-name", "r"],
        # the session's token: a regression that reaches ray.init must not write ~/.ray/auth_token
        capture_output=True, text=True, timeout=120, env={**ray_auth_env, "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 1, proc.stderr[-2000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("TPUFT_TRAIN_RESULT "))
    result = json.loads(line.split(" ", 1)[1])
    assert result["succeeded"] is False and "not writable" in result["error"]
    assert "ray.init" not in proc.stderr and "Started a local Ray instance" not in proc.stderr + proc.stdout


# ---- spec.checkpoint.resumeFrom: what is refused before any worker starts -----------------------

def _run_dir(root, manifest=True, committed=True, step=14):
    run = root / "ns-demo-uid-a"
    ckpt = run / f"checkpoint_step_{step:07d}"
    ckpt.mkdir(parents=True)
    (ckpt / checkpoint.TRAIN_STATE).write_text(json.dumps({"step": step}))
    if committed:
        (ckpt / checkpoint.COMMITTED).write_text("ok\n")
    if manifest:
        checkpoint.write_run_manifest(str(run), {"model": "builtin:tiny-llama", "architecture": {"class": "X"}})
    return run, ckpt


def test_resume_from_a_run_directory_picks_its_newest_committed_checkpoint(tmp_path):
    run, ckpt = _run_dir(tmp_path)
    (run / "checkpoint_step_0000020").mkdir()  # newer but never committed
    assert checkpoint.resolve_resume(str(run)) == (str(ckpt), json.loads((run / checkpoint.RUN_MANIFEST).read_text()))
    assert checkpoint.resolve_resume(str(ckpt) + "/")[0] == str(ckpt)


@pytest.mark.parametrize("case,words", [
    ("missing", "does not exist"),
    ("foreign", "was not written by a TPUFinetune"),
    ("file", "is a file"),
    ("uncommitted", "is incomplete"),
    ("empty-run", "holds no committed checkpoint"),
    ("other-format", "is not a tpuft-run/v1 manifest"),
])
def test_resume_from_refusals_name_the_field_and_the_path(tmp_path, case, words):
    if case == "missing":
        target = tmp_path / "gone"
    elif case == "foreign":  # checkpoints some other tool wrote: no manifest beside them
        _, target = _run_dir(tmp_path, manifest=False)
    elif case == "file":
        target = tmp_path / "model.safetensors"
        target.write_text("x")
    elif case == "uncommitted":
        _, target = _run_dir(tmp_path, committed=False)
    elif case == "empty-run":
        target, _ = _run_dir(tmp_path, committed=False)
    else:
        target, _ = _run_dir(tmp_path)
        (target / checkpoint.RUN_MANIFEST).write_text(json.dumps({"format": "something-else/v9"}))
    with pytest.raises(checkpoint.ResumeError) as err:
        checkpoint.resolve_resume(str(target))
    assert str(err.value).startswith("spec.checkpoint.resumeFrom: ") and str(target) in str(err.value)
    assert words in str(err.value)


def test_run_manifest_is_written_once(tmp_path):
    checkpoint.write_run_manifest(str(tmp_path / "run"), {"model": "first"})
    checkpoint.write_run_manifest(str(tmp_path / "run"), {"model": "second"})  # a retry
    assert json.loads((tmp_path / "run" / checkpoint.RUN_MANIFEST).read_text()) == {
        "format": checkpoint.RUN_FORMAT, "model": "first"}


def test_architecture_mismatch_names_both_models():
    theirs = {"model": "builtin:tiny-llama", "architecture": {"class": "LlamaForCausalLM", "parameters": 10,
                                                              "shapes": "aaaa"}}
    ours = {"class": "LlamaForCausalLM", "parameters": 20, "shapes": "bbbb"}
    checkpoint.check_architecture("/ckpt/run", theirs, theirs["architecture"], "builtin:tiny-llama")
    with pytest.raises(checkpoint.ResumeError) as err:
        checkpoint.check_architecture("/ckpt/run", theirs, ours, "/models/other")
    msg = str(err.value)
    assert msg.startswith("spec.checkpoint.resumeFrom: /ckpt/run was written for a different model architecture")
    assert "10 parameters" in msg and "20 parameters" in msg and "/models/other" in msg


# ---- gs:// against a real GCS API (fake-gcs-server) and the GKE metadata server's token path ------
# tests/gcs_fixtures.py: `gcs` is a fresh bucket, this process's GCS client pointed at the stand-ins.

FAIL_FAST_S = 30   # "in seconds": the probe's retries are bounded (storage.PROBE_RETRY_LIMIT_S)


def _jwt(claims: dict) -> str:
    def part(obj) -> str:
        return base64.urlsafe_b64encode(json.dumps(obj).encode()).decode().rstrip("=")
    return f"{part({'alg': 'RS256'})}.{part(claims)}.c2ln"


@pytest.fixture
def pod_token(tmp_path, monkeypatch):
    """A mounted projected service-account token for ns-a/trainer, as the kubelet writes it."""
    sa_dir = tmp_path / "serviceaccount"
    sa_dir.mkdir()
    (sa_dir / "token").write_text(_jwt({"iss": "https://kubernetes.default.svc", "sub": "system:serviceaccount:ns-a:trainer",
                                        "kubernetes.io": {"namespace": "ns-a", "serviceaccount": {"name": "trainer"}}}))
    monkeypatch.setattr(storage, "SA_DIR", str(sa_dir))
    return sa_dir


def test_check_writable_on_gcs_uses_the_metadata_token_and_leaves_nothing(gcs):
    checkpoint.check_writable(gcs.path("ns-demo-uid-a"))
    assert gcs.metadata.identity.tokens_served   # Workload Identity's path: the token came from the metadata server
    assert not list(gcs.local().rglob(".tpuft-write-probe"))


def _refused(uri: str) -> tuple[str, float]:
    start = time.monotonic()
    with pytest.raises(checkpoint.StorageError) as err:
        checkpoint.check_writable(uri)
    return str(err.value), time.monotonic() - start


def test_no_credentials_fails_fast_naming_bucket_pod_and_the_grant(gcs, pod_token):
    gcs.metadata.identity.grant = False   # the metadata server gives this pod no token
    msg, took = _refused(gcs.path("run"))
    assert took < FAIL_FAST_S, took
    assert f"checkpoint storage path {gcs.path('run')} is not writable" in msg and "no credentials" in msg
    assert "OAuth2 access token" in msg   # the storage client's own words
    assert "Kubernetes service account ns-a/trainer" in msg and str(pod_token) in msg
    assert (f"grant roles/storage.objectUser on bucket {gcs.name} to principal://iam.googleapis.com/projects/"
            "123456789012/locations/global/workloadIdentityPools/tpuft-local.svc.id.goog/subject/ns/ns-a/sa/trainer") in msg
    assert "Workload Identity Federation for GKE" in msg and "spec.checkpoint.storagePath" in msg


def test_a_missing_bucket_fails_fast_naming_it(gcs, pod_token):
    msg, took = _refused("gs://tpuft-no-such-bucket/run")
    assert took < FAIL_FAST_S, took
    assert "bucket not found" in msg and "bucket tpuft-no-such-bucket does not exist" in msg
    assert "gcloud storage buckets create gs://tpuft-no-such-bucket" in msg


def test_permission_denied_names_the_grant_with_placeholders_when_the_project_is_unknown():
    # fake-gcs-server has no IAM: the Google client's words for a 403, as GCS answers them
    error = ("OSError: google::cloud::Status(PERMISSION_DENIED: Permanent error, with a last message of "
             "trainer@p.iam does not have storage.objects.create access to the Google Cloud Storage object. "
             "[http_status_code=403] error_info={reason=forbidden})")
    pod = storage.PodIdentity("ns-a", "trainer", "its token")
    msg = storage.explain("gs://bkt/run", "writing", error, pod, storage.Project(None, None))
    assert msg.startswith("writing gs://bkt/run failed: permission denied (the storage said: ") and "error_info" not in msg
    assert ("grant roles/storage.objectUser on bucket bkt to principal://iam.googleapis.com/projects/PROJECT_NUMBER/"
            "locations/global/workloadIdentityPools/PROJECT_ID.svc.id.goog/subject/ns/ns-a/sa/trainer") in msg


def test_the_pod_identity_comes_from_its_token_then_from_the_env(tmp_path):
    legacy = _jwt({"kubernetes.io/serviceaccount/namespace": "ns-b",
                   "kubernetes.io/serviceaccount/service-account.name": "old"})
    assert storage.identity_from_token(legacy) == ("ns-b", "old")
    assert storage.identity_from_token("not-a-jwt") == (None, None)
    env = {storage.ENV_SERVICE_ACCOUNT: "trainer", storage.ENV_NAMESPACE: "ns-c"}
    assert storage.who_am_i(str(tmp_path), env) == storage.PodIdentity("ns-c", "trainer", "$TPUFT_SERVICE_ACCOUNT")
    unknown = storage.who_am_i(str(tmp_path), {})
    assert unknown.service_account is None and str(tmp_path) in unknown.source
    msg = storage.explain("gs://b/r", "writing", "UNAUTHENTICATED", unknown, storage.Project("p", "1"))
    assert "Kubernetes service account is unknown" in msg and "/subject/ns/NAMESPACE/sa/KSA_NAME" in msg


def test_a_missing_object_says_not_found_with_its_uri(gcs):
    with pytest.raises(FileNotFoundError, match=f"^{gcs.path('missing.jsonl')} not found$"):
        checkpoint.read_json(gcs.path("missing.jsonl"))
    with pytest.raises(FileNotFoundError, match=f"^{gcs.path('models', 'gone')} not found$"):
        checkpoint.download_dir(gcs.path("models", "gone"), "/nonexistent-never-created")


# ---- datasets on gs://: JSONL and Parquet, sliced splits through the same client --------------------

RECORDS = [{"instruction": f"q{i}", "response": f"a{i}"} for i in range(10)]


@pytest.mark.parametrize("fmt", ["json", "parquet"])
def test_a_sliced_split_reads_from_the_bucket(gcs, fmt):
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    from tpuft_workload import pipeline

    if fmt == "json":
        data, name = "".join(json.dumps(r) + "\n" for r in RECORDS).encode(), "train.jsonl"
    else:
        buf = io.BytesIO()
        pq.write_table(pa.Table.from_pylist(RECORDS), buf)
        data, name = buf.getvalue(), "train.parquet"
    checkpoint.write_bytes(gcs.path("data", name), data)
    src = pipeline.resolve(gcs.path("data", name))
    assert pipeline.remote_table(src, "train[:3]").to_pylist() == RECORDS[:3]
    assert pipeline.remote_table(src, "train[50%:]").to_pylist() == RECORDS[5:]
    assert pipeline.remote_table(src, "train").to_pylist() == RECORDS


def test_a_missing_dataset_file_says_not_found(gcs):
    from tpuft_workload import pipeline

    with pytest.raises(pipeline.DataError, match=f"^spec.dataset.name: dataset file {gcs.path('nope.jsonl')} not found"):
        pipeline._read(pipeline.resolve(gcs.path("nope.jsonl")), "train[:5]")


# ---- checkpoints on gs://: uploaded, COMMITTED, found, downloaded -------------------------------------

def test_a_checkpoint_round_trips_through_the_bucket_with_its_commit_marker(gcs, tmp_path):
    run = gcs.path("ns-demo-uid-a")
    checkpoint.write_run_manifest(run, {"model": "builtin:tiny-llama", "architecture": {"class": "X"}})
    for step, commit in ((10, True), (20, False)):   # step 20's save never finished
        local = tmp_path / f"s{step}"
        (local / "sub").mkdir(parents=True)
        (local / checkpoint.TRAIN_STATE).write_text(json.dumps({"step": step}))
        (local / "sub" / "__0_0.distcp").write_bytes(os.urandom(1024))
        checkpoint.upload_dir(str(local), checkpoint.join(run, f"checkpoint_step_{step:07d}"))
        if commit:
            checkpoint.mark_committed(checkpoint.join(run, f"checkpoint_step_{step:07d}"))
    newest = checkpoint.join(run, "checkpoint_step_0000010")
    assert checkpoint.find_latest_committed(run) == newest
    assert checkpoint.resolve_resume(run)[0] == newest
    checkpoint.download_dir(newest, str(tmp_path / "back"))
    assert (tmp_path / "back" / "sub" / "__0_0.distcp").read_bytes() == (tmp_path / "s10" / "sub" / "__0_0.distcp").read_bytes()
    assert gcs.local("ns-demo-uid-a", "checkpoint_step_0000010", checkpoint.COMMITTED).read_text() == "ok\n"


def test_an_orbax_checkpoint_round_trips_through_the_bucket(gcs, tmp_path, monkeypatch):
    import jax.numpy as jnp
    import numpy as np

    from tpuft_workload import jax_checkpoint

    monkeypatch.setattr(jax_checkpoint, "STAGING_ROOT", tmp_path / "staging")
    state = {"params": {"w": jnp.arange(12, dtype=jnp.float32).reshape(3, 4)}, "opt_state": {"mu": jnp.ones(4)}}
    directory = gcs.path("run", "checkpoint_step_0000004")
    jax_checkpoint.save(state, {"step": 4}, directory, rank=0)
    checkpoint.mark_committed(directory)
    assert checkpoint.find_latest_committed(gcs.path("run")) == directory
    assert gcs.local("run", "checkpoint_step_0000004", "state").is_dir()
    restored, train_state = jax_checkpoint.load(jax_checkpoint.abstract(state), directory)
    assert train_state == {"step": 4}
    np.testing.assert_array_equal(restored["params"]["w"], state["params"]["w"])
    np.testing.assert_array_equal(restored["opt_state"]["mu"], state["opt_state"]["mu"])
    with pytest.raises(FileNotFoundError, match="has no state/"):
        jax_checkpoint.load(jax_checkpoint.abstract(state), gcs.path("run", "checkpoint_step_0000009"))


def test_jax_refuses_gs_checkpoints_across_hosts_before_its_first_step(tmp_path):
    """Orbax stages a gs:// checkpoint on one host: JAX processes on several hosts are refused at
    start (naming the path, the count and what to use instead), not at the first checkpoint."""
    from tpuft_workload import jax_checkpoint
    from tpuft_workload.checkpoint import StorageError

    with pytest.raises(StorageError) as refused:
        jax_checkpoint.check_hosts("gs://bucket/runs/a", ["worker-0", "worker-1", "worker-0", "worker-1"])
    assert "gs://bucket/runs/a" in str(refused.value) and "4 JAX processes are on 2 hosts" in str(refused.value)
    assert "spec.checkpoint.storagePath" in str(refused.value)
    jax_checkpoint.check_hosts("gs://bucket/runs/a", ["worker-0", "worker-0"])   # one host: staged there
    jax_checkpoint.check_hosts(str(tmp_path), ["worker-0", "worker-1"])          # a volume every host mounts


# ---- nothing lost: the driver's log and TensorBoard events reach the bucket while the run goes ---------

def test_a_driver_killed_outright_leaves_its_log_in_the_bucket(gcs):
    log_uri = gcs.path("run", "logs", "train.log")
    script = textwrap.dedent(f"""
        import time
        from tpuft_workload import driver_log
        with driver_log.tee({log_uri!r}, "train", upload_every_s=0.5):
            print("step 1 done", flush=True)
            time.sleep(120)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], env={**os.environ, **gcs.env},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            text = gcs.local("run", "logs", "train.log").read_text() if gcs.local("run", "logs", "train.log").exists() else ""
            if "step 1 done" in text:
                break
            time.sleep(0.2)
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        os.kill(proc.pid, signal.SIGKILL)   # no exit handler runs
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    text = checkpoint.read_bytes(log_uri).decode()
    assert "[tpuft] train driver started" in text and "step 1 done" in text


def test_a_driver_whose_bucket_cannot_be_reached_ends_at_once_its_log_kept_on_the_host(gcs, monkeypatch):
    """No metadata server (nothing listens where GCE_METADATA_ROOT points): the log's first read
    gives up within the probe's bound, nothing more is tried, and the driver's block ends at once
    instead of waiting out one retry window per upload (it once held a failed verification 199 s)."""
    from tpuft_workload import driver_log

    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        monkeypatch.setenv("GCE_METADATA_ROOT", f"127.0.0.1:{closed.getsockname()[1]}")
    start = time.monotonic()
    with driver_log.tee(gcs.path("run", "logs", "verify.log"), "verify", upload_every_s=0.5):
        print("storage probe failed", flush=True)
        time.sleep(1.5)   # past a few upload intervals
    seconds = time.monotonic() - start
    assert seconds < 3 * driver_log.LOG_RETRY_LIMIT_S + 5, seconds
    assert not gcs.local("run", "logs", "verify.log").exists()


def test_tensorboard_events_reach_the_bucket_between_checkpoints(gcs):
    from tpuft_workload.metrics_log import TensorBoard

    now = [0.0]
    board = TensorBoard(gcs.path("run"), enabled=True, sync_every_s=60, clock=lambda: now[0])
    board.add(1, {"loss": 2.0}, 1e-3)
    assert not gcs.local("run", "tensorboard").exists()   # inside the window: kept locally
    now[0] = 61.0
    board.add(2, {"loss": 1.5}, 1e-3)
    uploaded = list(gcs.local("run", "tensorboard").iterdir())
    assert len(uploaded) == 1 and uploaded[0].stat().st_size > 0
    board.close()
