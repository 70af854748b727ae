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
