"""Debug mode: stop a forward whose residual stream leaves float16's range.

On the GPU activations are stored as float16 (largest finite value 65504). Weights are range-checked
at load (weights_check.py), but activations are not: a checkpoint trained in bfloat16 can grow
residual values past 65504 ("massive activations" on a few channels), which become inf, then NaN in
the next RMSNorm, and the step samples garbage without any error.

With PAGEDSERVE_CHECK_ACTIVATIONS=1 (or `model.check_activations = True`) the forward checks the
residual stream after every add (two checkpoints per layer: before attention, before the MLP, and the
final norm's input) and raises NonFiniteActivationError naming the layer, the checkpoint, the first
bad token rows and the largest finite magnitude seen so far. Each check reads a flag back to the host,
a device sync, so it is for diagnosis, not serving: CUDA graphs are not captured while it is on.
`LlamaForCausalLM.activation_peaks` then holds the largest |residual| per checkpoint of the last
forward, which shows how close a checkpoint comes to the limit (see docs/gpu.md).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from pagedserve.cupy_kernels.backend import to_host

FLOAT16_MAX = float(np.finfo(np.float16).max)


class NonFiniteActivationError(FloatingPointError):
    """The residual stream holds inf or NaN (float16 overflow on the GPU, or a poisoned input)."""


def enabled_by_env() -> bool:
    return os.environ.get("PAGEDSERVE_CHECK_ACTIVATIONS", "0") not in ("", "0", "false", "no", "off")


def check_residual(residual: Any, xp: Any, checkpoint: str, peaks: dict[str, float]) -> None:
    """Raise NonFiniteActivationError unless every value of `residual` [T, hidden] is finite; record its
    largest magnitude under `checkpoint`."""
    finite_rows = to_host(xp.isfinite(residual).all(axis=-1))
    if not finite_rows.all():
        bad = np.flatnonzero(~finite_rows)
        worst = max(peaks.values(), default=0.0)
        dtype = np.dtype(residual.dtype)
        hint = (f" float16 overflows above {FLOAT16_MAX:g}: this checkpoint's activations do not fit float16 "
                "(run it on the CPU backend in float32, or use a float16-safe checkpoint; see docs/gpu.md)"
                if dtype == np.float16 else "")
        raise NonFiniteActivationError(
            f"{checkpoint}: the residual stream holds inf/NaN in {bad.size} token row(s), first {bad[:8].tolist()}; "
            f"largest finite |residual| before it: {worst:g} ({dtype}).{hint}")
    peaks[checkpoint] = float(to_host(xp.abs(residual).max())) if residual.size else 0.0
