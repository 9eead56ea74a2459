"""One layer's decode attention on the numba set over a float32, a bfloat16 and a float16 KV pool: the same
sequences, keys and queries (16-bit pools hold the float32 values rounded), block tables shuffled over the pool,
alternating dtypes each round; the median milliseconds a call. Decode attention reads every sequence's whole
context: half the bytes should show. Usage (defaults: SmolLM2's 3 kv heads x 3 query heads each of 64):

    .venv/bin/python bench/kv_attention.py [--seqs 64] [--context 1024] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import time

import pagedserve.cupy_kernels  # noqa: F401  (sets OpenBLAS's environment before numpy loads it)
import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seqs", type=int, default=64)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    from pagedserve.cupy_kernels.kernel_set import numba_code_path
    from pagedserve.cupy_kernels.numba_cpu import attention
    from pagedserve.cupy_kernels.reference.kv_convert import encode

    rng = np.random.default_rng(0)
    seqs, context, kv_heads, group, head_dim, block = args.seqs, args.context, 3, 3, 64, 16
    num_blocks = seqs * -(-context // block)
    k, v = (rng.standard_normal((num_blocks, block, kv_heads, head_dim)).astype(np.float32) for _ in range(2))
    tables = rng.permutation(num_blocks).reshape(seqs, -1).astype(np.int32)
    qsl, lens = np.arange(seqs + 1, dtype=np.int64), np.full(seqs, context, np.int64)
    q = rng.standard_normal((seqs, kv_heads * group, head_dim)).astype(np.float32)
    pools = {"float32": (k, v), "bfloat16": (encode(k, np.uint16), encode(v, np.uint16)),
             "float16": (encode(k, np.float16), encode(v, np.float16))}
    plan = attention.plan_attention(q.shape, k.shape, qsl, lens, tables)
    times: dict[str, list[float]] = {name: [] for name in pools}
    for name, (kc, vc) in pools.items():  # compile and touch the pools once
        attention.paged_attention(q, kc, vc, qsl, lens, tables, 0.125, plan=plan)
    for _ in range(args.rounds):
        for name, (kc, vc) in pools.items():
            t = time.perf_counter()
            attention.paged_attention(q, kc, vc, qsl, lens, tables, 0.125, plan=plan)
            times[name].append(time.perf_counter() - t)
    print(json.dumps({"seqs": seqs, "context": context, "numba_code_path": numba_code_path(),
                      "loadavg": open("/proc/loadavg").read().split()[:3],
                      "ms": {n: round(1e3 * float(np.median(t)), 2) for n, t in times.items()},
                      "kv_mb": {n: round(sum(a.nbytes for a in p) / 1e6) for n, p in pools.items()}}))


if __name__ == "__main__":
    main()
