"""`tpuft topology|validate|render` as a user runs them: JSON out, exit 2 and one line per problem."""
import json
import subprocess
import sys

import yaml

from tests.paths import EXAMPLES, REPO


def tpuft(*args, stdin=None):
    return subprocess.run([sys.executable, "-m", "tpuft.cli", *args], capture_output=True, text=True,
                          input=stdin, cwd=REPO, timeout=120)


def test_topology_prints_slice_facts():
    r = tpuft("topology", "--accelerator", "TPU-V7X", "--topology", "2x2x2")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert {k: out[k] for k in ("generation", "hosts", "chipsPerHost", "devicesPerHost", "devices",
                                "machineType", "rayAcceleratorType", "tpuResourcePerChip")} == {
        "generation": "tpu7x", "hosts": 2, "chipsPerHost": 4, "devicesPerHost": 8, "devices": 16,
        "machineType": "tpu7x-standard-4t", "rayAcceleratorType": "TPU-V7X", "tpuResourcePerChip": 2}
    assert out["nodeSelector"] == {"cloud.google.com/gke-tpu-accelerator": "tpu7x",
                                   "cloud.google.com/gke-tpu-topology": "2x2x2"}


def test_topology_bad_input_is_one_line_exit_2():
    r = tpuft("topology", "--accelerator", "v6e", "--topology", "2x2x2")
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    assert "--topology" in r.stderr and "4x4" in r.stderr


def test_validate_lists_every_problem_by_field_path(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"apiVersion": "tpufinetune.dev/v1alpha1", "kind": "TPUFinetune",
                                   "metadata": {"name": "x"},
                                   "spec": {"accelerator": "v6e", "topology": "2x2x2", "model": "m",
                                            "dataset": {"name": "d"}, "checkpoint": {"storagePath": "nope"}}}))
    r = tpuft("validate", str(bad))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "spec.topology" in r.stderr and "spec.image: Required value" in r.stderr
    assert "spec.checkpoint.storagePath" in r.stderr


def test_validate_refuses_a_resume_from_without_a_scheme_the_workload_reads(tmp_path):
    doc = yaml.safe_load((EXAMPLES / "local-cpu.yaml").read_text())
    doc["spec"]["checkpoint"]["resumeFrom"] = "ftp://host/run"
    bad = tmp_path / "resume.yaml"
    bad.write_text(yaml.safe_dump(doc))
    r = tpuft("validate", str(bad))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "spec.checkpoint.resumeFrom: Invalid value: \"ftp://host/run\": must be gs://BUCKET/PATH" in r.stderr
    doc["spec"]["checkpoint"]["resumeFrom"] = "/tmp/tpuft-checkpoints/default-local-cpu-uid/checkpoint_step_0000099"
    bad.write_text(yaml.safe_dump(doc))
    assert tpuft("validate", str(bad)).returncode == 0


def test_validate_examples_and_unreadable_files():
    assert tpuft("validate", *map(str, sorted(EXAMPLES.glob("*.yaml")))).returncode == 0
    r = tpuft("validate", "/nonexistent.yaml")
    assert r.returncode == 2 and "cannot read" in r.stderr and "Traceback" not in r.stderr


def test_render_prints_raycluster_first_then_jobs():
    r = tpuft("render", str(EXAMPLES / "v6e-4x4.yaml"))
    assert r.returncode == 0, r.stderr
    kinds = [d["kind"] for d in yaml.safe_load_all(r.stdout)]
    assert kinds[:3] == ["RayCluster", "RayJob", "RayJob"]
    assert set(kinds[3:]) == {"ServiceAccount", "Role", "RoleBinding", "NetworkPolicy"}


def test_render_from_stdin_with_namespace():
    r = tpuft("render", "-", "-n", "team-a", stdin=(EXAMPLES / "local-cpu.yaml").read_text())
    assert r.returncode == 0, r.stderr
    assert {d["metadata"]["namespace"] for d in yaml.safe_load_all(r.stdout)} == {"team-a"}


