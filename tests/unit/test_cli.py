"""tests for tpuft/cli.py: the operator image's `tpuft` offers only the in-cluster commands."""
from __future__ import annotations

import importlib.util

import pytest

from tpuft import cli


def test_without_tpuft_local_only_in_cluster_commands_exist(monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tpuft_local" else real(name, *a))
    # chat, logs and plot need only kubectl (plot: and matplotlib, the local extra)
    assert sorted(cli.available()) == ["chat", "logs", "plot", "render", "topology", "validate"]
    with pytest.raises(SystemExit) as e:
        cli.main(["cluster", "up"])
    assert e.value.code == 2
    assert "invalid choice: 'cluster'" in capsys.readouterr().err


def test_with_tpuft_local_the_laptop_commands_exist():
    assert {"cluster", "images", "demo"} <= set(cli.available())
