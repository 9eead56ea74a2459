"""The float16 range check run before weights are converted for the GPU.

Loaders hand the model float32 arrays (bf16 checkpoints are widened exactly, GGUF is dequantized). On
the GPU the weights are stored as float16, whose largest finite value is 65504: a bf16 or float32
weight beyond it would silently become inf and poison every logit downstream. The check turns that
into a load-time error naming the file, the tensor and its largest magnitude.

Under round-to-nearest-even a float32 value converts to a finite float16 exactly when its magnitude
is below 65520 (the midpoint between 65504 and the next step, 65536, rounds to the even side: inf).
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

FLOAT16_MAX = float(np.finfo(np.float16).max)  # 65504
# Smallest magnitude that rounds to inf in float16 (half an ulp above FLOAT16_MAX, ties to even).
FLOAT16_OVERFLOW = 65520.0


def max_abs(a: np.ndarray) -> float:
    """Largest |value| of `a` (nan if it holds a NaN) in two reductions, without an |a| temporary."""
    if a.size == 0:
        return 0.0
    hi, lo = float(np.max(a)), float(np.min(a))
    if np.isnan(hi) or np.isnan(lo):
        return float("nan")
    return max(abs(hi), abs(lo))


def check_float16_range(weights: Mapping[str, np.ndarray], source: str) -> None:
    """Raise ValueError when a floating tensor has a value that float16 cannot hold (or a NaN).

    float16 tensors (they fit by construction) and integer tensors are skipped.
    """
    for name, w in weights.items():
        w = np.asarray(w)
        if not np.issubdtype(w.dtype, np.floating) or w.dtype == np.float16:
            continue
        m = max_abs(w)
        if np.isnan(m):
            raise ValueError(f"{source}: tensor {name!r} contains NaN; it cannot be converted to float16 for the GPU")
        if m >= FLOAT16_OVERFLOW:
            raise ValueError(f"{source}: tensor {name!r} has max |value| {m:.6g}, which does not fit in float16 "
                             f"(largest finite value {FLOAT16_MAX:g}); this checkpoint cannot run in float16 on the "
                             "GPU (run it with device='cpu', which keeps float32)")
