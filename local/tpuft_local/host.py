"""Every change the local cluster makes to the machine, recorded so `tpuft cluster down` undoes it.

What changes (and nothing else): Debian packages (containerd, runc, CNI plugins, iptables,
conntrack, and the image tools), sysctls (`net.ipv4.ip_forward`, and those the kubelet and
kube-proxy set themselves, restored afterwards), one bridge (`tpuft0`), one blackhole route
(the simulated nodes' pod IPs), one iptables chain (`TPUFT-GUARD`, jumped to first from INPUT
and FORWARD) and the mounts the kubelet makes under the cluster's state dir.

The guard chain is the network rule made concrete: a packet that enters from the bridge may go
to another pod on the bridge or to the host's own bridge address (API server, kubelet, CoreDNS,
webhook); everything else from the pods (the machine's interface network, its DNS resolver, the
internet) is dropped, and nothing from outside is forwarded into the bridge.

Each step is idempotent: `apply` again repairs what is missing; `undo` reverts what the journal
(`host-changes.json` in the state dir) says was changed, newest first.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

from tpuft_local.console import say
from tpuft_local.network import Network, check_free

GUARD_CHAIN = "TPUFT-GUARD"
# Debian packages the node needs; the first names the package, the second a file it installs.
PACKAGES = {
    "containerd": "/usr/bin/containerd", "runc": "/usr/sbin/runc",
    "containernetworking-plugins": "/usr/lib/cni/bridge", "iptables": "/usr/sbin/iptables",
    "conntrack": "/usr/sbin/conntrack", "buildah": "/usr/bin/buildah", "debootstrap": "/usr/sbin/debootstrap",
    "umoci": "/usr/bin/umoci",
}
# Sysctls the cluster needs (ours) and those the kubelet / kube-proxy set on start (theirs), so
# their old values are saved before they run and put back after.
SYSCTLS = {"net.ipv4.ip_forward": "1", "net.bridge.bridge-nf-call-iptables": "1"}
SET_BY_COMPONENTS = ("vm.overcommit_memory", "kernel.panic", "kernel.panic_on_oops",
                     "net.netfilter.nf_conntrack_max", "net.netfilter.nf_conntrack_tcp_timeout_established",
                     "net.netfilter.nf_conntrack_tcp_timeout_close_wait")
# Left behind by the kubelet, containerd and the CNI plugins (found by the feasibility probe).
LEFTOVER_CHAINS = (("filter", "KUBE-FIREWALL"), ("filter", "KUBE-KUBELET-CANARY"), ("mangle", "KUBE-KUBELET-CANARY"),
                   ("nat", "KUBE-KUBELET-CANARY"), ("mangle", "KUBE-IPTABLES-HINT"), ("nat", "KUBE-MARK-MASQ"),
                   ("nat", "KUBE-POSTROUTING"), ("mangle", "KUBE-PROXY-CANARY"), ("nat", "KUBE-PROXY-CANARY"),
                   ("filter", "KUBE-PROXY-CANARY"), ("filter", "KUBE-PROXY-FIREWALL"), ("filter", "KUBE-FORWARD"),
                   ("filter", "KUBE-SERVICES"), ("filter", "KUBE-EXTERNAL-SERVICES"), ("filter", "KUBE-NODEPORTS"),
                   ("nat", "KUBE-SERVICES"), ("nat", "KUBE-NODEPORTS"))
LEFTOVER_PATHS = ("/var/lib/kubelet/device-plugins", "/var/log/containers", "/var/log/pods", "/var/lib/cni/results",
                  "/var/lib/cni/networks/tpuft")


class HostError(RuntimeError):
    """A host change failed; the message names the command and its output."""


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    res = subprocess.run(cmd, capture_output=True, text=True)
    if check and res.returncode != 0:
        raise HostError(f"`{' '.join(cmd)}` failed ({res.returncode}): {res.stderr.strip() or res.stdout.strip()}")
    return res


def default_state_dir() -> Path:
    """Where the local cluster keeps its state, the journal of host changes among it."""
    return Path(os.environ.get("TPUFT_HOME") or Path.home() / ".tpuft") / "cluster"


def journal_path(state_dir: Path) -> Path:
    return state_dir / "host-changes.json"


@dataclasses.dataclass
class Journal:
    """What this project changed on the host, persisted after every change."""
    path: Path
    packages: list[str] = dataclasses.field(default_factory=list)
    sysctls: dict[str, str] = dataclasses.field(default_factory=dict)  # key -> value before us
    links: list[str] = dataclasses.field(default_factory=list)
    routes: list[str] = dataclasses.field(default_factory=list)
    chains: list[str] = dataclasses.field(default_factory=list)

    @classmethod
    def load(cls, path: Path) -> "Journal":
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            data = {}
        fields = {f.name for f in dataclasses.fields(cls)} - {"path"}
        return cls(path=path, **{k: v for k, v in data.items() if k in fields})

    def save(self) -> None:
        data = dataclasses.asdict(self)
        data.pop("path")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(data, indent=2) + "\n")


def require_root() -> None:
    if os.geteuid() != 0:
        raise HostError("the local cluster runs a real kubelet, containerd and iptables rules: run it as root")


# ----- packages ----------------------------------------------------------------------------------
def ensure_packages(journal: Journal, packages: dict[str, str] = PACKAGES) -> None:
    """Install the Debian packages of `packages` (package -> a file it installs) that are missing."""
    missing = [p for p, f in packages.items() if not Path(f).exists()]
    if not missing:
        return
    say(f"installing Debian packages: {' '.join(missing)} (apt-get; recorded for `tpuft cluster down`)")
    start = time.monotonic()
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for cmd in (["apt-get", "update", "-q"],
                ["apt-get", "install", "-y", "-q", "--no-install-recommends", *missing]):
        res = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if res.returncode != 0:
            raise HostError(f"`{' '.join(cmd)}` failed: {res.stderr.strip()[-800:]}")
    journal.packages = sorted(set(journal.packages) | set(missing))
    journal.save()
    say(f"installed Debian packages in {time.monotonic() - start:.0f} s")


# ----- sysctls -----------------------------------------------------------------------------------
def _sysctl_path(key: str) -> Path:
    return Path("/proc/sys") / key.replace(".", "/")


def read_sysctl(key: str) -> str | None:
    try:
        return _sysctl_path(key).read_text().strip()
    except OSError:
        return None


def save_sysctls(journal: Journal, keys) -> None:
    """Remember the current values of `keys` (once: the first value seen is the one restored)."""
    for key in keys:
        value = read_sysctl(key)
        if value is not None and key not in journal.sysctls:
            journal.sysctls[key] = value
    journal.save()


def set_sysctls(journal: Journal) -> None:
    save_sysctls(journal, list(SYSCTLS) + list(SET_BY_COMPONENTS))
    for key, value in SYSCTLS.items():
        if read_sysctl(key) != value:
            _sysctl_path(key).write_text(value)
            say(f"sysctl {key}={value} (was {journal.sysctls.get(key)})")


# ----- bridge, route, guard rules ----------------------------------------------------------------
def ensure_bridge(journal: Journal, net: Network) -> None:
    exists = _run("ip", "link", "show", net.bridge, check=False).returncode == 0
    if exists and net.bridge not in journal.links:
        # Not ours (another state dir's cluster, or something else): never adopt it, since
        # our `down` would then remove what another owner still uses.
        raise HostError(f"the bridge {net.bridge} exists but this cluster ({journal.path.parent}) did not create it: "
                        "another local cluster runs (stop it with `tpuft cluster down --state-dir ...`), "
                        f"or remove it with `ip link del {net.bridge}` if nothing uses it")
    if not exists:
        check_free(net)
        _run("ip", "link", "add", net.bridge, "type", "bridge")
        journal.links.append(net.bridge)
        journal.save()
        say(f"created bridge {net.bridge} ({net.gateway}/{net.pod_cidr.split('/')[1]})")
    prefix = net.pod_cidr.split("/")[1]
    if f"inet {net.gateway}/" not in _run("ip", "-4", "addr", "show", "dev", net.bridge).stdout:
        _run("ip", "addr", "add", f"{net.gateway}/{prefix}", "dev", net.bridge)
    v6 = Path(f"/proc/sys/net/ipv6/conf/{net.bridge}/disable_ipv6")
    if v6.exists():
        v6.write_text("1")  # the guard rules are IPv4: give the pods no IPv6 path at all
    _run("ip", "link", "set", net.bridge, "up")
    if f"blackhole {net.fake_pod_cidr}" not in _run("ip", "-4", "route", "show", "type", "blackhole").stdout:
        _run("ip", "route", "add", "blackhole", net.fake_pod_cidr)
        if net.fake_pod_cidr not in journal.routes:
            journal.routes.append(net.fake_pod_cidr)
            journal.save()


def guard_rules(net: Network) -> list[list[str]]:
    """The TPUFT-GUARD chain's rules, in order (iptables -A arguments)."""
    b = net.bridge
    return [
        ["-i", b, "-o", b, "-j", "RETURN"],                  # pod to pod (and Service DNAT between pods)
        ["-i", b, "-d", f"{net.gateway}/32", "-j", "RETURN"],  # pod to the host's bridge address
        ["-i", b, "-j", "DROP"],                             # anything else from a pod, in or out
        ["-o", b, "-j", "DROP"],                             # nothing forwarded into the bridge from outside
    ]


