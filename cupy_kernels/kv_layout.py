"""The KV pool's element layout (`kv_cache_dtype`, vLLM's names), described once: the pool allocates by it, the
memory budget counts its bytes, and every kernel set reads the dtype back from the cache arrays it is handed.

    kv_cache_dtype   stored as (array dtype)        bytes a value   scales
    float32          float32                        4               none
    float16          float16 (IEEE binary16)        2               none
    bfloat16         uint16: the float32's high     2               none
                     half, rounded to nearest even
    int8             int8, each row of head_dim     1 (+ 4 a row)   one float32 per token and kv head:
                     values followed by its scale's                   amax / 127 of the row
                     4 bytes: [..., head_dim + 4]
    fp8_e4m3,        ml_dtypes' float8_e4m3fn /     1 (+ 4 a row)   as int8's: s = max|x| / 448 (e4m3) or
    fp8_e5m2         float8_e5m2, rows as int8's                      / 57344 (e5m2), the largest finite value

A cache array's dtype says what it holds (uint16 is bfloat16's bits, int8 the scaled rows: no kernel set keeps
anything else in them), so the kernels' signatures stay the numpy reference's and a layout never needs to travel
beside the arrays. "auto" is float32 on the CPU and float16 on the GPU, by the evidence at AUTO_KV_CACHE_DTYPE.

int8's scale is per token and kv head, stored at the end of the row it scales: a fused cache write holds exactly
that row (a per-block scale would change as the block fills, and rewriting the earlier rows would break a shared
block's copy), the scale factors out of attention's dot products (one multiply a key's score, one a key's weight),
and because it lives inside the block's own bytes, copy-on-write, prefix caching, eviction, preemption and
transfer move it with the values by construction.
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

# vLLM's names; "fp8" is vLLM's alias of fp8_e4m3.
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "int8", "fp8_e4m3", "fp8_e5m2")
_ALIASES = {"fp8": "fp8_e4m3"}
_STORAGE = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16), "bfloat16": np.dtype(np.uint16),
            "int8": np.dtype(np.int8), "fp8_e4m3": np.dtype(ml_dtypes.float8_e4m3fn),
            "fp8_e5m2": np.dtype(ml_dtypes.float8_e5m2)}
# The 8-bit dtypes: one float32 scale per token and kv head, stored after the row it scales.
_SCALED = ("int8", "fp8_e4m3", "fp8_e5m2")
SCALED_STORAGE = tuple(_STORAGE[name] for name in _SCALED)


@dataclass(frozen=True)
class KVCacheLayout:
    """One KV dtype's layout: what a value is stored as and what a token of one kv head costs in bytes."""

    dtype: str  # the resolved kv_cache_dtype (never "auto")
    requested: str  # what was asked for ("auto", or the same as dtype; "fp8" comes back as fp8_e4m3)

    @property
    def storage(self) -> np.dtype:
        """The cache arrays' numpy dtype."""
        return _STORAGE[self.dtype]

    @property
    def element_bytes(self) -> int:
        return self.storage.itemsize

    @property
    def scale_granularity(self) -> str | None:
        """None (no scales), or "token_head": one float32 scale per token and kv head beside its values."""
        return "token_head" if self.dtype in _SCALED else None

    def bytes_per_token_head(self, head_dim: int) -> int:
        """One token's K (or V) of one kv head, its scale included."""
        return head_dim * self.element_bytes + (4 if self.scale_granularity else 0)

    def row_elements(self, head_dim: int) -> int:
        """Elements of the cache arrays' last axis: head_dim, and 4 more int8 for a row's scale."""
        return row_elements(self.storage, head_dim)

    def describe(self) -> str:
        """For logs: "bfloat16", or "float32 (auto)"."""
        return self.dtype if self.requested == self.dtype else f"{self.dtype} ({self.requested})"


def normalize_kv_cache_dtype(value: object) -> str:
    """The canonical name of `value` (the alias "fp8" is fp8_e4m3); ValueError naming the field, the value and the
    choices for anything else."""
    if isinstance(value, str) and value.strip().lower() in _ALIASES:
        return _ALIASES[value.strip().lower()]
    if not isinstance(value, str) or value.strip().lower() not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)} (or fp8 = fp8_e4m3), "
                         f"got {value!r}")
    return value.strip().lower()


