"""Paged attention on the GPU: effective HBM bandwidth of decode batches, and prefill throughput.

Prints one JSON object on stdout, and nothing else there (logs go to stderr). The headline case is
Llama-3.1-8B's attention shape (32 query heads, 8 kv heads, head dim 128) for a batch of 64 decodes at a
4096-token context, block size 16: bytes moved (K and V of every context token, plus the queries and
outputs) / kernel time, as a share of the H200's 4.8 TB/s. Batch metadata lives on the device (no host
copies inside the timed loop), block tables are shuffled over the pool. Imports only numpy, CuPy and
pagedserve's CUDA op layer.

Prefill cases ("prefill" list): one fresh causal prompt of 2k, 4k and 8k tokens at head dims 64, 128 (32 query /
8 kv heads) and 256 (16 / 8, Gemma 3's), bf16 and fp16, each through the paged kernel (PAGEDSERVE_TC_PREFILL=0)
and the tensor-core prefill kernel (PAGEDSERVE_TC_PREFILL=1; sm_80+), with causal
TFLOP/s (4 H D x visible keys) and the largest difference between the two paths' outputs.

    python bench/gpu_attention.py [--peak-tbps 4.8] [--iters 50] [--cases all|decode|prefill]
                                  [--prefill-lengths 2048,4096,8192]

Without CuPy or a CUDA device it exits with status 2 and a one-line reason on stderr (stdout empty).
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import pagedserve.cupy_kernels  # noqa: F401  (sets OpenBLAS's environment before numpy loads it)
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import emit_json, gpu_seconds  # noqa: E402

try:  # run from a checkout without installing: the repository's folders are pagedserve's subpackages
    import pagedserve.cupy_kernels  # noqa: F401
except ImportError:
    sys.exit("bench/gpu_attention.py: pagedserve is not importable (pip install -e . or see scripts/gpu_check.sh)")

from pagedserve.cupy_kernels.cuda import attention as cuda_attention  # noqa: E402
from pagedserve.cupy_kernels.cuda import ops as cuda_ops  # noqa: E402
from pagedserve.cupy_kernels.kernel_set import cuda_kernels  # noqa: E402

paged_attention = cuda_kernels().paged_attention  # the CUDA op table: device arrays only

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128  # Llama-3.1-8B


def _case(cp, name: str, specs: list[tuple[int, int]], block_size: int, iters: int, peak_tbps: float) -> dict:
    """specs: (seq_len, num_new_tokens) per sequence."""
    rng = np.random.default_rng(0)
    lens = np.array([s for s, _ in specs], dtype=np.int32)
    news = np.array([n for _, n in specs], dtype=np.int64)
    qsl = np.concatenate([[0], np.cumsum(news)]).astype(np.int32)
    needed = -(-lens // block_size)
    num_blocks = int(needed.sum())
    perm = rng.permutation(num_blocks).astype(np.int32)
    tables = np.zeros((len(specs), int(needed.max())), dtype=np.int32)
    at = 0
    for i, nb in enumerate(needed):
        tables[i, :nb] = perm[at: at + nb]
        at += nb
    shape = (num_blocks, block_size, KV_HEADS, HEAD_DIM)
    k = cp.random.standard_normal(shape, dtype=cp.float32).astype(cp.float16)
    v = cp.random.standard_normal(shape, dtype=cp.float32).astype(cp.float16)
    num_tokens = int(qsl[-1])
    q = cp.random.standard_normal((num_tokens, HEADS, HEAD_DIM), dtype=cp.float32).astype(cp.float16)
    meta = [cp.asarray(qsl), cp.asarray(lens), cp.asarray(tables)]
    scale = HEAD_DIM ** -0.5
    seconds, out = gpu_seconds(cp, lambda: paged_attention(q, k, v, *meta, scale), iters, warmup=3)
    assert bool(cp.isfinite(out).all())
    kv_bytes = 2 * int(lens.sum()) * KV_HEADS * HEAD_DIM * 2
    qo_bytes = 2 * num_tokens * HEADS * HEAD_DIM * 2
    # Causal attention work: each query token sees its position + 1 keys.
    visible = sum(int(s) * n - n * (n - 1) // 2 for s, n in zip(lens, news))
    flops = 4 * HEADS * HEAD_DIM * visible  # QK^T and PV, 2 flops per multiply-add
    tbps = (kv_bytes + qo_bytes) / seconds / 1e12
    return {
        "case": name, "num_seqs": len(specs), "num_tokens": num_tokens, "max_seq_len": int(lens.max()),
        "block_size": block_size, "time_us": round(seconds * 1e6, 2), "kv_bytes": kv_bytes,
        "effective_tbps": round(tbps, 3), "pct_of_peak_bandwidth": round(100 * tbps / peak_tbps, 1),
        "tflops": round(flops / seconds / 1e12, 2),
        "partitions_per_long_decode": math.ceil(int(lens.max()) / cuda_ops.PARTITION_SIZE),
    }


# Prefill shapes by head dim: (query heads, kv heads). 64 and 128: Llama-style 32 / 8; 256: Gemma 3 12B's 16 / 8.
PREFILL_HEADS = {64: (32, 8), 128: (32, 8), 256: (16, 8)}
PREFILL_DTYPES = ("bf16", "fp16")


def _to_dtype(cp, x, dtype: str):
    """float32 device array -> float16, or bfloat16 bits (uint16, round to nearest even: CuPy has no bfloat16)."""
    if dtype == "fp16":
        return x.astype(cp.float16)
    u = x.view(cp.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(cp.uint16)


def _to_float32(cp, x):
    return (x.astype(cp.uint32) << 16).view(cp.float32) if x.dtype == cp.uint16 else x.astype(cp.float32)


def _prefill_case(cp, length: int, dim: int, dtype: str, block_size: int, iters: int, tc_ok: bool) -> dict:
    """One fresh causal prompt of `length` tokens: the paged kernel and the tensor-core kernel, each timed."""
    heads, kv_heads = PREFILL_HEADS[dim]
    rng = np.random.default_rng(length + dim)
    num_blocks = -(-length // block_size)
    tables = rng.permutation(num_blocks).astype(np.int32)[None, :]
    shape = (num_blocks, block_size, kv_heads, dim)
    k = _to_dtype(cp, cp.random.standard_normal(shape, dtype=cp.float32), dtype)
    v = _to_dtype(cp, cp.random.standard_normal(shape, dtype=cp.float32), dtype)
    q = _to_dtype(cp, cp.random.standard_normal((length, heads, dim), dtype=cp.float32), dtype)
    meta = [cp.asarray(np.array([0, length], np.int32)), cp.asarray(np.array([length], np.int32)), cp.asarray(tables)]
    scale = dim ** -0.5
    flops = 4 * heads * dim * (length * (length + 1) // 2)
    row = {"case": f"prefill_1x{length}_d{dim}_{dtype}", "num_tokens": length, "head_dim": dim, "heads": heads,
           "kv_heads": kv_heads, "dtype": dtype, "block_size": block_size, "causal_flops": flops}
    outs = {}
    paths = [("paged", "0", dim in cuda_ops.ATTN_HEAD_DIMS), ("tensor_cores", "1", tc_ok)]
    saved = os.environ.get(cuda_attention.TC_PREFILL_ENV)
    try:
        for path, flag, supported in paths:
            if not supported:
                row[path] = {"skipped": "head dim not supported" if path == "paged" else "needs sm_80+"}
                continue
            os.environ[cuda_attention.TC_PREFILL_ENV] = flag
            # the op with the flag where it takes the head dim; prefill_attention itself (the same kernel) for 256
            fn = paged_attention if dim in cuda_ops.ATTN_HEAD_DIMS else cuda_attention.prefill_attention
            seconds, out = gpu_seconds(cp, lambda: fn(q, k, v, *meta, scale), iters)
            outs[path] = _to_float32(cp, out)
            row[path] = {"time_us": round(seconds * 1e6, 2), "tflops": round(flops / seconds / 1e12, 2),
                         "finite": bool(cp.isfinite(outs[path]).all()),
                         "entry": "paged_attention" if fn is paged_attention else "prefill_attention"}
    finally:
        if saved is None:
            os.environ.pop(cuda_attention.TC_PREFILL_ENV, None)
        else:
            os.environ[cuda_attention.TC_PREFILL_ENV] = saved
    if len(outs) == 2:
        row["max_abs_diff_tc_vs_paged"] = float(cp.abs(outs["paged"] - outs["tensor_cores"]).max())
    return row


def _no_gpu_reason() -> str | None:
    try:
        import cupy
    except Exception as e:  # ImportError, or a CuPy built for another CUDA failing to load
        return f"CuPy is not importable ({type(e).__name__}: {e})"
    try:
        if cupy.cuda.runtime.getDeviceCount() == 0:
            return "CuPy sees no CUDA device"
    except Exception as e:  # no driver
        return f"CuPy sees no CUDA device ({type(e).__name__}: {e})"
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peak-tbps", type=float, default=4.8, help="HBM bandwidth to compare against (H200: 4.8)")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--cases", choices=("all", "decode", "prefill"), default="all",
                        help="decode: the decode and mixed cases; prefill: the prefill sweep (lengths x dims x dtypes)")
    parser.add_argument("--prefill-lengths", default="2048,4096,8192", help="comma-separated prompt lengths")
    args = parser.parse_args()
    try:
        args.prefill_lengths = [int(x) for x in args.prefill_lengths.split(",") if x.strip()]
    except ValueError:
        parser.error("--prefill-lengths: comma-separated integers")
    if any(n < 2 for n in args.prefill_lengths):
        parser.error("--prefill-lengths: every length must be at least 2")
    reason = _no_gpu_reason()
    if reason is not None:
        print(f"bench/gpu_attention.py: no usable GPU: {reason}", file=sys.stderr)
        sys.exit(2)
    emit_json(lambda: run(args))


def run(args: argparse.Namespace) -> dict:
    import cupy as cp

    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.runtime.getDevice())
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    result = {"benchmark": "paged_attention", "device": name, "peak_tbps": args.peak_tbps,
              "tc_prefill_default": cuda_attention.tensor_core_prefill_enabled()}
    if args.cases in ("all", "prefill"):
        tc_ok = props["major"] >= 8
        result["prefill"] = [_prefill_case(cp, n, d, dt, 16, max(3, args.iters // 10), tc_ok)
                             for n in args.prefill_lengths for d in sorted(PREFILL_HEADS) for dt in PREFILL_DTYPES]
    if args.cases == "prefill":
        return result
    cases = [
        _case(cp, "decode_b64_ctx4096_bs16", [(4096, 1)] * 64, 16, args.iters, args.peak_tbps),
        _case(cp, "decode_b64_ctx4096_bs32", [(4096, 1)] * 64, 32, args.iters, args.peak_tbps),
        _case(cp, "decode_b256_ctx1024_bs16", [(1024, 1)] * 256, 16, args.iters, args.peak_tbps),
        _case(cp, "decode_b8_ctx32768_bs16", [(32768, 1)] * 8, 16, args.iters, args.peak_tbps),
        _case(cp, "prefill_1x2048_fresh_bs16", [(2048, 2048)], 16, max(3, args.iters // 10), args.peak_tbps),
        _case(cp, "mixed_63dec4096_1x512chunk_bs16", [(4096, 1)] * 63 + [(4096, 512)], 16, max(3, args.iters // 5),
              args.peak_tbps),
    ]
    headline = cases[0]
    result.update({
        "shape": {"heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM}, "headline_case": headline["case"],
        "headline_pct_of_peak_bandwidth": headline["pct_of_peak_bandwidth"], "cases": cases,
    })
    return result


if __name__ == "__main__":
    main()
