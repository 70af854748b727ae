"""Benchmark: the held-out ~1B LoRA run in real worker pods, each pod's memory as the kubelet and
Ray's memory monitor count it.

bench/sharded_load.py's synthetic Llama (default 1.1B parameters, TinyLlama's shape, random
weights) saved once in fp32 on the run's storage path with the built-in tokenizer, then trained
through `tpuft demo --example` on the local cluster (`tpuft cluster up`): LoRA (rank 8, alpha 16),
2 CPU workers, batch 4 x 128 tokens, --steps optimizer steps, the worker pods' memory limit
--memory, spec.training.activationCheckpointing left out (the workers decide it), no verification
and no serving. While it runs, each KubeRay pod's memory cgroup on the host (cgroup v1,
kubepods/.../pod<uid>) is read every --interval seconds:
  usage        memory.usage_in_bytes (page cache included; the kernel kills at the limit)
  working set  usage - inactive_file (the kubelet's eviction figure)
  Ray's used   usage - inactive_file - active_file (Ray 2.60's memory monitor: it kills a worker
               at 95% of the limit)
and each process in the pod (RssAnon from /proc: its own memory, not the shared libraries'
pages), grouped by what it is (the training worker, raylet, Ray's agents, ...). Per worker pod:
the peak of each figure, the kernel's max_usage, and at Ray's used's peak the training process's
share and the rest. tpuft.api.model_sizes' prediction for the same run is printed beside it.

    .venv/bin/python bench/sharded_load_pods.py [--memory 4Gi] [--steps 2] [--hidden 2048 --layers 22]

Needs the local cluster and root (the host's cgroups). The model (4.1 GiB at the default size) is
written once under --storage; the TPUFinetune is deleted at the end. Writes
bench/results/sharded_load_pods.json by default.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "bench" / "results" / "sharded_load_pods.json"
NAME = "bench-1b-lora"
KUBEPODS = Path("/sys/fs/cgroup/memory/kubepods")
RAY_KILL_FRACTION = 0.95   # Ray 2.60's memory_usage_threshold default
MIB = 2 ** 20
START = time.monotonic()


def say(msg: str) -> None:
    print(f"[sharded_load_pods] {msg}", file=sys.stderr, flush=True)


def prepare_model(storage: Path, hidden: int, layers: int) -> Path:
    """The synthetic model in fp32 with the built-in tokenizer, readable by the pods' user (written once)."""
    sys.path.insert(0, str(REPO / "bench"))
    import sharded_load

    from tpuft_workload import tiny

    folder = storage / f"llama-h{hidden}-l{layers}-float32"
    sharded_load.save_model(folder, hidden, layers, "float32")
    if not (folder / "tokenizer.json").exists():
        tiny.build_tokenizer().save_pretrained(folder)
    for f in folder.iterdir():
        f.chmod(0o644)   # safetensors are written 0600; the Ray pods run as another user
    sharded_load._drop_file_cache(folder)   # read cold, as a fresh pod does, charged to the pods that read
    return folder


def manifest(model: Path, storage: Path, memory: str, steps: int, batch: int, seq: int,
             env: dict[str, str] | None = None) -> dict:
    """examples/local-cpu-lora.yaml's run on `model`, `steps` steps, no verification, no serving."""
    doc = yaml.safe_load((REPO / "examples" / "local-cpu-lora.yaml").read_text())
    doc["metadata"] = {"name": NAME}
    spec = doc["spec"]
    spec["model"] = str(model)
    spec["dataset"] = {"name": "builtin:dolly-mini", "split": "train"}
    spec["training"].update(epochs=1, batchSizePerDevice=batch, maxSeqLength=seq, maxSteps=steps,
                            reportEverySteps=1)
    spec["training"].pop("activationCheckpointing", None)   # left out: the workers decide
    spec["checkpoint"] = {"storagePath": str(storage), "everySteps": 1000, "keep": 1,
                          "volume": {"hostPath": {"path": str(storage), "type": "DirectoryOrCreate"}}}
    spec["resources"]["worker"]["limits"]["memory"] = memory
    spec["verification"] = {"enabled": False}
    spec["serve"] = {"enabled": False}
    if env:
        spec["env"] = [{"name": k, "value": v} for k, v in env.items()]
    return doc


