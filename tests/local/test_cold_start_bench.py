"""bench/cold_start.py reads its stages off the lines `make demo` prints: the Go builds' lines come
from tpuft_local.toolchain itself here, so a changed wording there fails this test, not a cold run
25 minutes in."""
from __future__ import annotations

import importlib.util
import io
import sys
from contextlib import redirect_stderr

from tests.paths import REPO
from tpuft_local import toolchain


def _bench():
    spec = importlib.util.spec_from_file_location("cold_start", REPO / "bench" / "cold_start.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["cold_start"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def _toolchain_lines(tmp_path) -> list[str]:
    err = io.StringIO()
    with redirect_stderr(err):
        toolchain._run_logged(["true"], "kube-apiserver, kubectl v1.35.3", tmp_path / "build.log", tmp_path, {})
    return err.getvalue().splitlines()


def test_the_stages_are_read_off_what_make_demo_prints(tmp_path):
    bench = _bench()
    go_begin, go_end = _toolchain_lines(tmp_path)
    printed = [
        (1.0, "[tpuft] installing Debian packages: buildah debootstrap (apt-get; recorded for `tpuft cluster down`)"),
        (3.0, "[venv] installing the dependencies of .[workload,jax,local,test] into /c/venvs/venv-0cc0 (once per machine)"),
        (61.0, "[tpuft] installed Debian packages in 60 s"),
        (98.0, "[venv] installed the dependencies of .[workload,jax,local,test] in 98 s"),
        (104.0, "[   0.0s] [1/3] local cluster (tpuft cluster up) in /r/.tpuft/cluster: real node, KubeRay"),
        (105.0, go_begin),
        (105.5, "[tpuft] base: building localhost/tpuft/python:3.11-bookworm (inputs 0123456789ab not in the cache)"),
        (356.0, "[tpuft] base: localhost/tpuft/python:3.11-bookworm 180.2 MB in 250 s"),
        (357.0, "[tpuft] workload: building docker.io/tpufinetune/workload:local (inputs bcf4f6fcfd3d not in the cache)"),
        (466.0, go_end),
        (900.0, "[tpuft] workload: docker.io/tpufinetune/workload:local 6883.0 MB in 543 s"),
        (1000.0, "[tpuft] workload: docker.io/tpufinetune/workload:local 6883.0 MB, built, 643.0 s"),
        (1010.0, "[tpuft] imported docker.io/tpufinetune/workload:local into the node's containerd"),
        (1060.0, "[tpuft] cluster up in 956 s; kubeconfig: /r/.tpuft/cluster/kubeconfig"),
        (1061.0, "[ 956.1s] [2/3] kubectl apply -f /c/examples/local-cpu.yaml (namespace tpuft-demo)"),
        (1190.0, "done"),
    ]
    stages = {stage.name: (stage.start_s, stage.end_s) for stage in bench.stages_of(printed)}
    assert stages == {
        "make venv + prepare (side by side)": (0.0, 104.0),
        "cluster up": (104.0, 1061.0),
        "Debian packages (apt)": (1.0, 61.0),
        "venv: dependencies (pip)": (3.0, 98.0),
        "go: kube-apiserver, kubectl v1.35.3": (105.0, 466.0),
        "image: base": (105.5, 356.0),
        "image: workload": (357.0, 900.0),
        "image export: workload": (900.0, 1000.0),
        "containerd import: docker.io/tpufinetune/workload:local": (1010.0, 1010.0),
        "demo (apply to answers)": (1061.0, 1190.0),
    }
