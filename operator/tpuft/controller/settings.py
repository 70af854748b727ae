"""The operator's runtime settings: read from the environment once, at startup (`Settings.from_env`
in handlers.startup), and passed to what needs them. Nothing reads them at import time (but
watch_nodes, which decides which watches kopf starts, when tpuft.controller.handlers is imported), so a test
(or a second operator in one process) sets the environment before it starts the operator.

Each field is one variable, TPUFT_ and the field's name in capitals; unset or empty means the default.
The Settings docstring and the docs' table (docs/reference/settings.md) are generated from the fields
(`python -m tpuft.controller.settings` prints the table; tests/unit/test_settings.py fails when the docs' copy is stale).
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Mapping

from tpuft.api import constants as c
from tpuft.api import kuberay
from tpuft.controller.observed import DEFAULT_VERIFY_GRACE_SECONDS, Tunables

ENV_PREFIX = "TPUFT_"


def _knob(default: Any, help: str) -> Any:
    return dataclasses.field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class Settings:
    resync_seconds: float = _knob(5.0, "every TPUFinetune is reconciled at least this often (sooner when a "
                                       "deadline asks)")
    workers: int = _knob(4, "reconciles run at once (never two for one object)")
    verify_grace_seconds: float = _knob(float(DEFAULT_VERIFY_GRACE_SECONDS),
                                        "how long past `verification.timeoutSeconds` a verification may run "
                                        "before it fails CollectiveTimeout")
    rayjob_grace_seconds: float = _knob(kuberay.RAYJOB_FINISH_GRACE_SECONDS,
                                        "how long KubeRay may take to finish a RayJob whose Ray job has ended "
                                        "(reason FinishingRayJob); past it the RayJob is deleted")
    resubmit_backoff_seconds: float = _knob(c.LOST_SUBMISSION_BACKOFF_SECONDS,
                                            "the wait before a lost RayJob's first resubmission (doubling for "
                                            "each later one)")
    pod_list_seconds: float = _knob(c.POD_LIST_INTERVAL_SECONDS,
                                    "how long one list of a coming-up slice's pods is reused")
    api_timeout_seconds: float = _knob(30.0, "the timeout of each Kubernetes API request the reconciler makes")
    metrics_port: int = _knob(9090, "the Prometheus endpoint's port (`/metrics`); 0 disables it")
    log_level: str = _knob("", "the `tpuft` loggers' level (DEBUG, INFO, WARNING, ...); unset: as kopf sets it")
    watch_nodes: int = _knob(1, "1: watch nodes (lost nodes and GKE maintenance notices under a slice; needs "
                                "list/watch on nodes, cluster-wide); 0: not (a namespaced install: the pods' own "
                                "Ready condition still shows a lost node). Read when tpuft.controller.handlers is imported")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        """The settings the environment (default: os.environ) asks for; a value that does not
        parse is refused naming its variable."""
        env = os.environ if environ is None else environ
        values = {}
        for f in dataclasses.fields(cls):
            raw = (env.get(env_name(f)) or "").strip()
            if raw:
                values[f.name] = _parse(f, raw)
        return cls(**values)

    def tunables(self) -> Tunables:
        """The part phases.decide reads."""
        return Tunables(verify_grace_seconds=self.verify_grace_seconds, rayjob_grace_seconds=self.rayjob_grace_seconds,
                        resubmit_backoff_seconds=self.resubmit_backoff_seconds)


class SettingsError(ValueError):
    """An environment variable's value does not parse."""


def env_name(f: dataclasses.Field) -> str:
    return ENV_PREFIX + f.name.upper()


_TYPES = {"float": float, "int": int, "str": str}   # the fields' annotations (strings: `from __future__`)


def _parse(f: dataclasses.Field, raw: str) -> Any:
    kind = _TYPES[str(f.type)]
    if kind is str:
        return raw.upper()
    try:
        return kind(raw)
    except ValueError:
        raise SettingsError(f"{env_name(f)}={raw!r}: not {'an integer' if kind is int else 'a number'}; "
                            f"set one like {_default(f)}, or unset it for the default") from None


def _default(f: dataclasses.Field) -> str:
    return f"{f.default:g}" if f.default != "" else "unset"


def environment_table() -> str:
    """docs/reference/settings.md's table of the variables (one row per Settings field)."""
    rows = [f"| `{env_name(f)}` | {_default(f)} | {f.metadata['help']} |" for f in dataclasses.fields(Settings)]
    return "\n".join(["| variable | default | what |", "|---|---|---|", *rows]) + "\n"


Settings.__doc__ = ("The operator's runtime settings; each from its environment variable (Settings.from_env):\n\n"
                    + "".join(f"    {env_name(f)} ({_default(f)}): {f.metadata['help']}\n"
                              for f in dataclasses.fields(Settings)))

if __name__ == "__main__":
    print(environment_table(), end="")