def process_group(cmdline: str) -> str:
    """What a process in a Ray pod is, from its command line (Ray names its workers' processes
    `ray::Class.method`)."""
    if cmdline.startswith("ray::"):
        return re.split(r"[.\s(]", cmdline, maxsplit=1)[0]
    for marker, group in (("bin/ray start", "ray start"), ("raylet", "raylet"), ("gcs_server", "gcs_server"),
                          ("dashboard/agent.py", "dashboard agent"), ("runtime_env/agent", "runtime_env agent"),
                          ("log_monitor", "log_monitor"),
                          ("dashboard.py", "dashboard"), ("monitor.py", "autoscaler monitor"),
                          ("default_worker.py", "ray worker (idle)")):
        if marker in cmdline:
            return group
    argv = cmdline.split()
    return os.path.basename(argv[0]) if argv else "?"


def _status(pid: str) -> tuple[str, dict[str, int]] | None:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        fields = {}
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("RssAnon", "RssShmem", "VmHWM", "VmRSS"):
                fields[key] = int(value.split()[0]) * 1024
        return cmdline, fields
    except OSError:   # the process ended between the listing and the read
        return None


class PodSampler:
    """One pod's cgroup and processes, sampled: each figure's peak, and the processes at the peak of
    Ray's used."""

    def __init__(self, name: str, role: str, folder: Path):
        self.name, self.role, self.folder = name, role, folder
        self.peak: dict[str, int] = {}
        self.at_ray_peak: dict = {}
        self.group_peak: dict[str, int] = {}   # each process group's largest RssAnon
        self.hwm: dict[str, int] = {}          # each group's largest VmHWM (its own peak RSS, shared pages too)
        self.limit = self.max_usage = 0
        self.samples = 0
        self.timeline: list[tuple[float, int, int]] = []   # (seconds, Ray's used, the training worker's RssAnon) in MiB
        self._next_point = 0.0

    def _pids(self) -> set[str]:
        pids: set[str] = set()
        for procs in self.folder.rglob("cgroup.procs"):
            try:
                pids.update(procs.read_text().split())
            except OSError:
                pass
        return pids

    def sample(self) -> bool:
        """One reading; False once the pod's cgroup is gone."""
        try:
            stat = dict(line.split() for line in (self.folder / "memory.stat").read_text().splitlines())
            usage = int((self.folder / "memory.usage_in_bytes").read_text())
            self.max_usage = max(self.max_usage, int((self.folder / "memory.max_usage_in_bytes").read_text()))
            self.limit = int((self.folder / "memory.limit_in_bytes").read_text())
        except (OSError, ValueError):
            return False
        inactive, active = int(stat["total_inactive_file"]), int(stat["total_active_file"])
        now = {"usage": usage, "working_set": usage - inactive, "ray_used": usage - inactive - active,
               "rss": int(stat["total_rss"]), "cache": int(stat["total_cache"]),
               "shmem": int(stat.get("total_shmem", 0))}
        groups: dict[str, int] = {}
        for pid in self._pids():
            got = _status(pid)
            if got is None:
                continue
            group = process_group(got[0])
            groups[group] = groups.get(group, 0) + got[1].get("RssAnon", 0)
            self.hwm[group] = max(self.hwm.get(group, 0), got[1].get("VmHWM", 0))
        for group, anon in groups.items():
            self.group_peak[group] = max(self.group_peak.get(group, 0), anon)
        if now["ray_used"] >= self.peak.get("ray_used", -1):
            self.at_ray_peak = {**now, "processes_rss_anon": groups}
        for key, value in now.items():
            self.peak[key] = max(self.peak.get(key, 0), value)
        self.samples += 1
        if time.monotonic() >= self._next_point:   # one point a second: the load, then each step, in the results
            self._next_point = time.monotonic() + 1
            train = sum(v for g, v in groups.items() if "TrainWorker" in g)
            self.timeline.append((round(time.monotonic() - START, 1), round(now["ray_used"] / MIB), round(train / MIB)))
        return True

    def figures(self) -> dict:
        """MiB: the peaks, and at Ray's used's peak the training worker's RssAnon and the rest."""
        at = self.at_ray_peak
        train = sum(v for g, v in at.get("processes_rss_anon", {}).items() if "TrainWorker" in g)
        others = {g: round(v / MIB) for g, v in sorted(at.get("processes_rss_anon", {}).items(), key=lambda x: -x[1])
                  if "TrainWorker" not in g}
        return {"pod": self.name, "role": self.role, "samples": self.samples, "limit_mib": round(self.limit / MIB),
                "ray_kills_at_mib": round(RAY_KILL_FRACTION * self.limit / MIB),
                "max_usage_mib": round(self.max_usage / MIB),
                "peak_mib": {k: round(v / MIB) for k, v in self.peak.items()},
                "at_ray_used_peak_mib": {
                    "ray_used": round(at.get("ray_used", 0) / MIB), "usage": round(at.get("usage", 0) / MIB),
                    "page_cache": round((at.get("usage", 0) - at.get("ray_used", 0)) / MIB),
                    "training_process": round(train / MIB),
                    "rest": round((at.get("ray_used", 0) - train) / MIB),
                    "rest_processes": others, "shmem": round(at.get("shmem", 0) / MIB)},
                "process_peak_rss_anon_mib": {g: round(v / MIB) for g, v in self.group_peak.items()},
                "process_peak_vmhwm_mib": {g: round(v / MIB) for g, v in self.hwm.items()},
                "timeline_s_rayused_train_mib": self.timeline}


