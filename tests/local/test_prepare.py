"""`make demo`'s `prepare` (beside `make venv`): the Debian packages first (buildah and debootstrap build
the images), then what `tpuft cluster up` would build, Argo CD aside, with everything as it would."""
from __future__ import annotations

import threading

from tpuft_local import host, images, prepare, toolchain


def test_packages_first_then_every_tool_but_argocd_beside_every_image(monkeypatch, tmp_path):
    monkeypatch.setenv("TPUFT_HOME", str(tmp_path))
    calls, image_started, tools_done = [], threading.Event(), threading.Event()
    monkeypatch.setattr(host, "require_root", lambda: None)
    monkeypatch.setattr(host, "ensure_packages", lambda journal: calls.append(("packages", journal.path)))

    def ensure_images(names=tuple(images.Image), progress=print):
        calls.append(("images", tuple(names)))
        image_started.set()
        assert tools_done.wait(5), "the images waited for the tools: they build side by side"

    def ensure_tools(tools):
        assert image_started.wait(5), "the tools waited for the images: they build side by side"
        calls.append(("tools", tuple(tools)))
        tools_done.set()

    monkeypatch.setattr(images, "ensure_images", ensure_images)
    monkeypatch.setattr(toolchain, "ensure_tools", ensure_tools)
    assert prepare.main() == 0
    assert calls[0] == ("packages", tmp_path / "cluster" / "host-changes.json")   # the journal `down` reads
    assert set(calls[1:]) == {("images", tuple(images.Image)),
                              ("tools", tuple(t for t in toolchain.TOOLS if t != "argocd-local"))}


def test_a_failed_build_is_one_line_and_exit_1(monkeypatch, capsys):
    monkeypatch.setattr(host, "require_root", lambda: None)
    monkeypatch.setattr(host, "ensure_packages", lambda journal: None)
    monkeypatch.setattr(images, "ensure_images", lambda **kw: None)

    def fail(tools):
        raise toolchain.ToolchainError("`go` is not on PATH")
    monkeypatch.setattr(toolchain, "ensure_tools", fail)
    assert prepare.main() == 1
    assert "[tpuft] error: `go` is not on PATH" in capsys.readouterr().err
