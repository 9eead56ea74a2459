"""`pagedserve bench <name> [args]`: run one of the repository's benchmarks (bench/<name>.py).

The benchmarks are scripts in the source checkout's bench/ folder, not part of the installed package
(they need matplotlib for their plots: `pip install -e '.[bench]'`). This module only finds the script
beside the checkout, loads it, and calls its `main(argv)`; everything after the name is the script's
own arguments (`pagedserve bench memory --help` lists them).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

BENCHMARKS = {
    "memory": "KV cache waste: contiguous reservation vs paged blocks (a simulation, no model)",
    "batching": "continuous vs static batching throughput on the same engine and model",
    "jitter": "inter-token latency of running streams when a long prompt arrives, chunked prefill on/off",
    "parallel": "peak KV blocks of n samples sharing a prompt vs n independent requests",
    "serve": "the sidecar under Poisson load: TTFT, TPOT, ITL, SLO violations, prefix case",
    "disagg": "prefill and decode instances on one core each vs one colocated instance: ITL, TTFT, KV transfer",
    "structured": "64 concurrent JSON-schema requests vs unguided: overhead, compile and mask times",
    "speculative": "decode tokens/s with n-gram and draft-model speculation vs none, copy/edit and chat",
}


def bench_dir() -> Path:
    """bench/ of the source checkout this package was installed from (editable installs)."""
    return Path(__file__).resolve().parent.parent / "bench"


def _cmd_bench(args: argparse.Namespace) -> int:
    script = bench_dir() / f"{args.name}.py"
    if not script.is_file():
        raise ValueError(f"benchmark script {script} not found: the benchmarks live in the repository's "
                         "bench/ folder; run `pagedserve bench` from an editable install (pip install -e '.[bench]')")
    folder = str(script.parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)  # the scripts import their neighbours (common, plots)
    spec = importlib.util.spec_from_file_location(f"pagedserve_bench_{args.name}", script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there while the class is built
    spec.loader.exec_module(module)
    argv = list(args.bench_args)
    if argv and argv[0] == "--":
        argv = argv[1:]
    return int(module.main(argv) or 0)


def add_bench_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the `bench` subcommand to `pagedserve`'s subparsers; it dispatches through `func`."""
    listing = "\n".join(f"  {name:<9} {text}" for name, text in BENCHMARKS.items())
    p = subparsers.add_parser(
        "bench", help="run a benchmark (prints JSON, writes bench/results/<name>.json and .png)",
        description=f"Run a benchmark of bench/.\n\n{listing}\n\nArguments after the name go to the benchmark "
                    "(e.g. --quick, --out-dir DIR, --model PATH; `pagedserve bench NAME --help`).",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("name", choices=list(BENCHMARKS), help="which benchmark")
    p.add_argument("bench_args", nargs=argparse.REMAINDER, help="the benchmark's own arguments")
    p.set_defaults(func=_cmd_bench)
    return p
