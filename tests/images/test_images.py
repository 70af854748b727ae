"""The images built from Dockerfile.operator and Dockerfile.workload (tpuft_local.images),
checked inside: what each holds, who it runs as, what it starts; and the cache.

The first session on a machine builds everything (cold: many minutes, mostly PyPI's torch);
later sessions reuse the cache, so the timeout below is for the cold case."""
from __future__ import annotations

import json
import os
import shutil
import signal
import struct
import subprocess
import tarfile
import time

import pytest
import yaml

from tests.images.dockerfile_lib import REPO, build_context, parse
from tpuft_local import images

pytestmark = pytest.mark.timeout(5400)
OPERATOR_DF = parse(REPO / "Dockerfile.operator")
NO_TORCH_AUTOLOAD = ["env", "TORCH_DEVICE_BACKEND_AUTOLOAD=0"]


def _ok(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 0, f"{proc.args} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def test_context_hash_sees_what_dockerignore_lets_through():
    """The cache key's file list is the build context (the independent matcher in dockerfile_lib)."""
    assert images.context_files(REPO) == sorted(build_context(REPO))


def test_images_carry_the_names_the_chart_and_example_use(built_images):
    chart = yaml.safe_load((REPO / "charts/tpufinetune-operator/Chart.yaml").read_text())
    values = yaml.safe_load((REPO / "charts/tpufinetune-operator/values.yaml").read_text())
    example = yaml.safe_load((REPO / "examples/local-cpu.yaml").read_text())
    expected = {
        "operator": f"{values['image']['repository']}:{values['image']['tag'] or chart['appVersion']}",
        "workload": "docker.io/" + example["spec"]["image"],  # containerd's normalized name
        "pause": "localhost/tpuft/pause:3.10",
    }
    assert {n: r.ref for n, r in built_images.items()} == expected
    for ref in built_images.values():
        with tarfile.open(ref.archive) as tar:
            manifest = json.load(tar.extractfile("manifest.json"))
        assert manifest[0]["RepoTags"] == [ref.ref], ref.archive
        assert ref.config_digest.startswith("sha256:")


def test_operator_image_has_no_torch_and_no_ray(built_images):
    ref = built_images["operator"].ref
    for mod in ("torch", "ray", "transformers"):
        proc = images.run_in_image(ref, ["python", "-c", f"import {mod}"])
        assert proc.returncode != 0 and "ModuleNotFoundError" in proc.stderr, f"{mod} importable in {ref}"
    # not even a leftover directory in any site-packages
    listing = _ok(images.run_in_image(ref, ["python", "-c", "import site, os; print('\\n'.join("
                                            "n for d in site.getsitepackages() if os.path.isdir(d) "
                                            "for n in os.listdir(d)))"]))
    names = {n.lower() for n in listing.split()}
    assert not {n for n in names if n.split("-")[0] in ("torch", "ray", "transformers", "datasets")}, names
    assert "kopf" in names and "tpuft" in names


def test_operator_image_runs_as_65532_and_its_entrypoint_is_kopf(built_images):
    ref = built_images["operator"].ref
    config = images.stored(ref).config
    assert config["User"] == "65532:65532"
    assert config["Entrypoint"] == OPERATOR_DF.final.all("ENTRYPOINT")[-1].json_args
    assert config["Entrypoint"][:3] == ["kopf", "run", "--standalone"]
    assert config["Cmd"] == ["--all-namespaces"]
    assert _ok(images.run_in_image(ref, ["id", "-u"])).strip() == "65532"
    # the ENTRYPOINT's program and module, as that user
    _ok(images.run_in_image(ref, ["python", "-c", "import kopf, kubernetes, yaml, tpuft.controller.handlers"]))
    out = _ok(images.run_in_image(ref, ["kopf", "run", "--help"]))
    assert "--standalone" in out and "--liveness" in out


def test_workload_image_imports_ray_transformers_and_the_workload(built_images):
    ref = built_images["workload"].ref
    out = _ok(images.run_in_image(ref, [*NO_TORCH_AUTOLOAD, "python", "-c",
                                        "import ray, transformers, datasets, tpuft_workload, tpuft.api.catalog; "
                                        "print(ray.__version__, transformers.__version__)"]))
    ray_version, transformers_version = out.split()
    assert ray_version.startswith("2.60.") and transformers_version.startswith("5.")
    # KubeRay's probes on Ray pods shell out to wget
    _ok(images.run_in_image(ref, ["wget", "--version"]))
    # torch came from TORCH_SPEC (the CPU base has none) and nothing replaced it
    freeze = _ok(images.run_in_image(ref, ["python", "-m", "pip", "list", "--format=freeze"]))
    assert any(line.lower().startswith("torch==2.13.") for line in freeze.splitlines()), freeze


def test_pause_image_is_a_static_binary_that_stops_on_sigterm(built_images, tmp_path):
    ref = built_images["pause"].ref
    config = images.stored(ref).config
    assert config["Entrypoint"] == ["/pause"] and config["User"] == "65535:65535"
    binary = tmp_path / "pause"
    with tarfile.open(built_images["pause"].archive) as tar:
        manifest = json.load(tar.extractfile("manifest.json"))
        (layer,) = manifest[0]["Layers"]
        with tarfile.open(fileobj=tar.extractfile(layer)) as inner:
            binary.write_bytes(inner.extractfile("pause").read())
    binary.chmod(0o755)
    data = binary.read_bytes()
    assert data[:4] == b"\x7fELF" and len(data) < 1_500_000
    # static: no program header asks for a dynamic loader (PT_INTERP = 3)
    phoff, (phentsize, phnum) = struct.unpack_from("<Q", data, 0x20)[0], struct.unpack_from("<HH", data, 0x36)
    types = [struct.unpack_from("<I", data, phoff + i * phentsize)[0] for i in range(phnum)]
    assert 3 not in types, "dynamically linked"
    assert subprocess.run([binary, "-v"], capture_output=True, text=True).stdout.startswith("tpuft-pause")
    for sig in (signal.SIGTERM, signal.SIGINT):
        proc = subprocess.Popen([binary])
        time.sleep(0.3)
        assert proc.poll() is None, "sleeps until signalled"
        proc.send_signal(sig)
        assert proc.wait(timeout=5) == 0


def test_second_ensure_images_rebuilds_nothing(built_images):
    start = time.monotonic()
    again = images.ensure_images(progress=lambda _msg: None)
    assert {n: r.image_id for n, r in again.items()} == {n: r.image_id for n, r in built_images.items()}
    assert not any(r.built for r in again.values())
    assert {n: r.archive.stat().st_mtime for n, r in again.items()} == \
        {n: r.archive.stat().st_mtime for n, r in built_images.items()}, "archives not rewritten"
    assert time.monotonic() - start < 120


@pytest.fixture
def private_containerd(tmp_path):
    """A containerd of the test's own (own root, state and socket; no CRI plugin, so no
    networking): the import path exactly as the node's containerd runs it."""
    if not (shutil.which("containerd") and shutil.which("ctr")):
        pytest.skip("containerd is not installed (`apt-get install containerd`)")
    if os.geteuid() != 0:
        pytest.skip("containerd needs root")
    sock = tmp_path / "c.sock"
    (tmp_path / "config.toml").write_text(
        f'version = 2\nroot = "{tmp_path}/root"\nstate = "{tmp_path}/state"\n'
        'disabled_plugins = ["io.containerd.grpc.v1.cri"]\n'
        f'[grpc]\n  address = "{sock}"\n[ttrpc]\n  address = "{sock}.ttrpc"\n'
        f'[debug]\n  address = "{tmp_path}/debug.sock"\n[metrics]\n  address = ""\n')
    with open(tmp_path / "containerd.log", "w") as log:
        proc = subprocess.Popen(["containerd", "--config", str(tmp_path / "config.toml")], stdout=log,
                                stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while subprocess.run(["ctr", "-a", str(sock), "version"], capture_output=True).returncode != 0:
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "containerd.log").read_text()
            time.sleep(0.2)
        yield str(sock)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        images._unmount_under(tmp_path)


def test_load_into_containerd_imports_only_what_it_lacks(built_images, private_containerd):
    pause = built_images["pause"]
    assert images.containerd_config_digest(pause.ref, private_containerd) is None
    assert images.load_into_containerd(pause, private_containerd) is True
    assert images.containerd_config_digest(pause.ref, private_containerd) == pause.config_digest
    assert images.load_into_containerd(pause, private_containerd) is False, "same content: no second import"
    listed = subprocess.run(["ctr", "-a", private_containerd, "-n", "k8s.io", "images", "ls", "-q"],
                            capture_output=True, text=True).stdout.split()
    assert listed == [pause.ref]
