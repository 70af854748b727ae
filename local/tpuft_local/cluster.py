"""`tpuft cluster`: a real single-node Kubernetes with simulated GKE TPU node pools, on this machine.

    up      host changes (host.py) -> containerd -> control plane + kube-scheduler -> kubelet ->
            kube-proxy -> CoreDNS -> KWOK + its Nodes -> KubeRay's operator -> TPU webhook stand-in
            -> our CRD -> images -> our operator (helm install, or from source with --operator=source)
    down    our operator, KubeRay and the controllers first (nothing recreates pods), then every pod,
            the node, the control plane; then the host changes are undone.
    status  each component and each node pool.

Real: kube-apiserver, kube-controller-manager, kube-scheduler, kubelet on containerd + runc,
kube-proxy (iptables), CoreDNS, KubeRay's ray-operator, all built here from the package
registries. Simulated: the TPU hosts (KWOK Nodes; nothing runs on them) and the KubeRay TPU
webhook (tpuft_local.tpu_webhook, a named stand-in). `up` is idempotent: what runs is kept,
what died is started again.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from tpuft_local import addons, host, node, pools, prepare, procs
from tpuft_local.host import default_state_dir
from tpuft_local.console import say
from tpuft_local.controlplane import ControlPlane, ControlPlaneError, free_port
from tpuft_local.network import Network, NetworkError, from_env
from tpuft_local.toolchain import (ARGOCD_COMMANDS, OPTIONAL_TOOLS, TOOLS, VERSIONS, ToolchainError, argocd_command,
                                   argocd_manifests_dir, cached_path, ensure_tools, kuberay_crd_dir, kueue_config_dir,
                                   provisioning_request_crd, tool_path)

REPO = Path(__file__).resolve().parents[2]

PROVREQ_CRD = "provisioningrequests.autoscaling.x-k8s.io"   # cluster-autoscaler's API, Kueue's dependency


class ClusterError(RuntimeError):
    """A component failed; the message names it and its log."""


@dataclasses.dataclass(frozen=True)
class Component:
    name: str
    program: str  # argv[0]'s basename, or the Python module run with -m


# The processes `up` starts beside the control plane, in start order.
NODE_COMPONENTS = (
    Component("containerd", "containerd"), Component("kubelet", "kubelet"), Component("kube-proxy", "kube-proxy"),
    Component("coredns", "coredns"), Component("kwok", "kwok"), Component("kuberay-operator", "kuberay-operator"),
    Component("gcs", "fake-gcs-server"), Component("gke-metadata", "tpuft_local.gcs"),
    Component("tpu-webhook", "tpuft_local.tpu_webhook"), Component("kueue", "kueue"),
    Component("queued-provisioning", "tpuft_local.queued_provisioning"),   # with Kueue: GKE's stand-in
    Component("tpufinetune-operator", "kopf"),
)
# Started by `up --argocd` only (after our operator), stopped first by `down`.
ARGOCD_COMPONENTS = (
    Component("redis", "redis-server"), Component("git-daemon", "git-daemon"),
    Component("argocd-repo-server", "argocd-repo-server"),
    Component("argocd-application-controller", "argocd-application-controller"),
)
KUEUE_COMPONENTS = ("kueue", "queued-provisioning")   # left out with --no-kueue
KUEUE_OFF = "kueue.off"   # in the state dir: the last `up` was --no-kueue (status does not expect it)
ARGOCD_ON = "argocd.on"   # in the state dir: the last `up` had --argocd (a plain `up` keeps it)
UP_STAMP = "up.stamp"     # in the state dir: what the last whole `up` was made from, and the processes it left
GCS_PORT_FILE, METADATA_PORT_FILE = "gcs.port", "gke-metadata.port"   # in the state dir, once `up` started them
# what points a laptop's GCS client (pyarrow's: `tpuft logs`, `tpuft plot`) at the stand-ins
LAPTOP_GCS_ENV = ("CLOUD_STORAGE_EMULATOR_ENDPOINT", "GCE_METADATA_ROOT")


class LocalCluster:
    def __init__(self, state_dir: Path | None = None, *, net: Network | None = None, tpu_pools=pools.DEFAULT_POOLS,
                 operator: str = "helm", die_with_parent: bool = False, kueue: bool | None = None,
                 argocd: bool | None = None):
        self.state = Path(state_dir or default_state_dir()).resolve()
        # None: as the last `up` left it (status, down); True/False: `up` with or without Kueue
        self.kueue = kueue if kueue is not None else not (self.state / KUEUE_OFF).exists()
        self.argocd = argocd if argocd is not None else (self.state / ARGOCD_ON).exists()
        self.net = net or from_env(dict(os.environ))
        self.tpu_pools = tuple(tpu_pools)
        self.operator_mode = operator  # "helm" | "source" | "none"
        self.die_with_parent = die_with_parent
        self.cp = ControlPlane(self.state, die_with_parent=die_with_parent, network=self.net)
        self.journal = host.Journal.load(host.journal_path(self.state))
        self.logs = self.state / "logs"
        self.socket = self.state / "containerd" / "containerd.sock"
        self._procs: dict[str, subprocess.Popen] = {}
        self._fresh_images: set[str] = set()  # imported by this `up`: their pods must restart

    # ----- finding what runs -------------------------------------------------------------------------
    def pid(self, comp: Component) -> int | None:
        found = procs.find(str(self.state) + "/", procs.by_program(comp.program))
        return found[0] if found else None

    def pid_of(self, name: str) -> int | None:
        return self.pid(_comp(name))

    def component_pids(self) -> dict[str, int | None]:
        out: dict[str, int | None] = {n: p for n, p in self.cp.pids().items()}
        for name in self.cp.components:
            out.setdefault(name, None)
        for comp in NODE_COMPONENTS:
            if comp.name not in KUEUE_COMPONENTS or self.kueue:
                out[comp.name] = self.pid(comp)
        for comp in ARGOCD_COMPONENTS if self.argocd else ():
            out[comp.name] = self.pid(comp)
        return out

    @property
    def kubeconfig(self) -> Path:
        return self.cp.kubeconfig

    def kubectl(self, *args: str, check: bool = True, input: str | None = None) -> subprocess.CompletedProcess:
        res = self.cp.kubectl(*args, input=input)
        if check and res.returncode != 0:
            raise ClusterError(f"`kubectl {' '.join(args)}` failed: {res.stderr.strip() or res.stdout.strip()}")
        return res

    def apply(self, docs: list[dict]) -> None:
        self.kubectl_retrying("apply", "--server-side", "--force-conflicts", "--field-manager=tpuft-local", "-f", "-",
                              input=json.dumps({"apiVersion": "v1", "kind": "List", "items": docs}))

    def kubectl_retrying(self, *args: str, input: str | None = None) -> None:
        """An idempotent kubectl command, again while the API server is too slow to answer
        (ControlPlane.kubectl_retrying); ClusterError when it still fails."""
        try:
            self.cp.kubectl_retrying(*args, input=input)
        except ControlPlaneError as e:
            raise ClusterError(str(e)) from None

    def _start(self, name: str, argv: list[str], ready, timeout: float = 90, env: dict | None = None) -> None:
        comp = _comp(name)
        if self.pid(comp) is not None:
            return
        log = self.logs / f"{name}.log"
        say(f"starting {name} (log: {log})")
        proc = procs.spawn(argv, log, cwd=self.state, env=env, die_with_parent=self.die_with_parent)
        self._procs[name] = proc
        try:
            procs.wait_for(ready, name, timeout, log, proc)
        except RuntimeError as e:
            raise ClusterError(str(e)) from None

    # ----- up ------------------------------------------------------------------------------------------
    def up(self, images: bool = True, unchanged_ok: bool = False) -> "LocalCluster":
        """Bring everything up, or (unchanged_ok) only say so when the last `up` left it as this one would
        and every process it started still runs: `tpuft demo`'s way (a whole idempotent `up` is 20-80 s
        of applies and helm on a busy node). `tpuft cluster up` always checks and repairs everything."""
        with self.up_lock():
            if unchanged_ok and (since := self._unchanged_since()) is not None:
                say(f"cluster unchanged since its `up` {time.time() - since:.0f} s ago, every component running "
                    "(`tpuft cluster up` checks and repairs the rest)")
                return self
            return self._up(images)

    def _up_inputs(self, images: bool) -> str:
        """The hash of what an `up` makes the cluster from: this package's code, the repo's CRDs and chart,
        the tools' versions, the images' inputs and this cluster's settings."""
        from tpuft_local import images as image_builder
        digest = hashlib.sha256()
        files = sorted((*Path(__file__).parent.glob("*.py"), *(REPO / "crds").glob("*.yaml"),
                        *(p for p in (REPO / "charts").rglob("*") if p.is_file())))
        for path in files:
            digest.update(str(path.relative_to(REPO)).encode() + b"\0" + path.read_bytes() + b"\0")
        settings = {"versions": VERSIONS, "pools": repr(self.tpu_pools), "operator": self.operator_mode,
                    "kueue": self.kueue, "argocd": self.argocd, "net": repr(self.net),
                    "images": image_builder.inputs_hashes(self._wanted_images()) if images else None}
        digest.update(json.dumps(settings, sort_keys=True).encode())
        return digest.hexdigest()

    def _unchanged_since(self) -> float | None:
        """When the last `up` ended, if what it was made from is unchanged, the processes it left are
        the ones running now (none died or was restarted) and the API server answers; else None."""
        try:
            stamp = json.loads((self.state / UP_STAMP).read_text())
        except (OSError, ValueError):
            return None
        if stamp.get("inputs") != self._up_inputs(images=True) or stamp.get("pids") != self.component_pids():
            return None
        return stamp.get("ended") if self.cp.ready() else None

    def _write_stamp(self, images: bool) -> None:
        stamp = {"inputs": self._up_inputs(images), "pids": self.component_pids(), "ended": time.time()}
        (self.state / UP_STAMP).write_text(json.dumps(stamp, indent=1) + "\n")

    @contextlib.contextmanager
    def up_lock(self):
        """One `up` at a time per state dir: two at once (two demos, two test lanes) would both
        helm-upgrade the operator, and helm refuses the second ("another operation is in progress").
        Held by whatever must not have `up` repair the cluster meanwhile (it puts back deleted pool
        nodes: tests/cluster/test_recovery.py)."""
        self.state.mkdir(parents=True, exist_ok=True)
        with open(self.state / "up.lock", "w") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                say(f"another `tpuft cluster up` is running on {self.state}; waiting for it")
                fcntl.flock(lock, fcntl.LOCK_EX)
            yield

    def _up(self, images: bool) -> "LocalCluster":
        t0 = time.monotonic()
        self.logs.mkdir(parents=True, exist_ok=True)
        host.apply(self.journal, self.net)
        built = self._tools_and_images(images)
        self._containerd()
        self._load_images(built, only=("pause",))
        if not self.cp.ready():
            self.cp.start()
        self._kubelet()
        self._kube_proxy()
        host.ensure_guard(self.journal, self.net)  # again: kube-proxy and the kubelet insert their chains first
        self._coredns()
        self._kwok()
        self._kuberay()
        self._gcs()
        self._webhook()
        self._kueue()
        self.cp.install_crds(sorted((REPO / "crds").glob("*.yaml")))
        self._load_images(built, only=("workload", "operator"))
        self._wait_node_lists([built[n].ref for n in ("workload", "operator") if n in built])
        self._operator()
        self._argocd()
        self._write_stamp(images)
        say(f"cluster up in {time.monotonic() - t0:.0f} s; kubeconfig: {self.kubeconfig}")
        return self

    def _tools_and_images(self, images: bool) -> dict:
        tools = [t for t in TOOLS if (t != "kueue" or self.kueue) and (t not in OPTIONAL_TOOLS or self.argocd)]
        return prepare.tools_and_images(tools, self._wanted_images() if images else ())

    def _wanted_images(self) -> tuple[str, ...]:
        return ("pause", "workload") + (("operator",) if self.operator_mode == "helm" else ())

    def _load_images(self, built: dict, only: tuple[str, ...]) -> None:
        from tpuft_local import images
        for name in only:
            if name in built and images.load_into_containerd(built[name], self.socket):
                say(f"imported {built[name].ref} into the node's containerd")
                self._fresh_images.add(name)

    def _containerd(self) -> None:
        if self.pid_of("containerd") is not None:
            return  # running: rewriting its config would restart it (kube-proxy exits on a changed file)
        root = self.state / "containerd"
        certs = root / "certs.d" / "_default"
        certs.mkdir(parents=True, exist_ok=True)
        (certs / "hosts.toml").write_text(node.closed_registry_hosts())
        net_dir = self.state / "cni" / "net.d"
        node.write_json(net_dir / "10-tpuft.conflist", node.cni_config(self.net, self.state / "cni" / "ipam"))
        config = root / "config.toml"
        config.write_text(node.containerd_config(root, self.socket, net_dir, root / "certs.d"))
        self._start("containerd", ["containerd", f"--config={config}"],
                    lambda: self.ctr("version").returncode == 0, timeout=60)

    def ctr(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["ctr", f"--address={self.socket}", "--namespace=k8s.io", *args],
                              capture_output=True, text=True)

    def _client_kubeconfig(self, stem: str, cn: str, org: str | None = None) -> Path:
        from tpuft_local.kubepki import issue, write_kubeconfig
        issue(self.cp.pki, stem, cn, org)
        path = self.state / f"{stem}.kubeconfig"
        write_kubeconfig(path, self.cp.server_url, self.cp.pki, client=stem)
        return path

    def _kubelet(self) -> None:
        if self.pid_of("kubelet") is not None:
            return  # running: rewriting its config would restart it (kube-proxy exits on a changed file)
        from tpuft_local.kubepki import issue
        kubeconfig = self._client_kubeconfig("kubelet", f"system:node:{node.NODE_NAME}", "system:nodes")
        issue(self.cp.pki, "kubelet-serving", f"system:node:{node.NODE_NAME}", "system:nodes",
              server_ips=(self.net.gateway,), server_names=(node.NODE_NAME,), client=False)
        resolv = self.state / "kubelet-resolv.conf"
        resolv.write_text("# no upstream nameserver: pods resolve cluster names only (CoreDNS)\n")
        port = free_port()
        config = node.write_json(self.state / "kubelet.json", node.kubelet_config(
            self.net, socket=self.socket, pki=self.cp.pki, resolv_conf=resolv, healthz_port=port))
        host.save_sysctls(self.journal, host.SET_BY_COMPONENTS)  # the kubelet sets some on start
        labels = f"{pools.POOL_LABEL}={node.NODE_POOL},node.kubernetes.io/instance-type=local"
        self._start("kubelet", [
            tool_path("kubelet"), f"--config={config}", f"--kubeconfig={kubeconfig}",
            f"--root-dir={self.state}/kubelet", f"--hostname-override={node.NODE_NAME}",
            f"--node-ip={self.net.gateway}", f"--node-labels={labels}", "--v=1"],
            lambda: self._node_ready(node.NODE_NAME), timeout=120)

    def _wait_node_lists(self, refs: list[str], timeout: float = 120) -> None:
        """Wait until the kubelet reports `refs` in the node's status.images: the scheduler's
        ImageLocality scores from that list, and the CPU example's pods must go to this node."""
        def listed() -> bool:
            res = self.cp.kubectl("get", "node", node.NODE_NAME, "-o", "json")
            images = json.loads(res.stdout).get("status", {}).get("images") or [] if res.returncode == 0 else []
            names = {n for img in images for n in img.get("names", [])}
            return all(r in names for r in refs)
        try:
            procs.wait_for(listed, f"the kubelet to list {', '.join(refs)}", timeout, self.logs / "kubelet.log")
        except RuntimeError as e:
            raise ClusterError(str(e)) from None

    def _node_ready(self, name: str) -> bool:
        res = self.cp.kubectl("get", "node", name, "-o", "json")
        if res.returncode != 0:
            return False
        conds = json.loads(res.stdout).get("status", {}).get("conditions") or []
        return any(c["type"] == "Ready" and c["status"] == "True" for c in conds)

    def _kube_proxy(self) -> None:
        if self.pid_of("kube-proxy") is not None:
            return  # running: rewriting its config would restart it (kube-proxy exits on a changed file)
        kubeconfig = self._client_kubeconfig("kube-proxy", "system:kube-proxy")
        hz, metrics = free_port(), free_port()
        config = node.write_json(self.state / "kube-proxy.json", node.kube_proxy_config(self.net, kubeconfig, hz, metrics))
        self._start("kube-proxy", [tool_path("kube-proxy"), f"--config={config}", "--v=1"],
                    lambda: procs.http_ok(f"http://127.0.0.1:{hz}/healthz"), timeout=60)

    def _coredns(self) -> None:
        if self.pid_of("coredns") is not None:
            return  # running: rewriting its config would restart it (kube-proxy exits on a changed file)
        kubeconfig = self._client_kubeconfig("coredns", addons.COREDNS_USER)
        self.apply(addons.rbac())
        self.apply(addons.kube_dns(self.net))
        health, ready = free_port(), free_port()
        corefile = self.state / "Corefile"
        corefile.write_text(addons.corefile(self.net, str(kubeconfig), health, ready))
        self._start("coredns", [tool_path("coredns"), "-conf", str(corefile)],
                    lambda: procs.http_ok(f"http://127.0.0.1:{ready}/ready"), timeout=60)

    def _kwok(self) -> None:
        from tpuft_local.kubepki import issue
        kubeconfig = self._client_kubeconfig("kwok", addons.KWOK_USER)
        # The simulated hosts' kubelet API is KWOK's own server, on the bridge address their Nodes
        # name, at the port they name. Without a port they named the real node's address and the
        # API server asked the real kubelet about pods it never ran: `kubectl logs` on a slice's
        # pod answered 404 (NotFound). The API server checks kubelets' serving certs against the
        # cluster CA, so KWOK's is signed by it.
        crt, key = issue(self.cp.pki, "kwok-serving", "kwok", server_ips=(self.net.gateway,), client=False)
        logs_file = self.state / "simulated-host.log"
        logs_file.write_text(addons.SIMULATED_HOST_LOG)
        config = self.state / "kwok.yaml"
        config.write_text(addons.kwok_config(str(logs_file)))
        port_file = self.state / "kwok.port"
        if not port_file.exists():
            self._stop("kwok")   # started by an `up` that recorded no port: start it again on one
        if self.pid_of("kwok") is None:
            port_file.write_text(str(free_port()))
        port = int(port_file.read_text())
        self._start("kwok", [
            tool_path("kwok"), f"--kubeconfig={kubeconfig}", f"--config={config}", "--manage-all-nodes=false",
            f"--manage-nodes-with-annotation-selector={pools.KWOK_ANNOTATION}=fake",
            f"--cidr={self.net.fake_pod_cidr}", f"--node-ip={self.net.gateway}", f"--node-port={port}",
            # KWOK's default heartbeat (20 s + up to 25 s jitter) can exceed the node-lifecycle
            # controller's 50 s grace: pods would flip to Ready=False.
            "--node-lease-duration-seconds=40", f"--server-address={self.net.gateway}:{port}",
            f"--tls-cert-file={crt}", f"--tls-private-key-file={key}"],
            lambda: True, timeout=10)
        nodes = pools.all_nodes(self.tpu_pools)
        self.kubectl_retrying("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": nodes}))
        names = [n["metadata"]["name"] for n in nodes]
        try:
            procs.wait_for(lambda: all(self._node_ready(n) for n in names), "KWOK nodes", 90, self.logs / "kwok.log")
        except RuntimeError as e:
            raise ClusterError(str(e)) from None
        # KWOK writes the port into a Node's status only when it first initializes it; Nodes an
        # earlier `up` made (the state outlives `down`) still name none, or another port.
        endpoint = json.dumps({"status": {"daemonEndpoints": {"kubeletEndpoint": {"Port": port}}}})
        for name in names:
            self.kubectl_retrying("patch", "node", name, "--subresource=status", "--type=merge", "-p", endpoint)

    def _kuberay(self) -> None:
        crds = kuberay_crd_dir()
        self.cp.install_crds(sorted(crds.glob("*.yaml")))
        self.kubectl_retrying("apply", "--server-side", "--force-conflicts", "-f",
                              str(crds.parent.parent / "rbac" / "role.yaml"))
        kubeconfig = self._client_kubeconfig("kuberay-operator", addons.KUBERAY_USER)
        probe = free_port()
        self._start("kuberay-operator", [
            tool_path("kuberay-operator"), f"--kubeconfig={kubeconfig}", "--enable-leader-election=false",
            # Dashboard calls through the API server's service proxy: the host needs no cluster DNS.
            "--use-kubernetes-proxy", f"--metrics-addr=127.0.0.1:{free_port()}",
            f"--health-probe-bind-address=127.0.0.1:{probe}"],
            lambda: procs.http_ok(f"http://127.0.0.1:{probe}/readyz"), timeout=120)

    @property
    def gcs_endpoint(self) -> str:
        """GCS's stand-in (fake-gcs-server), where pods and this host reach it: the bridge."""
        return f"http://{self.net.gateway}:{self._port(GCS_PORT_FILE)}"

    @property
    def metadata_root(self) -> str:
        """The GKE metadata server's stand-in, as GCE_METADATA_ROOT spells it (host:port)."""
        return f"{self.net.gateway}:{self._port(METADATA_PORT_FILE)}"

    def laptop_gcs_env(self) -> dict[str, str]:
        """LAPTOP_GCS_ENV for the stand-ins; {} before an `up` started them (no port kept yet)."""
        from tpuft_local import gcs
        if not all((self.state / name).exists() for name in (GCS_PORT_FILE, METADATA_PORT_FILE)):
            return {}
        env = gcs.workload_env(self.gcs_endpoint, self.metadata_root)
        return {name: env[name] for name in LAPTOP_GCS_ENV}

    def _gcs(self) -> None:
        """The stand-ins for GCS (fake-gcs-server, its buckets under the state dir) and for the GKE
        metadata server's token endpoint, on the bridge address so pods reach them
        (tpuft_local.gcs; tpuft_local.gke_environment tells the pods where they are)."""
        from tpuft_local import gcs
        data = self.state / "gcs" / "data"
        data.mkdir(parents=True, exist_ok=True)
        host, port = self.net.gateway, self._port(GCS_PORT_FILE)
        self._start("gcs", gcs.fake_gcs_argv(tool_path(gcs.TOOL), host, port, data),
                    lambda: procs.http_ok(f"{self.gcs_endpoint}/storage/v1/b"), timeout=60)
        meta_host, meta_port = self.metadata_root.rsplit(":", 1)
        self._start("gke-metadata", [sys.executable, "-m", "tpuft_local.gcs", "metadata", f"--host={meta_host}",
                                     f"--port={meta_port}", f"--state-dir={self.state}/"],
                    lambda: gcs.metadata_ready(self.metadata_root), timeout=30)

    def _webhook(self) -> None:
        """The LOCAL STAND-IN for the KubeRay TPU webhook, on the bridge address over TLS,
        registered with real Mutating/ValidatingWebhookConfigurations; the same process serves
        the GKE environment stand-in's mutation (tpuft_local.gke_environment)."""
        from tpuft_local import gcs, gke_environment, tpu_webhook
        kubeconfig = self._client_kubeconfig("tpu-webhook", addons.WEBHOOK_USER)
        crt, key = tpu_webhook.mint_serving_cert(self.cp.pki, self.net.gateway)
        port = self._port("tpu-webhook.port")
        url = f"https://{self.net.gateway}:{port}"
        env = gcs.workload_env(self.gcs_endpoint, self.metadata_root)
        self._start("tpu-webhook", [sys.executable, "-m", "tpuft_local.tpu_webhook", f"--listen={self.net.gateway}:{port}",
                                    f"--cert={crt}", f"--key={key}", f"--kubeconfig={kubeconfig}",
                                    *(f"--gke-env={name}={value}" for name, value in env.items())],
                    lambda: _https_ok(url + "/", self.cp.pki / "ca.crt"), timeout=60)
        ca = (self.cp.pki / "ca.crt").read_bytes()
        self.apply([*tpu_webhook.webhook_configurations(url, ca), gke_environment.webhook_configuration(url, ca)])

    def _kueue(self) -> None:
        """Kueue (a host process, like KubeRay's operator) with its CRDs, RBAC and webhooks (on the
        bridge address, our CA), then the queue objects: one flavor per pool, the ClusterQueue
        `local` (one slice of each TPU pool), a LocalQueue `local` in the demo namespace."""
        from tpuft_local import kueue, tpu_webhook
        from tpuft_local.demo_objects import DEMO_NAMESPACE, PSA_LABELS
        off = self.state / KUEUE_OFF
        if not self.kueue:
            off.touch()
            self._stop("queued-provisioning")
            self._stop("kueue")
            return
        off.unlink(missing_ok=True)
        comp = kueue_config_dir()
        self.cp.install_crds(sorted((comp / "crd" / "bases").glob("*.yaml")))
        # Kueue sets up its ProvisioningRequest admission check only when the API is served at its start.
        had_provreq = self.kubectl("get", "crd", PROVREQ_CRD, check=False).returncode == 0
        self.cp.install_crds([provisioning_request_crd()])
        if not had_provreq:
            self._stop("kueue")
        self.apply([{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": kueue.NAMESPACE}},
                    *kueue.rbac(comp / "rbac")])
        kubeconfig = self._client_kubeconfig("kueue", kueue.USER)
        crt, key = tpu_webhook.mint_serving_cert(self.cp.pki, self.net.gateway)
        certs = self.state / "kueue-certs"
        certs.mkdir(exist_ok=True)
        shutil.copyfile(crt, certs / "tls.crt")
        shutil.copyfile(key, certs / "tls.key")
        port = self._port("kueue-webhook.port")
        health = free_port()
        config = self.state / "kueue-config.yaml"
        config.write_text(json.dumps(kueue.configuration(self.net.gateway, port, certs, health)))
        self._start("kueue", [*kueue.private_etc(self.state / "kueue-etc", certs), tool_path("kueue"), f"--config={config}",
                              "--feature-gates=VisibilityOnDemand=false"],
                    lambda: procs.http_ok(f"http://127.0.0.1:{health}/readyz"), timeout=120,
                    env=dict(os.environ, KUBECONFIG=str(kubeconfig)))
        url = f"https://{self.net.gateway}:{port}"
        self.apply(kueue.webhook_configurations(comp / "webhook" / "manifests.yaml", url,
                                                (self.cp.pki / "ca.crt").read_bytes()))
        self.apply([{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": DEMO_NAMESPACE, "labels": PSA_LABELS}},
                    *kueue.queue_objects(self.tpu_pools, DEMO_NAMESPACE)])
        self._queued_provisioning()

    def _queued_provisioning(self) -> None:
        """The stand-in for GKE's queued provisioning (tpuft_local.queued_provisioning) and the Kueue
        objects using it: the ClusterQueue `flex-start` (ProvisioningRequest admission check) for the
        first v6e/tpu7x pool's shape, and the ClusterQueue `tas` (Topology Aware Scheduling) on it."""
        from tpuft_local import kueue
        from tpuft_local.demo_objects import DEMO_NAMESPACE
        pool = next((p for p in self.tpu_pools if p.accelerator in ("v6e", "tpu7x")), None)
        if pool is None:
            return
        user = "tpuft:queued-provisioning"
        self.apply([*kueue.standin_rbac(user), *kueue.flex_start_objects(pool, DEMO_NAMESPACE),
                    *kueue.tas_objects(pool, DEMO_NAMESPACE)])
        kubeconfig = self._client_kubeconfig("queued-provisioning", user)
        log = self.logs / "queued-provisioning.log"
        self._start("queued-provisioning", [sys.executable, "-m", "tpuft_local.queued_provisioning",
                                            f"--kubeconfig={kubeconfig}"],
                    lambda: log.exists() and "running" in log.read_text(errors="replace"), timeout=60)

    def _operator(self) -> None:
        if self.operator_mode == "none":
            return
        if self.operator_mode == "helm":
            from tpuft_local import chart
            chart.install(self, restart="operator" in self._fresh_images)
            return
        kubeconfig = self.kubeconfig
        port = free_port()
        env = dict(os.environ, KUBECONFIG=str(kubeconfig), TPUFT_METRICS_PORT="0")
        self._start("tpufinetune-operator", [
            sys.executable, "-m", "kopf", "run", "--standalone", "-m", "tpuft.controller.handlers", "--all-namespaces",
            f"--liveness=http://127.0.0.1:{port}/healthz", "--log-format=plain"],
            lambda: procs.http_ok(f"http://127.0.0.1:{port}/healthz"), timeout=90, env=env)

    def _argocd(self) -> None:
        """Argo CD (tpuft_local.argocd): its CRDs, RBAC and config, Redis, the git daemon, the repo
        server and the application controller, all host processes on loopback."""
        from tpuft_local import argocd
        on = self.state / ARGOCD_ON
        if not self.argocd:
            on.unlink(missing_ok=True)
            self._stop_argocd()
            return
        on.touch()
        host.ensure_packages(self.journal, argocd.PACKAGES)
        manifests = argocd_manifests_dir()
        self.cp.install_crds(argocd.crd_files(manifests))
        self.apply(argocd.config(manifests, argocd.HEALTH_LUA.read_text()))
        self.apply(argocd.rbac(manifests))
        work = self.state / "argocd"
        bin_dir = work / "bin"   # links named for each component, so `status` and `down` tell them apart
        bin_dir.mkdir(parents=True, exist_ok=True)
        for name in ARGOCD_COMMANDS:
            link = bin_dir / name
            if not link.is_symlink() or os.readlink(link) != argocd_command(name):
                link.unlink(missing_ok=True)
                link.symlink_to(argocd_command(name))
        # ... and Argo CD's git-verify-wrapper.sh, which its image puts on PATH: the repo server runs
        # it on every revision (no signature is no error). Copied: the module cache's files are 0444.
        wrapper = bin_dir / argocd.VERIFY_WRAPPER
        wrapper.unlink(missing_ok=True)
        shutil.copyfile(manifests.parent / "hack" / argocd.VERIFY_WRAPPER, wrapper)
        wrapper.chmod(0o755)
        redis_port, git_port, repo_port, metrics = (self._port(f"argocd-{p}.port") for p in
                                                    ("redis", "git", "repo-server", "metrics"))
        (work / "redis").mkdir(exist_ok=True)
        (work / "redis.conf").write_text(argocd.redis_config(work / "redis", redis_port))
        self._start("redis", ["redis-server", str(work / "redis.conf")], lambda: argocd.redis_ok(redis_port), timeout=30)
        argocd.init_repo(work / "git")
        self._start("git-daemon", argocd.git_daemon_argv(work / "git", git_port), lambda: argocd.tcp_ok(git_port),
                    timeout=30)
        tmp = work / "tmp"   # the repo server's checkouts
        tmp.mkdir(exist_ok=True)
        # Its askpass socket (a fixed /tmp path by default) under the state dir too; no GnuPG.
        env = dict(os.environ, **argocd.component_env(), TMPDIR=str(tmp), ARGOCD_GPG_ENABLED="false",
                   ARGOCD_ASK_PASS_SOCK=str(work / "ask-pass.sock"), PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
        self._start("argocd-repo-server", [
            str(bin_dir / "argocd-repo-server"), "--address=127.0.0.1", f"--port={repo_port}", "--disable-tls",
            "--client-ca-path=",   # no mTLS: plaintext on loopback (its default path would demand TLS)
            f"--redis=127.0.0.1:{redis_port}", "--metrics-address=127.0.0.1", f"--metrics-port={free_port()}",
            "--logformat=text"], lambda: argocd.tcp_ok(repo_port), timeout=120, env=env)
        kubeconfig = self._client_kubeconfig("argocd-application-controller", argocd.USER)
        # Its metrics server (and /healthz) binds 0.0.0.0: Argo CD hard-codes that address.
        self._start("argocd-application-controller", [
            str(bin_dir / "argocd-application-controller"), f"--kubeconfig={kubeconfig}",
            f"--namespace={argocd.NAMESPACE}", f"--repo-server=127.0.0.1:{repo_port}", "--repo-server-plaintext",
            f"--redis=127.0.0.1:{redis_port}", f"--metrics-port={metrics}", "--logformat=text",
            # each resource's health in the Application's status (Argo CD 3 keeps it only in Redis
            # by default, for its API server, which is not run here)
            "--persist-resource-health"],
            lambda: procs.http_ok(f"http://127.0.0.1:{metrics}/healthz"), timeout=120,
            env=dict(env, ARGOCD_FAKE_IN_CLUSTER="true", KUBECONFIG=str(kubeconfig)))

    def ensure_argocd(self) -> tuple[Path, str]:
        """Argo CD running (started now if the last `up` had no --argocd); returns the git repository
        it syncs from: its path (to publish to: tpuft_local.argocd.publish) and its URL (for Applications)."""
        from tpuft_local import argocd
        if not self.argocd or any(self.pid_of(comp.name) is None for comp in ARGOCD_COMPONENTS):
            self.argocd = True
            self._argocd()
        return (self.state / "argocd" / "git" / argocd.REPO_NAME,
                argocd.repo_url(int((self.state / "argocd-git.port").read_text())))

    def _port(self, name: str) -> int:
        """A loopback port kept in the state dir, so a restarted component listens where it did."""
        path = self.state / name
        port = int(path.read_text()) if path.exists() else free_port()
        path.write_text(str(port))
        return port

    def _stop_argocd(self) -> None:
        for comp in reversed(ARGOCD_COMPONENTS):
            self._stop(comp.name)

    # ----- down ----------------------------------------------------------------------------------------
    def down(self, keep_packages: bool = False, purge: bool = False) -> list[str]:
        """Stop everything this state dir started, by PID, and undo the host changes."""
        (self.state / UP_STAMP).unlink(missing_ok=True)
        self._stop_argocd()
        for name in ("tpufinetune-operator", "queued-provisioning", "kueue", "kuberay-operator", "tpu-webhook",
                     "gke-metadata", "gcs"):
            self._stop(name)
        self.cp.stop_component("kube-controller-manager")  # nothing may recreate the pods we delete
        self.cp.stop_component("kube-scheduler")
        self._drain_pods()
        for name in ("kwok", "coredns", "kube-proxy", "kubelet"):
            self._stop(name)
        if self.pid(_comp("kube-proxy")) is None and os.access(cached_path("kube-proxy"), os.X_OK):
            subprocess.run([str(cached_path("kube-proxy")), "--cleanup"], capture_output=True)
        self._kill_containers()
        self._stop("containerd")
        for pid in procs.find(str(self.socket), procs.by_program("containerd-shim-runc-v2")):
            procs.terminate(pid, "containerd-shim", timeout=5)
        self.cp.stop()
        mounts = host.unmount_under(self.state)
        done = host.undo(self.journal, keep_packages=keep_packages)
        if mounts:
            done.insert(0, f"unmounted {mounts} mount(s) under {self.state}")
        if purge:
            shutil.rmtree(self.state, ignore_errors=True)
            done.append(f"removed {self.state}")
        return done

    def _stop(self, name: str) -> None:
        pid = self.pid(_comp(name))
        if pid is not None:
            procs.terminate(pid, name)

    def _drain_pods(self, timeout: float = 90) -> None:
        """Delete every pod and wait (bounded) until the kubelet has stopped their sandboxes."""
        if self.cp._get("/readyz")[0] != 200 or self.pid(_comp("kubelet")) is None:
            return
        self.cp.kubectl("delete", "pods", "--all", "--all-namespaces", "--grace-period=1", "--wait=false")
        end = time.monotonic() + timeout
        while time.monotonic() < end and self._running_sandboxes():
            time.sleep(1)

    def _running_sandboxes(self) -> list[str]:
        res = self.ctr("tasks", "ls", "-q")
        return res.stdout.split() if res.returncode == 0 else []

    def _kill_containers(self) -> None:
        for task in self._running_sandboxes():
            self.ctr("tasks", "kill", "--signal=SIGKILL", task)
        time.sleep(1)
        for task in self._running_sandboxes():
            self.ctr("tasks", "rm", "-f", task)

    # ----- status --------------------------------------------------------------------------------------
    def status_lines(self) -> tuple[list[str], bool]:
        pids = self.component_pids()
        lines = [f"{name:<30} {'pid ' + str(pid) if pid else 'not running'}" for name, pid in pids.items()]
        ok = all(pid for name, pid in pids.items() if name != "tpufinetune-operator") and self.cp.ready()
        if ok and not pids.get("tpufinetune-operator"):
            from tpuft_local import chart
            lines[list(pids).index("tpufinetune-operator")] = f"{'tpufinetune-operator':<30} {chart.describe(self)}"
        if ok:
            res = self.cp.kubectl("get", "nodes", "-o", "json")
            nodes = json.loads(res.stdout).get("items", []) if res.returncode == 0 else []
            by_pool: dict[str, list[bool]] = {}
            for n in nodes:
                pool = n["metadata"].get("labels", {}).get(pools.POOL_LABEL, "-")
                ready = any(c["type"] == "Ready" and c["status"] == "True" for c in n["status"].get("conditions", []))
                by_pool.setdefault(pool, []).append(ready)
            lines.append("node pools:")
            for pool, states in sorted(by_pool.items()):
                example = next(n for n in nodes if n["metadata"]["labels"].get(pools.POOL_LABEL) == pool)
                kind = "simulated (KWOK)" if pools.KWOK_ANNOTATION in example["metadata"].get("annotations", {}) \
                    else "real (kubelet + containerd)"
                lbl = example["metadata"]["labels"]
                shape = " ".join(x for x in (lbl.get("cloud.google.com/gke-tpu-accelerator"),
                                             lbl.get("cloud.google.com/gke-tpu-topology"),
                                             lbl.get("node.kubernetes.io/instance-type")) if x)
                lines.append(f"  {pool:<20} {sum(states)}/{len(states)} Ready  {shape}  [{kind}]")
        return lines, ok


def _comp(name: str) -> Component:
    return next(c for c in (*NODE_COMPONENTS, *ARGOCD_COMPONENTS) if c.name == name)


def _https_ok(url: str, ca: Path) -> bool:
    import ssl
    import urllib.request
    try:
        with urllib.request.urlopen(url, timeout=2, context=ssl.create_default_context(cafile=str(ca))) as r:
            return r.status == 200
    except (OSError, ValueError):
        return False


# ----- `tpuft cluster ...` ------------------------------------------------------------------------------
def add_cluster_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--state-dir", type=Path, default=None,
                        help="where the cluster keeps its state (default: ${TPUFT_HOME:-~/.tpuft}/cluster)")
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    sub.add_parser("tools", help=f"build/fetch every binary ({', '.join(TOOLS)}) into the cache; prints paths")
    up = sub.add_parser("up", help="start the local cluster (idempotent: repairs what died)")
    up.add_argument("--tpu-pool", action="append", default=[], metavar="ACCEL:TOPOLOGY[:SLICES]",
                    help="add a simulated TPU node pool (default pools: v6e:4x4:2 and tpu7x:2x2x2)")
    up.add_argument("--no-operator", action="store_true", help="leave our operator out (run it from your editor)")
    up.add_argument("--no-kueue", action="store_true",
                    help="leave Kueue out (its CRDs and queues stay if an earlier `up` installed them)")
    up.add_argument("--argocd", action=argparse.BooleanOptionalAction, default=None,
                    help="run Argo CD's application controller and repo server, Redis and a git daemon "
                         "(default: as the last `up`; its first build takes minutes)")
    up.add_argument("--operator-from-source", action="store_true",
                    help="run our operator as a host process from this checkout instead of helm-installing its image")
    down = sub.add_parser("down", help="stop everything and undo the host changes")
    down.add_argument("--keep-packages", action="store_true", help="leave the Debian packages `up` installed")
    down.add_argument("--purge", action="store_true", help="also delete the cluster's state (etcd data, certs)")
    sub.add_parser("status", help="each component and node pool (exit 0 if ready)")
    sub.add_parser("kubeconfig", help="print the kubeconfig path")
    sub.add_parser("env", help="print `export KUBECONFIG=...; export PATH=...` for eval (and, once `up` ran "
                               "the GCS stand-ins, CLOUD_STORAGE_EMULATOR_ENDPOINT and GCE_METADATA_ROOT)")
    path = sub.add_parser("path", help="print the path of a tool's binary (building it if needed)")
    path.add_argument("tool", choices=TOOLS)
    kubectl = sub.add_parser("kubectl", help="run kubectl against it: tpuft cluster kubectl -- get tft -A")
    kubectl.add_argument("args", nargs=argparse.REMAINDER)


def _pools(args) -> tuple:
    extra = tuple(pools.TpuPool.parse(p) for p in getattr(args, "tpu_pool", []))
    return pools.DEFAULT_POOLS + tuple(p for p in extra if p not in pools.DEFAULT_POOLS)


def run_cluster(args: argparse.Namespace) -> int:
    try:
        mode = "none" if getattr(args, "no_operator", False) else (
            "source" if getattr(args, "operator_from_source", False) else "helm")
        kueue = (not args.no_kueue) if args.action == "up" else None
        cl = LocalCluster(args.state_dir, tpu_pools=_pools(args), operator=mode, kueue=kueue,
                          argocd=getattr(args, "argocd", None))
        if args.action == "tools":
            for tool, path in ensure_tools(TOOLS).items():
                print(f"{tool:<24} {VERSIONS[tool]:<8} {path}")
        elif args.action == "up":
            cl.up()
            print(f"kubeconfig: {cl.kubeconfig}\n"
                  f'  eval "$(tpuft cluster env)"   # KUBECONFIG, kubectl/helm on PATH, gs:// to the GCS stand-in\n'
                  f"  tpuft cluster status          # components and node pools\n"
                  f"  tpuft cluster down            # stop it and undo the host changes")
        elif args.action == "down":
            for line in cl.down(keep_packages=args.keep_packages, purge=args.purge):
                say(line)
        elif args.action == "status":
            lines, ok = cl.status_lines()
            print("\n".join(lines))
            print(f"{'ready' if ok else 'NOT ready'} (state: {cl.state})")
            return 0 if ok else 1
        elif args.action == "kubeconfig":
            print(cl.kubeconfig)
            if not cl.kubeconfig.exists():
                say("no kubeconfig yet: run `tpuft cluster up`")
                return 1
        elif args.action == "env":
            dirs = [os.path.dirname(tool_path("kubectl"))]
            if os.access(cached_path("helm"), os.X_OK):
                dirs.append(str(cached_path("helm").parent))
            print(f"export KUBECONFIG={cl.kubeconfig}\nexport PATH={os.pathsep.join(dirs)}:$PATH")
            for name, value in cl.laptop_gcs_env().items():
                print(f"export {name}={value}")
        elif args.action == "path":
            print(tool_path(args.tool))
        elif args.action == "kubectl":
            rest = args.args[1:] if args.args[:1] == ["--"] else args.args
            return subprocess.run([tool_path("kubectl"), *rest], env=cl.cp.env()).returncode
        return 0
    except (ToolchainError, ControlPlaneError, ClusterError, host.HostError, NetworkError, ValueError) as e:
        print(f"tpuft cluster {args.action}: {e}", file=sys.stderr)
        return 1


add_arguments, run = add_cluster_arguments, run_cluster