def _validate_model(tmp_path, model: str, **spec):
    doc = yaml.safe_load((EXAMPLES / "v6e-4x4.yaml").read_text())
    doc["spec"]["model"] = model
    doc["spec"].update(spec)
    path = tmp_path / "model.yaml"
    path.write_text(yaml.safe_dump(doc))
    return tpuft("validate", str(path))


def test_validate_warns_when_a_known_model_cannot_fit_the_slice_naming_the_figure(tmp_path):
    r = _validate_model(tmp_path, "google/gemma-3-27b-it")   # full, on a v6e 4x4
    assert r.returncode == 0 and "valid (v6e 4x4" in r.stdout
    assert r.stderr.count("warning:") == 1, r.stderr
    assert ("warning: spec.model google/gemma-3-27b-it (27.0B parameters) needs about 27 GB of HBM per chip "
            "with method full on v6e 4x4, more than the 22.4 GB") in r.stderr
    assert "use method lora or a topology of at least 4x8" in r.stderr


def test_validate_names_the_pod_memory_a_merged_export_needs_and_reads_the_workers_memory(tmp_path):
    lora = {"training": {"method": "lora"}, "export": {"merge": True}}
    r = _validate_model(tmp_path, "meta-llama/Llama-3.1-70B-Instruct", **lora)
    assert r.returncode == 0
    assert r.stderr.count("warning:") == 1, r.stderr
    assert "needs about 267 GiB of memory in worker pod 0 at export with method lora on v6e 4x4, more than the " \
           "190 GiB a pod of 200 GiB may use (95%: past it Ray's memory monitor kills a worker): raise " \
           "spec.resources.worker.limits.memory to at least 282Gi" in r.stderr
    roomy = {**lora, "resources": {"worker": {"limits": {"memory": "300Gi"}}}}
    assert "warning" not in _validate_model(tmp_path, "meta-llama/Llama-3.1-70B-Instruct", **roomy).stderr
    # not merged: rank 0 gathers the adapters only
    r = _validate_model(tmp_path, "meta-llama/Llama-3.1-70B-Instruct", training={"method": "lora"})
    assert r.returncode == 0 and "warning" not in r.stderr, r.stderr


def test_validate_does_not_warn_for_a_model_that_fits_nor_for_one_it_does_not_know(tmp_path):
    for model in ("google/gemma-3-1b-it", "google/gemma-4-E2B-it", "gs://my-bucket/models/llama-70b"):
        r = _validate_model(tmp_path, model)
        assert r.returncode == 0 and "valid (v6e 4x4" in r.stdout, r.stderr
        assert r.stderr == "", (model, r.stderr)


def test_validate_refuses_an_eval_set_that_is_the_training_set_and_warns_where_it_cannot_tell(tmp_path):
    def manifest(dataset_split: str, eval_split: str):
        doc = yaml.safe_load((EXAMPLES / "local-cpu.yaml").read_text())
        doc["spec"]["dataset"]["split"] = dataset_split
        doc["spec"]["evaluation"] = {"split": eval_split}
        path = tmp_path / f"{len(list(tmp_path.iterdir()))}.yaml"
        path.write_text(yaml.safe_dump(doc))
        return path

    r = tpuft("validate", str(manifest("train", "train[-200:]")))
    assert r.returncode == 2 and "spec.evaluation.split: 'train[-200:]' reads records spec.dataset.split 'train' " \
                                  "trains on" in r.stderr and "use spec.dataset.split train[:-200]" in r.stderr
    r = tpuft("validate", str(manifest("train[:1000]", "train[-200:]")))
    assert r.returncode == 0 and "valid" in r.stdout
    assert "warning: spec.evaluation.split: 'train[-200:]' may read records" in r.stderr
    r = tpuft("validate", str(manifest("train[:-200]", "train[-200:]")))
    assert r.returncode == 0 and r.stderr == ""
