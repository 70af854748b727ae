"""`tpuft`: the command line. Each subcommand lives in the module that owns the concept;
this file only wires argparse to them, importing lazily so `tpuft topology` stays fast."""
from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> (module, help). Each module defines `add_arguments(parser)` and `run(args) -> int`.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "topology": ("tpuft.cli_core", "print the slice facts for an accelerator and topology as JSON"),
    "validate": ("tpuft.cli_core", "validate TPUFinetune manifests; list every problem by field path"),
    "render": ("tpuft.cli_core", "print the RayCluster and RayJobs a TPUFinetune becomes"),
    "cluster": ("tpuft.controlplane", "a real local kube-apiserver + etcd: tools|up|down|status|kubeconfig"),
    "demo": ("tpuft.demo", "run the whole system locally on the CPU example"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tpuft", description="TPUFinetune operator tools")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        mod = importlib.import_module(module)
        getattr(mod, f"add_{name}_arguments", mod.__dict__.get("add_arguments"))(p)
        p.set_defaults(_module=module, _name=name)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    mod = importlib.import_module(args._module)
    runner = getattr(mod, f"run_{args._name}", None) or getattr(mod, "run")
    try:
        return int(runner(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
