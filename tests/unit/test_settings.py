"""tpuft.controller.settings: every runtime knob is one Settings field and one TPUFT_ variable, read at
startup; docs/reference/settings.md's table is generated from the fields."""
from __future__ import annotations

import ast
import dataclasses
import re

import pytest

from tests.paths import REPO
from tpuft.controller.observed import Tunables
from tpuft.controller.settings import Settings, SettingsError, env_name, environment_table

OPERATOR = REPO / "operator" / "tpuft"


def test_defaults_without_the_environment():
    assert Settings.from_env({}) == Settings()
    assert Settings().tunables() == Tunables()   # the decision's defaults are the settings' defaults


def test_each_field_from_its_variable():
    s = Settings.from_env({"TPUFT_RESYNC_SECONDS": "1", "TPUFT_WORKERS": "16", "TPUFT_VERIFY_GRACE_SECONDS": "0.5",
                           "TPUFT_RAYJOB_GRACE_SECONDS": "5", "TPUFT_RESUBMIT_BACKOFF_SECONDS": "3",
                           "TPUFT_POD_LIST_SECONDS": "1", "TPUFT_API_TIMEOUT_SECONDS": "7.5",
                           "TPUFT_METRICS_PORT": "0", "TPUFT_LOG_LEVEL": "debug", "TPUFT_UNRELATED": "x"})
    assert s == Settings(resync_seconds=1.0, workers=16, verify_grace_seconds=0.5, rayjob_grace_seconds=5.0,
                         resubmit_backoff_seconds=3.0, pod_list_seconds=1.0, api_timeout_seconds=7.5,
                         metrics_port=0, log_level="DEBUG")
    assert s.tunables() == Tunables(verify_grace_seconds=0.5, rayjob_grace_seconds=5.0, resubmit_backoff_seconds=3.0)
    assert Settings.from_env({"TPUFT_WORKERS": "", "TPUFT_LOG_LEVEL": " "}) == Settings()   # empty: the default


def test_from_the_process_environment(monkeypatch):
    monkeypatch.setenv("TPUFT_RAYJOB_GRACE_SECONDS", "5")
    monkeypatch.delenv("TPUFT_VERIFY_GRACE_SECONDS", raising=False)
    assert Settings.from_env().tunables() == Tunables(rayjob_grace_seconds=5.0)


@pytest.mark.parametrize("var,value", [("TPUFT_WORKERS", "4.5"), ("TPUFT_RESYNC_SECONDS", "5s"),
                                       ("TPUFT_METRICS_PORT", "http")])
def test_a_bad_value_is_refused_naming_its_variable(var, value):
    with pytest.raises(SettingsError, match=f"^{var}='{value}': not .* unset it for the default"):
        Settings.from_env({var: value})


def test_settings_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        Settings().workers = 8


def test_the_docstring_lists_every_variable():
    for f in dataclasses.fields(Settings):
        assert f"{env_name(f)} (" in Settings.__doc__ and f.metadata["help"] in Settings.__doc__


def test_the_docs_table_is_generated_from_the_fields():
    page = (REPO / "docs" / "reference" / "settings.md").read_text()
    assert environment_table() in page, "docs/reference/settings.md's table of TPUFT_ variables is stale: paste " \
                                        "`.venv/bin/python -m tpuft.controller.settings` over it"


def test_the_environment_is_read_only_in_tpuft_settings():
    """No other operator module reads a TPUFT_ variable (the CLI's TPUFT_KUBECTL aside, in
    tpuft.cli.kubectl only: the user's machine, not the operator)."""
    readers = {}
    for path in sorted(OPERATOR.rglob("*.py")):
        if path.name in ("settings.py", "kubectl.py"):
            continue
        names = set(re.findall(r"\bTPUFT_[A-Z_]+", path.read_text()))
        env = {n for n in names if n in {env_name(f) for f in dataclasses.fields(Settings)}}
        calls = [n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Attribute) and n.attr == "environ"]
        if env and calls:
            readers[path.name] = sorted(env)
    assert readers == {}, f"read these through tpuft.controller.settings.Settings instead: {readers}"