def ensure_guard(journal: Journal, net: Network) -> None:
    """(Re)write the guard chain and keep it first in INPUT and FORWARD (kube-proxy inserts its own)."""
    if _run("iptables", "-w", "-n", "-L", GUARD_CHAIN, check=False).returncode != 0:
        _run("iptables", "-w", "-N", GUARD_CHAIN)
        if GUARD_CHAIN not in journal.chains:
            journal.chains.append(GUARD_CHAIN)
            journal.save()
    _run("iptables", "-w", "-F", GUARD_CHAIN)
    for rule in guard_rules(net):
        _run("iptables", "-w", "-A", GUARD_CHAIN, *rule)
    for parent in ("INPUT", "FORWARD"):
        _keep_first(parent)


def _keep_first(parent: str) -> None:
    """Our jump first in `parent`, with no moment without it: insert at 1, then drop the others."""
    jump = f"-A {parent} -j {GUARD_CHAIN}"
    rules = _run("iptables", "-w", "-S", parent).stdout.splitlines()[1:]  # [0] is the policy
    if rules[:1] == [jump] and rules.count(jump) == 1:
        return
    _run("iptables", "-w", "-I", parent, "1", "-j", GUARD_CHAIN)
    rules = _run("iptables", "-w", "-S", parent).stdout.splitlines()[1:]
    for number in sorted((i + 1 for i, r in enumerate(rules) if r == jump and i > 0), reverse=True):
        _run("iptables", "-w", "-D", parent, str(number))


