"""Checks of the tensor-core prefill attention (prefill_attention.cu) shared by the host-emulation tests
(tests/cupy_kernels/test_kernels_on_host.py) and the GPU tests (tests/cupy_kernels/test_prefill_tc_gpu.py).

Data is float16, or bfloat16 held as uint16 bits (CuPy has no bfloat16 dtype); the numpy reference runs in float32
on the stored values, and the kernels' results are held to the error bound of rounding P and the output to the
storage type.
"""

from __future__ import annotations

import numpy as np

from gpu_helpers import PAD_BLOCK, build_cache
from pagedserve.cupy_kernels.reference import paged_attention as pa

# Prefill chunks: fresh prompts over one and several 64-row tiles (ragged ends), chunks deep in a context, and two
# decodes whose rows the prefill kernel must leave alone.
PREFILL_SPECS = [(150, 150), (20, 1), (70, 70), (300, 45), (2, 2), (129, 129), (600, 1)]
UNIT_ROUNDOFF = {"f16": 2.0 ** -11, "bf16": 2.0 ** -8}


def bf16_bits(x) -> np.ndarray:
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)  # round to nearest even (no NaN here)


def as_kind(x, kind):
    """(storage array, its float32 values): float16, or bfloat16 bits in uint16."""
    if kind == "f16":
        stored = np.asarray(x, np.float32).astype(np.float16)
        return stored, stored.astype(np.float32)
    bits = bf16_bits(x)
    return bits, (bits.astype(np.uint32) << 16).view(np.float32)


def as_float32(stored, kind):
    return stored.astype(np.float32) if kind == "f16" else (stored.astype(np.uint32) << 16).view(np.float32)


def prefill_case(rng, specs, kind, num_kv, group, dim, block_size):
    k, v, qsl, lens, tables = build_cache(rng, specs, num_kv, dim, block_size)
    k, kf = as_kind(k.astype(np.float32), kind)
    v, vf = as_kind(v.astype(np.float32), kind)
    q, qf = as_kind(rng.standard_normal((int(qsl[-1]), num_kv * group, dim)), kind)
    return (q, k, v, qsl, lens, tables), (qf, kf, vf)


def check_prefill(got, floats, qsl, lens, tables, scale, kind, window=None, what="", every_row=False):
    """Rows of sequences with 2+ new tokens (every row with every_row) against the numpy reference, with the error
    bound of rounding P and the output to the storage type: |err| <= 2u (sum p|v| / l + |o|) (u: the type's unit
    roundoff)."""
    qf, kf, vf = floats
    tables = np.where(tables == PAD_BLOCK, 0, tables)
    ref = pa.paged_attention(qf, kf, vf, qsl, lens, tables, scale, sliding_window=window)
    ref_abs = pa.paged_attention(qf, kf, np.abs(vf), qsl, lens, tables, scale, sliding_window=window)
    rows = np.concatenate([np.arange(qsl[i], qsl[i + 1]) for i in range(len(lens))
                           if every_row or qsl[i + 1] - qsl[i] > 1])
    err = np.abs(got[rows].astype(np.float64) - ref[rows])
    bound = 2 * UNIT_ROUNDOFF[kind] * (ref_abs[rows] + np.abs(ref[rows])) + 1e-6
    assert np.all(err <= bound), f"{what}: worst {err.max():.3g}, {(err / bound).max():.2f} x the bound"
    return rows
