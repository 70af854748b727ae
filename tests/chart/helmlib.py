"""Shared helpers for tests/chart."""
from __future__ import annotations

import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "tpufinetune-operator"
RELEASE = "tpuft"
RELEASE_NAMESPACE = "tpuft-system"


def run_helm(helm: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([helm, *args], capture_output=True, text=True, timeout=120)
    if check and proc.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


class Rendered(list):
    """The objects `helm template` printed, with lookups by kind/name."""

    def kinds(self, kind: str) -> list[dict]:
        return [o for o in self if o["kind"] == kind]

    def one(self, kind: str, name: str | None = None, namespace: str | None = None) -> dict:
        found = [
            o for o in self.kinds(kind)
            if (name is None or o["metadata"]["name"] == name)
            and (namespace is None or o["metadata"].get("namespace") == namespace)
        ]
        assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}: {[o['metadata'] for o in found]}"
        return found[0]

    @property
    def deployment(self) -> dict:
        return self.one("Deployment")

    @property
    def container(self) -> dict:
        containers = self.deployment["spec"]["template"]["spec"]["containers"]
        assert len(containers) == 1
        return containers[0]


def rbac_rules(objs: Rendered) -> dict[tuple[str, str, str], list[dict]]:
    """{(kind, name, namespace-or-''): rules} for every Role and ClusterRole rendered."""
    return {
        (o["kind"], o["metadata"]["name"], o["metadata"].get("namespace", "")): o["rules"]
        for o in objs
        if o["kind"] in ("Role", "ClusterRole")
    }


# --- Argo CD health check -----------------------------------------------------------------
HEALTH_LUA = CHART / "argocd" / "health.lua"


def run_health(obj: dict) -> dict:
    """Evaluate argocd/health.lua the way Argo CD does (gopher-lua is Lua 5.1: lupa's lua51):
    `obj` is a global holding the resource, the chunk returns the health table."""
    import json

    try:
        from lupa import lua51 as lua_impl
    except ImportError:  # a lupa build without Lua 5.1: the script uses nothing newer
        import lupa as lua_impl
    lua = lua_impl.LuaRuntime(unpack_returned_tuples=True)
    # Through JSON, as Argo CD sees the object (timestamps are strings, ints are numbers).
    lua.globals().obj = lua.table_from(json.loads(json.dumps(obj, default=str)), recursive=True)
    hs = lua.execute(HEALTH_LUA.read_text())
    return dict(hs.items())