def _pod_cgroup(uid: str) -> Path | None:
    for folder in (KUBEPODS / f"pod{uid}", KUBEPODS / "burstable" / f"pod{uid}", KUBEPODS / "besteffort" / f"pod{uid}"):
        if folder.is_dir():
            return folder
    return None


class Watcher:
    """Finds the namespace's KubeRay pods (kubectl, every few seconds) and samples each one's cgroup."""

    def __init__(self, kubectl: list[str], namespace: str, interval: float):
        self.kubectl, self.namespace, self.interval = kubectl, namespace, interval
        self.since = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())   # RFC 3339, as creationTimestamp
        self.pods: dict[str, PodSampler] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _discover(self) -> None:
        res = subprocess.run([*self.kubectl, "get", "pods", "-n", self.namespace, "-l", "ray.io/node-type", "-o", "json"],
                             capture_output=True, text=True, timeout=60)
        if res.returncode:
            return
        for pod in json.loads(res.stdout)["items"]:
            meta = pod["metadata"]
            if meta["uid"] in self.pods or not meta["name"].startswith(NAME) or meta["creationTimestamp"] < self.since:
                continue   # another object's pod, or an earlier run's still terminating
            folder = _pod_cgroup(meta["uid"])
            if folder is not None:
                self.pods[meta["uid"]] = PodSampler(meta["name"], meta["labels"]["ray.io/node-type"], folder)

    def _run(self) -> None:
        next_discovery = 0.0
        while not self._stop.wait(self.interval):
            if time.monotonic() >= next_discovery:
                self._discover()
                next_discovery = time.monotonic() + 3
            for sampler in list(self.pods.values()):
                sampler.sample()

    def __enter__(self) -> Watcher:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=30)


