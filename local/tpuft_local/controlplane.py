"""A real, local Kubernetes control plane: etcd + kube-apiserver + kube-controller-manager.

For the fast test tier (tests/conftest.py) on its own, and as the first part of the local
cluster (tpuft_local.cluster), which adds kube-scheduler and a node. Alone, everything
listens on 127.0.0.1, on free ports picked at start; with a `Network`, kube-apiserver
listens on the bridge address instead (pods must reach it, and Endpoints may not be loopback). kube-apiserver runs with real RBAC,
client-cert auth (admin in system:masters) and service-account tokens (TokenRequest works);
kube-controller-manager runs the garbage collector, namespace and service-account
controllers and ClusterRole aggregation (plus deployment/replicaset/statefulset/job, so
workloads get Pods; no scheduler or kubelet runs, so Pods stay Pending). Binaries come from tpuft_local.toolchain (built once per machine).

    cp = ControlPlane(state_dir).start()      # blocks until /readyz and the default SA exist
    cp.install_crds(default_crd_paths())      # applies, waits for Established
    cp.kubectl("get", "tft", "-A")            # CompletedProcess
    cp.stop()

Top-level imports are stdlib only.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

from tpuft_local import procs
from tpuft_local.console import say
from tpuft_local.network import Network
from tpuft_local.node import NODE_POOL
from tpuft_local.pools import POOL_LABEL
from tpuft_local.toolchain import (REPO_ROOT, ToolchainError, ensure_tools, kuberay_crd_dir, set_pdeathsig,
                                   tool_path)

COMPONENTS = ("etcd", "kube-apiserver", "kube-controller-manager")
# Streaming lists (WatchList) need etcd's progress requests, which this etcd (3.5.1) lacks: with the
# gate on, the API server accepted a client's streaming list, then ended it with "the required
# storage feature RequestWatchProgress is disabled", and KWOK (client-go v0.33) asked again, seeing
# pod changes 20-40 s late. Off, it refuses the request at once and clients list and watch instead.
APISERVER_FEATURE_GATES = "--feature-gates=WatchList=false"
# With a node: taints and evictions for NotReady nodes, Service endpoints, finished-pod GC.
NODE_CONTROLLERS = ("node-lifecycle-controller", "taint-eviction-controller", "endpoints-controller",
                    "endpointslice-controller", "endpointslice-mirroring-controller", "pod-garbage-collector-controller",
                    "ttl-after-finished-controller",
                    # static PersistentVolumes (the demo's checkpoint claim) bind, and their finalizers clear
                    "persistentvolume-binder-controller", "persistentvolume-protection-controller",
                    "persistentvolumeclaim-protection-controller")
KCM_CONTROLLERS = os.environ.get("TPUFT_KCM_CONTROLLERS") or ",".join([
    "garbage-collector-controller", "namespace-controller", "serviceaccount-controller",
    "serviceaccount-token-controller", "root-ca-certificate-publisher-controller",
    "clusterrole-aggregation-controller",  # fills the admin/edit/view ClusterRoles
    "deployment-controller", "replicaset-controller", "statefulset-controller", "job-controller"])
KUBERAY_CRDS = ("ray.io_rayclusters.yaml", "ray.io_rayjobs.yaml", "ray.io_rayservices.yaml")


# kubectl's words for an API server that was too slow or not listening, as opposed to a refusal
_TRANSIENT = ("Client.Timeout exceeded", "i/o timeout", "connection refused", "TLS handshake timeout",
              "the server is currently unable to handle the request", "etcdserver: request timed out",
              "context deadline exceeded", "http2: client connection lost", "Error from server (Timeout)")
RETRY_ATTEMPTS = 3
RETRY_WAIT_S = 5.0


def transient(kubectl_error: str) -> bool:
    """kubectl failed because the API server did not answer in time (worth one more try), not because
    it refused what was sent."""
    return any(t in kubectl_error for t in _TRANSIENT)


class ControlPlaneError(RuntimeError):
    """A component failed to start or a kubectl call failed; the message says where to look."""


def kuberay_crd_paths(names=KUBERAY_CRDS) -> list[Path]:
    """KubeRay's CRDs, from the KubeRay module the local cluster's operator is built from
    (TPUFT_KUBERAY_CRDS: a folder holding them instead)."""
    override = os.environ.get("TPUFT_KUBERAY_CRDS")
    try:
        base = Path(override) if override else kuberay_crd_dir()
    except ToolchainError as e:
        raise ControlPlaneError(str(e)) from None
    paths = [base / name for name in names]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise ControlPlaneError(f"KubeRay CRDs not found: {', '.join(missing)}; "
                                "set TPUFT_KUBERAY_CRDS to the folder holding them")
    return paths


def default_crd_paths() -> list[Path]:
    """Our CRDs (crds/*.yaml in the repo) followed by the KubeRay ones."""
    return sorted((REPO_ROOT / "crds").glob("*.yaml")) + kuberay_crd_paths()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


class ControlPlane:
    """etcd + kube-apiserver + kube-controller-manager whose state lives in `state_dir`.

    die_with_parent: components get SIGTERM when the starting process exits (tests; not `up`).
    fast_etcd: etcd skips fsync (tests; data may be lost on a machine crash).
    """

    def __init__(self, state_dir: str | os.PathLike, *, die_with_parent: bool = False, fast_etcd: bool = False,
                 network: Network | None = None):
        self.network = network
        self.components = COMPONENTS + (("kube-scheduler",) if network else ())
        self.host = network.gateway if network else "127.0.0.1"
        self.state_dir = Path(state_dir).resolve()
        self.pki = self.state_dir / "pki"
        self.logs = self.state_dir / "logs"
        self.kubeconfig = self.state_dir / "kubeconfig"
        self.die_with_parent = die_with_parent
        self.fast_etcd = fast_etcd
        self._procs: dict[str, subprocess.Popen] = {}

    # ----- state -------------------------------------------------------------------------------
    @property
    def _state_file(self) -> Path:
        return self.state_dir / "state.json"

    def _state(self) -> dict:
        try:
            return json.loads(self._state_file.read_text())
        except (OSError, ValueError):
            return {}

    @property
    def server_url(self) -> str:
        ports = self._state().get("ports", {})
        if "kube-apiserver" not in ports:
            raise ControlPlaneError(f"no control plane has been started in {self.state_dir}")
        return f"https://{self.host}:{ports['kube-apiserver']}"

    def pids(self) -> dict[str, int]:
        """Live component processes belonging to this state dir (found via /proc)."""
        marker, found = str(self.state_dir) + "/", {}
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                argv = procs.cmdline(int(entry.name))
                name = os.path.basename(argv[0]) if argv else ""
                if name in self.components and any(marker in a for a in argv[1:]):
                    found[name] = int(entry.name)
        return found

    def ready(self) -> bool:
        return set(self.pids()) == set(self.components) and self._get("/readyz")[0] == 200

    def env(self) -> dict[str, str]:
        """Environment for running kubectl/helm against this control plane."""
        env = dict(os.environ, KUBECONFIG=str(self.kubeconfig), KUBECACHEDIR=str(self.state_dir / "kube-cache"))
        env["PATH"] = os.path.dirname(tool_path("kubectl")) + os.pathsep + env.get("PATH", "")
        return env

    # ----- lifecycle ---------------------------------------------------------------------------
    def start(self, timeout: float = 180.0) -> "ControlPlane":
        """Start all three (first stopping stale ones of this state dir); returns once usable."""
        bins = ensure_tools(self.components + ("kubectl",))
        for attempt in range(3):
            self.stop(quiet=True)  # stale processes from an earlier run of this state dir
            try:
                self._launch(bins, time.monotonic() + timeout, new_ports=attempt > 0)
                break
            except ControlPlaneError as e:  # another process took a port between pick and bind
                if "address already in use" not in str(e) or attempt == 2:
                    self.stop(quiet=True)
                    raise
                say("a port was taken meanwhile; retrying on new ports")
        say(f"control plane ready at {self.server_url} (kubeconfig: {self.kubeconfig})")
        return self

    def _launch(self, bins: dict[str, str], deadline: float, new_ports: bool) -> None:
        from tpuft_local.kubepki import ensure_pki, write_kubeconfig

        for d in (self.logs, self.state_dir / "etcd", self.state_dir / "kcm-certs"):
            d.mkdir(parents=True, exist_ok=True)
        net = self.network
        ensure_pki(self.pki, (net.gateway, net.kubernetes_service_ip) if net else ())
        old = {} if new_ports else self._state().get("ports", {})
        names = ("etcd", "etcd-peer", "kube-apiserver", "kube-controller-manager", "kube-scheduler")
        ports = {n: old[n] if old.get(n) and _port_free(old[n]) else free_port() for n in names}
        self._state_file.write_text(json.dumps({"ports": ports}, indent=2) + "\n")
        s, pki = self.state_dir, self.pki

        etcd_url, peer_url = f"http://127.0.0.1:{ports['etcd']}", f"http://127.0.0.1:{ports['etcd-peer']}"
        self._spawn("etcd", [
            bins["etcd"], "--name=tpuft", f"--data-dir={s}/etcd", f"--listen-client-urls={etcd_url}",
            f"--advertise-client-urls={etcd_url}", f"--listen-peer-urls={peer_url}",
            f"--initial-advertise-peer-urls={peer_url}", f"--initial-cluster=tpuft={peer_url}",
            "--log-level=warn", *(["--unsafe-no-fsync"] if self.fast_etcd else [])])
        self._wait("etcd", lambda: procs.http_ok(etcd_url + "/health"), deadline)

        self._spawn("kube-apiserver", [
            bins["kube-apiserver"], f"--etcd-servers={etcd_url}", f"--bind-address={self.host}",
            f"--advertise-address={self.host}", f"--secure-port={ports['kube-apiserver']}",
            f"--cert-dir={pki}", f"--tls-cert-file={pki}/apiserver.crt", f"--tls-private-key-file={pki}/apiserver.key",
            f"--client-ca-file={pki}/ca.crt",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={pki}/sa.pub", f"--service-account-signing-key-file={pki}/sa.key",
            "--allow-privileged=true", "--enable-priority-and-fairness=false", "--profiling=false", "--v=1",
            APISERVER_FEATURE_GATES, *self._apiserver_node_args()])
        url = f"https://{self.host}:{ports['kube-apiserver']}"
        write_kubeconfig(self.kubeconfig, url, pki)
        kcm_kubeconfig = s / "kcm.kubeconfig"
        write_kubeconfig(kcm_kubeconfig, url, pki, client="kube-controller-manager")
        self._wait("kube-apiserver", lambda: self._get("/readyz")[0] == 200, deadline)

        self._spawn("kube-controller-manager", [
            bins["kube-controller-manager"], f"--kubeconfig={kcm_kubeconfig}",
            f"--authentication-kubeconfig={kcm_kubeconfig}", f"--authorization-kubeconfig={kcm_kubeconfig}",
            "--bind-address=127.0.0.1", f"--secure-port={ports['kube-controller-manager']}",
            f"--cert-dir={s}/kcm-certs", "--leader-elect=false",
            f"--controllers={','.join([KCM_CONTROLLERS, *(NODE_CONTROLLERS if net else ())])}",
            f"--service-account-private-key-file={pki}/sa.key", f"--root-ca-file={pki}/ca.crt",
            "--use-service-account-credentials=false", "--profiling=false", "--v=1"])
        # The serviceaccount controller creating default/default proves the controller manager works.
        self._wait("kube-controller-manager",
                   lambda: self._get("/api/v1/namespaces/default/serviceaccounts/default")[0] == 200, deadline)
        if net:
            self._start_scheduler(bins["kube-scheduler"], url, ports["kube-scheduler"], deadline)

    def _apiserver_node_args(self) -> list[str]:
        """Flags for a cluster with a node: the bridge-reachable `kubernetes` Service, Node
        authorization for the kubelet, and GKE's admission behaviour for google.com/tpu."""
        net, pki = self.network, self.pki
        if net is None:
            return ["--authorization-mode=RBAC", "--service-cluster-ip-range=10.0.0.0/24",
                    "--endpoint-reconciler-type=none"]
        from tpuft_local.kubepki import issue
        crt, key = issue(pki, "apiserver-kubelet-client", "kube-apiserver-kubelet-client", "system:masters")
        return ["--authorization-mode=Node,RBAC", f"--service-cluster-ip-range={net.service_cidr}",
                # ExtendedResourceToleration: pods asking for google.com/tpu tolerate the TPU
                # nodes' google.com/tpu taint, as on GKE.
                "--enable-admission-plugins=NodeRestriction,ExtendedResourceToleration",
                f"--kubelet-client-certificate={crt}", f"--kubelet-client-key={key}",
                f"--kubelet-certificate-authority={pki}/ca.crt", "--kubelet-preferred-address-types=InternalIP"]

    def _start_scheduler(self, binary: str, url: str, port: int, deadline: float) -> None:
        from tpuft_local.kubepki import write_kubeconfig, issue
        issue(self.pki, "kube-scheduler", "system:kube-scheduler")
        kubeconfig = self.state_dir / "scheduler.kubeconfig"
        write_kubeconfig(kubeconfig, url, self.pki, client="kube-scheduler")
        config = self.state_dir / "scheduler.yaml"
        config.write_text(json.dumps(scheduler_config(kubeconfig), indent=2) + "\n")
        (self.state_dir / "scheduler-certs").mkdir(exist_ok=True)
        self._spawn("kube-scheduler", [
            binary, f"--config={config}", f"--authentication-kubeconfig={kubeconfig}",
            f"--authorization-kubeconfig={kubeconfig}", "--bind-address=127.0.0.1", f"--secure-port={port}",
            f"--cert-dir={self.state_dir}/scheduler-certs", "--v=1"])
        self._wait("kube-scheduler", lambda: self._http_ok_tls(f"https://127.0.0.1:{port}/readyz"), deadline)

    @staticmethod
    def _http_ok_tls(url: str) -> bool:
        ctx = ssl.create_default_context()
        ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE  # its self-signed serving cert
        try:
            with urllib.request.urlopen(url, timeout=2, context=ctx) as r:
                return r.status == 200
        except (OSError, ValueError):
            return False

    def stop(self, quiet: bool = False, timeout: float = 15.0) -> None:
        """SIGTERM each component of this state dir (by PID), SIGKILL what is left after `timeout`."""
        for name in reversed(self.components):
            pid = self.pids().get(name)
            if pid is None:
                continue
            if not quiet:
                say(f"stopping {name} (pid {pid})")
            proc = self._procs.pop(name, None)
            for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5.0)):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    break
                end = time.monotonic() + wait
                while time.monotonic() < end and procs.cmdline(pid) is not None:
                    if proc is not None and proc.poll() is not None:
                        break
                    time.sleep(0.1)
                if procs.cmdline(pid) is None or (proc is not None and proc.poll() is not None):
                    break

    def stop_component(self, name: str, timeout: float = 15.0) -> None:
        """Stop one component (the local cluster stops the controllers before draining pods)."""
        pid = self.pids().get(name)
        if pid is not None:
            from tpuft_local.procs import terminate
            terminate(pid, name, timeout)

    def __enter__(self) -> "ControlPlane":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _spawn(self, name: str, argv: list[str]) -> None:
        log = self.logs / f"{name}.log"
        say(f"starting {name} (log: {log})")
        with open(log, "ab") as fh:
            fh.write(("\n==== " + time.strftime("%Y-%m-%dT%H:%M:%S ") + " ".join(argv) + "\n").encode())
            fh.flush()
            self._procs[name] = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=fh, stderr=subprocess.STDOUT, cwd=self.state_dir,
                start_new_session=True, preexec_fn=set_pdeathsig if self.die_with_parent else None)

    def _wait(self, name: str, check, deadline: float) -> None:
        proc, log = self._procs[name], self.logs / f"{name}.log"
        while True:
            if proc.poll() is not None:
                raise ControlPlaneError(f"{name} exited with code {proc.returncode} while starting; "
                                        f"last lines of {log}:\n{_tail(log)}")
            if check():
                return
            if time.monotonic() > deadline:
                raise ControlPlaneError(f"{name} did not become ready in time; last lines of {log}:\n{_tail(log)}")
            time.sleep(0.2)

    # ----- talking to it ---------------------------------------------------------------------
    def _ssl_context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=str(self.pki / "ca.crt"))
        ctx.load_cert_chain(str(self.pki / "admin.crt"), str(self.pki / "admin.key"))
        return ctx

    def _get(self, path: str) -> tuple[int | None, str]:
        """GET `path` from kube-apiserver as admin: (status or None if unreachable, body)."""
        try:
            with urllib.request.urlopen(self.server_url + path, context=self._ssl_context(), timeout=5) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode(errors="replace")
        except (OSError, ControlPlaneError, ssl.SSLError):
            return None, ""

    def kubectl(self, *args: str, check: bool = False, input: str | None = None,
                timeout: float = 120) -> subprocess.CompletedProcess:
        """Run kubectl against this control plane; text output. check=True raises on failure."""
        cmd = [tool_path("kubectl"), f"--kubeconfig={self.kubeconfig}", *map(str, args)]
        res = subprocess.run(cmd, input=input, capture_output=True, text=True, timeout=timeout, env=self.env())
        if check and res.returncode != 0:
            raise ControlPlaneError(f"`kubectl {' '.join(map(str, args))}` failed ({res.returncode}):\n"
                                    f"{res.stderr.strip() or res.stdout.strip()}")
        return res

    def kubectl_retrying(self, *args: str, input: str | None = None,
                         attempts: int = RETRY_ATTEMPTS) -> subprocess.CompletedProcess:
        """An idempotent kubectl command (apply, patch), again while the API server is too slow to
        answer: one busy beside a whole CI run once left kubectl's schema download without headers
        for 32 s, and a CRD's server-side apply beside five Ray clusters on the node hit the API
        server's own 60 s request timeout. ControlPlaneError after the last attempt or a refusal."""
        for attempt in range(1, attempts + 1):
            res = self.kubectl(*args, input=input)
            if res.returncode == 0:
                return res
            error = res.stderr.strip() or res.stdout.strip()
            if attempt == attempts or not transient(error):
                raise ControlPlaneError(f"`kubectl {' '.join(map(str, args))}` failed (attempt {attempt} of "
                                        f"{attempts}): {error}")
            say(f"kubectl {args[0]}: the API server did not answer in time (attempt {attempt} of {attempts}); again")
            time.sleep(RETRY_WAIT_S)
        raise AssertionError("unreachable")

    def install_crds(self, paths, timeout: float = 120) -> list[str]:
        """Server-side apply each CRD file, then wait until every CRD is Established. Returns CRD names."""
        names: list[str] = []
        for path in paths:
            res = self.kubectl_retrying("apply", "--server-side", "--force-conflicts", "--field-manager=tpuft",
                                        "-f", str(path), "-o", "name")
            names += [n for n in res.stdout.split() if n.startswith("customresourcedefinition")]
        # Poll rather than `kubectl wait`, which errors out while .status.conditions is still unset.
        deadline, pending = time.monotonic() + timeout, list(names)
        while pending:
            res = self.kubectl("get", *pending, "-o", "json")
            doc = json.loads(res.stdout) if res.returncode == 0 else {}
            established = {"customresourcedefinition.apiextensions.k8s.io/" + o["metadata"]["name"]
                           for o in doc.get("items", [doc] if doc else [])
                           if any(c["type"] == "Established" and c["status"] == "True"
                                  for c in o.get("status", {}).get("conditions") or [])}
            pending = [n for n in pending if n not in established]
            if pending and time.monotonic() > deadline:
                raise ControlPlaneError(f"CRDs not Established after {timeout}s: {', '.join(pending)}")
            time.sleep(0.2 if pending else 0)
        return names


def scheduler_config(kubeconfig: Path) -> dict:
    """kube-scheduler's configuration: every pod prefers the real node whenever it fits there,
    so only pods too big for it (a TPU slice's 4-CPU Ray head) or bound elsewhere by their own
    selectors (TPU workers) land on simulated nodes, where nothing runs. A pod on the simulated
    CPU pool would never start, and KWOK would even report a Job's pod Completed there.
    - NodeAffinity's addedAffinity (applied to every pod by this profile) prefers the real
      node's pool, weighed 100: it outweighs every other score;
    - NodeResourcesFit scores MostAllocated (bin packing, as GKE's optimize-utilization profile
      does) instead of LeastAllocated, which would favour the big, empty simulated node.
    ImageLocality could not do this: its score is scaled by the share of nodes holding the image
    (1 of 8 here)."""
    prefer_real = {"weight": 100, "preference": {"matchExpressions": [
        {"key": POOL_LABEL, "operator": "In", "values": [NODE_POOL]}]}}
    return {"apiVersion": "kubescheduler.config.k8s.io/v1", "kind": "KubeSchedulerConfiguration",
            "clientConnection": {"kubeconfig": str(kubeconfig)}, "leaderElection": {"leaderElect": False},
            "profiles": [{"schedulerName": "default-scheduler",
                          "plugins": {"score": {"enabled": [{"name": "NodeAffinity", "weight": 100},
                                                            {"name": "NodeResourcesFit", "weight": 1}]}},
                          "pluginConfig": [
                              {"name": "NodeAffinity", "args": {"addedAffinity": {
                                  "preferredDuringSchedulingIgnoredDuringExecution": [prefer_real]}}},
                              {"name": "NodeResourcesFit", "args": {"scoringStrategy": {
                                  "type": "MostAllocated",
                                  "resources": [{"name": "cpu", "weight": 1}, {"name": "memory", "weight": 1}]}}}]}]}


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "".join(path.read_text(errors="replace").splitlines(True)[-lines:])
    except OSError:
        return "(no log)"
