"""The sampler on the GPU: step time of the device path (one read-back, the random rows in one launch of the
sort-free sample_rows kernel) against CuPy's sorts, at Llama-3 vocabulary size.

Prints one JSON object on stdout, and nothing else there (logs go to stderr). Cases: batch 256 x 128,256
float32 logits with (a) greedy, (b) top_k=50, (c) top_k=2000 (CuPy's argpartition is a full argsort at
any k), (d) top_p=0.9 without top_k, (e) a mixed batch. For each: ms per Sampler call (read-back
included), and for top-k / top-p the ms of the sort the device path replaces (cupy.argsort of the whole
[B, V] logits); and the kernel alone per mode (`sample_rows_kernel_ms`).

    python bench/gpu_sampler.py [--batch 256] [--vocab 128256] [--iters 10]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import pagedserve.cupy_kernels  # noqa: F401  (sets OpenBLAS's environment before numpy loads it)
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import emit_json  # noqa: E402

try:  # run from a checkout without installing: the repository's folders are pagedserve's subpackages
    import pagedserve.runtime  # noqa: F401
except ImportError:
    sys.exit("bench/gpu_sampler.py: pagedserve is not importable (pip install -e . or see scripts/gpu_check.sh)")

from pagedserve.runtime.sample.sampler import Sampler  # noqa: E402
from pagedserve.runtime.sampling_params import SamplingParams  # noqa: E402


def _time(cp, fn, iters: int) -> float:
    fn()  # warm-up: kernels compiled, pools grown
    cp.cuda.Device().synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    cp.cuda.Device().synchronize()
    return (time.perf_counter() - t0) / iters * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--iters", type=int, default=10)
    args = parser.parse_args()
    emit_json(lambda: run(args))


def run(args: argparse.Namespace) -> dict:
    import cupy as cp

    from pagedserve.runtime.engine.model_runner import _DeviceArrayModule

    xp = _DeviceArrayModule(cp)
    b, v = args.batch, args.vocab
    logits = cp.asarray((np.random.default_rng(0).standard_normal((b, v)) * 3).astype(np.float32))
    cases = {
        "greedy": SamplingParams(temperature=0.0),
        "top_k_50": SamplingParams(temperature=0.8, top_k=50),
        "top_k_2000": SamplingParams(temperature=0.8, top_k=2000),
        "top_p_0.9": SamplingParams(temperature=0.8, top_p=0.9),
    }
    mixed = [cases[k] for k in cases] * (b // len(cases)) + [cases["greedy"]] * (b % len(cases))
    sampler = Sampler(0)
    results = []
    for name, params in [*((k, [p] * b) for k, p in cases.items()), ("mixed", mixed)]:
        def step(params=params):
            sampler(logits, params, [None] * b, [[]] * b, [[]] * b, xp=xp)

        results.append({"case": name, "ms_per_step": round(_time(cp, step, args.iters), 3)})
    sort_ms = _time(cp, lambda: cp.argsort(-logits, axis=1), args.iters)
    # The sort-free kernel alone (ops.sample_rows, what the Sampler launches for its random rows), per mode.
    from pagedserve.cupy_kernels.cuda import ops as cuda_ops

    u = cp.asarray(np.random.default_rng(1).random(b))
    kernel_ms = {}
    for name, (k, p, m) in {"top_k_50": (50, 1.0, 0.0), "top_k_2000": (2000, 1.0, 0.0), "top_p_0.9": (0, 0.9, 0.0),
                            "min_p_0.05": (0, 1.0, 0.05), "top_k_50_top_p_0.9_min_p_0.05": (50, 0.9, 0.05)}.items():
        row_args = [cp.full(b, val, dtype=dt) for val, dt in ((0.8, cp.float32), (k, cp.int32), (p, cp.float32),
                                                                (m, cp.float32))]
        by_value = cp.full(b, int(k > 0), dtype=cp.int32)

        def launch(row_args=row_args, by_value=by_value):
            cuda_ops.sample_rows(logits, *row_args, u, by_value)

        kernel_ms[name] = round(_time(cp, launch, args.iters), 3)
    return {
        "benchmark": "sampler_device", "batch": b, "vocab": v, "cases": results,
        "sample_rows_kernel_ms": kernel_ms,
        "full_row_argsort_ms": round(sort_ms, 3),
        "note": "random rows: one launch of the sort-free sample_rows kernel (sample_rows_kernel_ms: the kernel "
                "alone); full_row_argsort_ms is what CuPy's argpartition/sort would cost",
    }


if __name__ == "__main__":
    main()