def predicted(model: Path, workers: int, memory: str, batch: int, seq: int) -> dict:
    """tpuft.api.model_sizes' training figure for this run, in MiB, with activation checkpointing
    as the workers decide it (tpuft_workload.train.recompute_for_memory's rule): the state the pod
    keeps, the step's terms, the runtime allowance (CPU_WORKER_RUNTIME_GIB) and what Ray's memory
    monitor lets the pod use."""
    from dataclasses import replace

    from tpuft.api import catalog, model_sizes
    from tpuft.api.constants import CPU_ACCELERATOR

    shape = model_sizes.shape_of(json.loads((model / "config.json").read_text()), model.name)
    assert shape is not None
    run = model_sizes.Run(method="lora", rank=8, tokens=batch * seq, pod_memory=memory)
    recompute = model_sizes.recompute_needed(shape, workers, memory, run)
    f = model_sizes.fit(shape, catalog.resolve_slice(CPU_ACCELERATOR, str(workers)),
                        replace(run, activation_checkpointing=recompute))
    assert f.step is not None
    runtime = round(model_sizes.CPU_WORKER_RUNTIME_GIB * 1024)
    return {"activation_checkpointing": recompute, "training_mib": round(f.training.need * 1024),
            "usable_mib": round(f.training.have * 1024), "fits": f.training.fits,
            "state_mib": round(f.training.need * 1024) - round(f.step.total / MIB) - runtime,
            "step_mib": {"output": round(f.step.output / MIB), "layer": round(f.step.layer / MIB),
                         "kept": round(f.step.kept / MIB), "logits": round(f.step.logits / MIB),
                         "total": round(f.step.total / MIB)},
            "runtime_allowance_mib": runtime, "parameters": shape.parameters()}