def guard_in_place(net: Network) -> bool:
    """Every guard rule present (asked with -C: `iptables -S` reorders a rule's options) and our
    jump first in INPUT and FORWARD."""
    firsts = [_run("iptables", "-w", "-S", p, check=False).stdout.splitlines()[1:2] for p in ("INPUT", "FORWARD")]
    return (all(_run("iptables", "-w", "-C", GUARD_CHAIN, *r, check=False).returncode == 0 for r in guard_rules(net))
            and all(f == [f"-A {p} -j {GUARD_CHAIN}"] for f, p in zip(firsts, ("INPUT", "FORWARD"))))


def apply(journal: Journal, net: Network) -> None:
    """Everything the node needs from the host, before containerd and the kubelet start."""
    require_root()
    ensure_packages(journal)
    set_sysctls(journal)
    ensure_bridge(journal, net)
    ensure_guard(journal, net)


# ----- undo --------------------------------------------------------------------------------------
def unmount_under(root: Path) -> int:
    """Unmount everything mounted at or below `root`, deepest first; returns how many."""
    prefix = str(root.resolve())
    points = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4].replace("\\040", " ")
        if point == prefix or point.startswith(prefix + "/"):
            points.append(point)
    for point in sorted(set(points), key=len, reverse=True):
        _run("umount", "-l", point, check=False)
    return len(set(points))


def _remove_leftover_chains() -> None:
    for table, chain in LEFTOVER_CHAINS:
        if _run("iptables", "-w", "-t", table, "-n", "-L", chain, check=False).returncode != 0:
            continue
        for parent in ("INPUT", "OUTPUT", "FORWARD", "PREROUTING", "POSTROUTING"):
            rules = _run("iptables", "-w", "-t", table, "-S", parent, check=False).stdout.splitlines()
            for rule in rules:
                if f"-j {chain}" in rule and rule.startswith("-A "):
                    _run("iptables", "-w", "-t", table, "-D", *rule.split()[1:], check=False)
        _run("iptables", "-w", "-t", table, "-F", chain, check=False)
    for table, chain in LEFTOVER_CHAINS:
        _run("iptables", "-w", "-t", table, "-X", chain, check=False)


def undo(journal: Journal, *, keep_packages: bool = False) -> list[str]:
    """Revert what the journal records; returns one line per change undone."""
    done: list[str] = []
    for chain in journal.chains:
        for parent in ("INPUT", "FORWARD"):
            while _run("iptables", "-w", "-D", parent, "-j", chain, check=False).returncode == 0:
                pass
        _run("iptables", "-w", "-F", chain, check=False)
        _run("iptables", "-w", "-X", chain, check=False)
        done.append(f"removed iptables chain {chain}")
    _remove_leftover_chains()
    for dest in journal.routes:
        if _run("ip", "route", "del", "blackhole", dest, check=False).returncode == 0:
            done.append(f"removed blackhole route {dest}")
    for link in journal.links:
        if _run("ip", "link", "del", link, check=False).returncode == 0:
            done.append(f"removed bridge {link}")
    for key, value in journal.sysctls.items():
        if read_sysctl(key) not in (None, value):
            try:
                _sysctl_path(key).write_text(value)
                done.append(f"sysctl {key}={value} (restored)")
            except OSError:
                pass
    for path in LEFTOVER_PATHS:
        if Path(path).exists():
            shutil.rmtree(path, ignore_errors=True)
            done.append(f"removed {path}")
    if journal.packages and not keep_packages:
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        res = subprocess.run(["apt-get", "remove", "-y", "-q", *journal.packages], capture_output=True, text=True,
                             env=env)
        if res.returncode == 0:
            done.append(f"removed Debian packages {' '.join(journal.packages)}")
            journal.packages = []
    journal.chains, journal.routes, journal.links, journal.sysctls = [], [], [], {}
    journal.save()
    return done