# What "auto" resolves to on a backend of each storage dtype, by evidence (issue 64; docs/benchmarks.md, "KV cache
# dtypes"). The rule: a CPU pool stays float32 until a 16-bit pool is measured faster than float32 in an interleaved
# A/B on a quiet host. It was not: bench/throughput.py, 64 requests x (128 + 128) tokens, the numba set, AVX-512,
# the 2-core Xeon VM quiet (load 1.1-1.7), two rounds, output tok/s float32 359.3 / 381.3, bfloat16 348.8 / 352.2,
# float16 332.1 / 335.0 (a 16-bit pool's cache write is a serial pass instead of the fused GEMM-tile write, and a
# step with a long prefill chunk reads it through the numpy reference). And 16 bits cost what float32 does not:
# bench/kv_quality.py, 64 prompts, SmolLM2-135M x 128 tokens bfloat16 62/64 and float16 63/64 greedy runs identical,
# Gemma 3 270M x 32 tokens 60/64 and 63/64, every divergence at a float32 top-2 margin under 0.03 nats, perplexity
# within 0.01%. Ask for bfloat16 or float16 for twice the context in the same memory. A GPU pool is float16, the CUDA
# kernels' native (and only) dtype.
AUTO_KV_CACHE_DTYPE = {np.dtype(np.float32): "float32", np.dtype(np.float16): "float16"}


def kv_cache_layout(value: object, backend_dtype: np.dtype) -> KVCacheLayout:
    """The layout `value` asks for on a backend whose storage dtype is `backend_dtype` ("auto": AUTO_KV_CACHE_DTYPE)."""
    name = normalize_kv_cache_dtype(value)
    if name == "auto":
        return KVCacheLayout(AUTO_KV_CACHE_DTYPE[np.dtype(backend_dtype)], "auto")
    return KVCacheLayout(name, name)


def row_elements(storage: object, head_dim: int) -> int:
    """The last axis of a cache of `storage` dtype for `head_dim` values (int8: 4 more, the row's float32 scale)."""
    return head_dim + 4 if np.dtype(storage) in SCALED_STORAGE else head_dim


def head_dim_of(cache: object) -> int:
    """The values a cache row holds (its last axis, less an 8-bit row's scale; a uint8 array is a CuPy fp8 cache,
    CuPy having no fp8 dtype: cupy_kernels/cuda/kv_types.cuh)."""
    last = int(getattr(cache, "shape")[-1])
    dtype = np.dtype(getattr(cache, "dtype"))
    return last - 4 if dtype in SCALED_STORAGE or dtype == np.uint8 else last


def layout_of_array(a: object) -> str:
    """The kv_cache_dtype a cache array holds, from its dtype (uint16: bfloat16's bits)."""
    dtype = np.dtype(getattr(a, "dtype"))
    for name, storage in _STORAGE.items():
        if storage == dtype:
            return name
    raise ValueError(f"no KV cache layout is stored as {dtype}")


def check_kv_cache_dtype(layout: KVCacheLayout, kernels_name: str, supported: tuple[str, ...],
                         head_dim: int | None) -> None:
    """Refuse at start a dtype the kernel set cannot run, or one whose rows the model's head_dim cannot fill
    (a 16-bit row of an odd head_dim would split its last 4-byte word: no model has one, but the kernels assume it)."""
    if layout.dtype not in supported:
        raise ValueError(f"kv_cache_dtype {layout.requested!r} ({layout.dtype}) is not supported by the "
                         f"{kernels_name} kernel set; choose one of auto, {', '.join(supported)}")
    if head_dim is not None and layout.element_bytes < 4 and head_dim % 2:
        raise ValueError(f"kv_cache_dtype {layout.dtype!r} needs an even head_dim, the model's is {head_dim}; "
                         f"choose one of {', '.join(supported)} with 4-byte values (float32)")
