"""Where a forward's activations go: named device buffers that stay put from step to step (a decode graph's).

A CUDA graph records pointers, so every array its forward writes must exist before the capture and never move:
a pool allocation inside a capture comes from the graph's private pool (cuda_graphs.py), and a CuPy array
expression costs ~40 us of Python on the device's host. DecodeGraphs hands the captured forward one Workspace
(ForwardBatch.workspace), filled by one eager forward at the largest batch and table width and then frozen; every
op of the forward writes into its buffers through `out=` (outputs) or `workspace=` (an op's own scratch), so the
capture allocates nothing. Each name is one flat buffer; a step takes a view of its first rows. Every graph shares
them (replays are serialised on one stream), and so does every layer: a name is rewritten only after the op that
reads it has run, in stream order.

    name                 [rows, ...]            written by                        read by
    residual             [T, hidden]            embedding, add_rms_norm (in place) the next add_rms_norm
    normed               [T, hidden]            add_rms_norm / rms_norm           qkv, gate_up, lm_head
    qkv                  [T, (H + 2 KV) D]      linear                            rotary_and_cache
    query                [T, H, D]              rotary_and_cache                  paged_attention
    attention            [T, H, D]              paged_attention                   o_proj
    hidden               [T, hidden]            o_proj, down                      add_rms_norm
    gate_up, act         [T, 2I], [T, I]        linear, silu_and_mul              silu_and_mul, down
    logits_storage       [N, V] (model dtype)   lm_head                           to_float32
    logits               [N, V] float32         to_float32                        the sampler (DecodeGraphs.logits)
    rope_cos, rope_sin   [T, D / 2] float32     rope_cos_sin                      rotary_and_cache
    (ops' scratch)       rotary_key, attention_partials

Eager steps run without one (ForwardBatch.workspace None): each op allocates its outputs, as before. So do the
numpy and numba kernel sets, which DecodeGraphs never gives one.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np


class Workspace:
    """Named flat buffers on one array module; `take` gives a view shaped for this step."""

    def __init__(self, xp: Any) -> None:
        self.xp = xp
        self.buffers: dict[str, Any] = {}
        self.frozen = False  # after the sizing run: a buffer that would have to grow raises instead

    def take(self, name: str, shape: tuple[int, ...], dtype: Any) -> Any:
        """A C-contiguous `shape` view of buffer `name` (made, or grown, unless frozen)."""
        dtype = np.dtype(dtype)
        n = math.prod(shape)
        buf = self.buffers.get(name)
        if buf is None or buf.dtype != dtype or buf.size < n:
            if self.frozen:  # a graph captured already holds the old pointer
                had = "none" if buf is None else f"{buf.size} x {buf.dtype}"
                raise RuntimeError(f"workspace buffer {name!r}: {n} x {dtype} needed after the workspace was frozen "
                                   f"(it holds {had}); the sizing run must cover every captured shape")
            buf = self.buffers[name] = self.xp.empty(max(1, n), dtype=dtype)
        return buf[:n].reshape(shape)

    def out(self, name: str, shape: tuple[int, ...], dtype: Any) -> dict[str, Any]:
        """{"out": take(...)} for an op's keyword arguments."""
        return {"out": self.take(name, shape, dtype)}

    @property
    def nbytes(self) -> int:
        return sum(int(b.nbytes) for b in self.buffers.values())


def takes_workspace(backend: Any) -> bool:
    """Whether the backend's kernel set writes into given buffers (`out=`, `workspace=`): the CUDA set's."""
    return bool(backend.is_gpu) and getattr(backend.ops, "name", None) == "cuda"


def out_kw(workspace: Workspace | None, name: str, shape: tuple[int, ...], dtype: Any) -> dict[str, Any]:
    """An op's `out=` from the workspace, or nothing (the op allocates) without one."""
    return {} if workspace is None else workspace.out(name, shape, dtype)


def scratch_kw(workspace: Workspace | None) -> dict[str, Any]:
    """An op's `workspace=` for its own scratch, or nothing without one."""
    return {} if workspace is None else {"workspace": workspace}