def dumps(result: dict) -> str:
    """The results file: indented JSON, each timeline point (seconds, Ray's used, training worker) on one line."""
    return re.sub(r"\[\s+(-?[\d.]+),\s+(-?[\d.]+),\s+(-?[\d.]+)\s+\]", r"[\1, \2, \3]",
                  json.dumps(result, indent=2)) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--storage", type=Path, default=Path("/var/tmp/tpuft-bench-pods"),
                   help="the run's storagePath, a hostPath the pods mount; the model is written there once "
                        "(default /var/tmp/tpuft-bench-pods)")
    p.add_argument("--hidden", type=int, default=2048, help="hidden size (default 2048: 1.1B parameters with 22 layers)")
    p.add_argument("--layers", type=int, default=22, help="decoder layers (default 22)")
    p.add_argument("--memory", default="4Gi", help="the worker pods' memory limit (default 4Gi)")
    p.add_argument("--steps", type=int, default=2, help="optimizer steps (spec.training.maxSteps; default 2)")
    p.add_argument("--batch", type=int, default=4, help="sequences a worker a step (default 4)")
    p.add_argument("--seq", type=int, default=128, help="tokens a sequence (default 128)")
    p.add_argument("--namespace", default="bench-pods", help="the demo's namespace (default bench-pods)")
    p.add_argument("--interval", type=float, default=0.25, help="seconds between cgroup readings (default 0.25; "
                   "Ray's memory monitor: 0.25)")
    p.add_argument("--timeout", type=float, default=3000, help="seconds the demo waits for a terminal phase")
    p.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                   help="spec.env for the Ray pods (e.g. RAY_TRAIN_ENABLE_PREEMPTION_WATCHER=0); repeatable")
    p.add_argument("--keep-object", action="store_true", help="leave the TPUFinetune in the namespace")
    p.add_argument("--out", type=Path, default=OUT, help=f"results JSON (default {OUT.relative_to(REPO)})")
    args = p.parse_args(argv)

    from tpuft_local import toolchain
    from tpuft_local.cluster import LocalCluster

    args.storage.mkdir(parents=True, exist_ok=True)
    args.storage.chmod(0o777)
    model = prepare_model(args.storage, args.hidden, args.layers)
    prediction = predicted(model, 2, args.memory, args.batch, args.seq)   # before the run: the code it ran beside
    example = args.storage / f"{NAME}.yaml"
    example.write_text(yaml.safe_dump(manifest(model, args.storage, args.memory, args.steps, args.batch, args.seq,
                                               dict(e.split("=", 1) for e in args.env))))
    kubectl = [toolchain.tool_path("kubectl", build=False), f"--kubeconfig={LocalCluster().kubeconfig}"]
    result = args.storage / f"{NAME}-result.json"
    result.unlink(missing_ok=True)
    command = [sys.executable, "-m", "tpuft.cli", "demo", "--example", str(example), "--namespace", args.namespace,
               "--storage-path", str(args.storage), "--result", str(result), "--timeout", str(args.timeout)]
    say(f"model {model}; running {' '.join(command)}")
    lines: list[str] = []
    start = time.monotonic()
    with Watcher(kubectl, args.namespace, args.interval) as watcher:
        with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as demo:
            assert demo.stdout is not None
            for line in demo.stdout:
                print(line, end="", flush=True)
                lines.append(line)
            code = demo.wait(timeout=60)
    seconds = round(time.monotonic() - start, 1)
    final = json.loads(result.read_text()) if result.exists() else {}
    status = (final.get("object") or {}).get("status") or {}
    if not args.keep_object:
        subprocess.run([*kubectl, "delete", "tft", NAME, "-n", args.namespace, "--ignore-not-found", "--wait=false"],
                       capture_output=True, text=True, timeout=120)
    pods = [s.figures() for s in watcher.pods.values()]
    workers = [f for f in pods if f["role"] == "worker"]
    worst = max(workers, key=lambda f: f["peak_mib"]["ray_used"]) if workers else None
    out = {"command": " ".join(["bench/sharded_load_pods.py", *(argv if argv is not None else sys.argv[1:])]),
           "model": str(model), "memory": args.memory, "steps": args.steps, "batch": args.batch, "seq": args.seq,
           "demo_exit_code": code, "seconds": seconds, "phase": status.get("phase"), "reason": status.get("reason"),
           "message": status.get("message"), "training": status.get("training"),
           "activation_checkpointing_said": any("activation checkpointing on" in line for line in lines),
           "predicted": prediction, "worst_worker": worst, "pods": pods,
           "demo_tail": "".join(lines[-40:])}
    print("\npod                                       role    limit  Ray kills  peak: usage / working set / "
          "Ray's used  max_usage  at the peak: training process / rest / page cache")
    for f in pods:
        pk, at = f["peak_mib"], f["at_ray_used_peak_mib"]
        print(f"{f['pod'][:40]:40s}  {f['role']:6s}  {f['limit_mib']:5d}  {f['ray_kills_at_mib']:9d}  "
              f"{pk.get('usage', 0):6d} / {pk.get('working_set', 0):6d} / {pk.get('ray_used', 0):6d}  "
              f"{f['max_usage_mib']:9d}  {at['training_process']:6d} / {at['rest']:6d} / {at['page_cache']:6d}")
        print(f"    rest at the peak (RssAnon, MiB): {at['rest_processes']}; shmem {at['shmem']}")
    print(f"predicted (tpuft.api.model_sizes): {prediction}")
    if worst:   # what the runtime allowance would be, were this pod the one it is measured from
        runtime = worst["peak_mib"]["ray_used"] - prediction["state_mib"] - prediction["step_mib"]["total"]
        out["measured_runtime_mib"] = runtime
        print(f"worst worker pod: Ray's used peak {worst['peak_mib']['ray_used']} MiB (predicted "
              f"{prediction['training_mib']}); less the state {prediction['state_mib']} and the step's terms "
              f"{prediction['step_mib']['total']}: a runtime of {runtime} MiB (the fit table's: "
              f"{prediction['runtime_allowance_mib']})")
    print(f"phase {status.get('phase')} ({status.get('reason')}), demo exit {code}, {seconds} s")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(dumps(out))
    print(f"wrote {args.out}")
    return 0 if status.get("phase") == "Succeeded" else 1


if __name__ == "__main__":
    sys.exit(main())
