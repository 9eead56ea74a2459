"""The model's LoRA slots: every resident adapter's A and B stacked per layer and fused projection, and the hook
the forward calls at its linear layers (models/llama.py) on steps that carry adapter rows.

The model fuses q/k/v into one qkv matmul and gate/up into one gate_up (llama.py), so a slot holds each fused
projection's parts side by side: their A rows stacked, their B block-diagonal. With R = max_lora_rank:

    qkv      A [L, 3R, hidden]           rows 0..R-1 q's A, R..2R-1 k's, 2R..3R-1 v's (zero past the rank)
             B [L, 3R, q + 2kv]          B transposed: q's in rows 0..R-1 x columns 0..q-1, k's and v's after
    o_proj   A [L, R, q]      B [L, R, hidden]
    gate_up  A [L, 2R, hidden]  B [L, 2R, 2I]
    down     A [L, R, I]      B [L, R, hidden]

so one shrink and one expand (cupy_kernels/reference/lora.py) per fused projection serve every adapter of the
step, whatever modules each one targets (a module it leaves alone is zeros: its delta is 0). `ranks[layer]
[fused]` ([L, parts] int32: each slot's rank in each part, 0 where it does not target it) and `bounds[fused]`
(the parts' output columns) let the compiled sets skip those zeros and the padding past an adapter's rank. The
slot's scale (lora_alpha / r, or / sqrt(r)) multiplies in the expand. A step without adapter rows never calls in
here.

Under tensor parallelism (models/tensor_parallel.py) A and B are sharded like the layer they attach to: a
column-parallel projection (qkv, gate_up) keeps its rank's rows of B (A whole); a row-parallel one (o_proj,
down) its rank's columns of A (B whole), so each rank adds a partial delta that the layer's all-reduce sums.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .config import ModelConfig
from .loading.peft import LoRAAdapter, module_shape
from .tensor_parallel import TPShard
from .workspace import out_kw

# Fused projection -> its PEFT parts, in the order of the fused weight's rows (models/llama.py _layer).
FUSED = {"qkv": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",), "gate_up": ("gate_proj", "up_proj"),
         "down": ("down_proj",)}
_PART = {part: (fused, k) for fused, parts in FUSED.items() for k, part in enumerate(parts)}


def rank_slices(config: ModelConfig, shard: TPShard) -> dict[str, tuple[slice, slice]]:
    """PEFT module -> (rows of B, columns of A) this rank holds: the rows of its output, the columns of its input."""
    d, everything = config.head_dim, slice(None)
    h0, hn = shard.heads(config)
    k0, kn = shard.kv_heads(config)
    i0, i_n = shard.intermediate(config)
    q, kv, mlp = slice(h0 * d, (h0 + hn) * d), slice(k0 * d, (k0 + kn) * d), slice(i0, i0 + i_n)
    return {"q_proj": (q, everything), "k_proj": (kv, everything), "v_proj": (kv, everything),
            "o_proj": (everything, q), "gate_proj": (mlp, everything), "up_proj": (mlp, everything),
            "down_proj": (everything, mlp)}


def _shape_on_rank(config: ModelConfig, shard: TPShard, module: str) -> tuple[int, int]:
    out, inp = module_shape(config, module)
    rows, cols = rank_slices(config, shard)[module]
    return len(range(out)[rows]), len(range(inp)[cols])


class LoRASlots:
    """`max_loras` execution slots of adapters of rank <= `max_lora_rank`, float32 host arrays (this rank's
    slices under tensor parallelism)."""

    def __init__(self, config: ModelConfig, max_loras: int, max_lora_rank: int, shard: TPShard | None = None,
                 backend: Any = None) -> None:
        self.config, self.max_loras, self.max_lora_rank = config, max_loras, max_lora_rank
        self.shard = shard or TPShard()
        # The model's array module and dtype (GPU: device arrays in the weights' dtype, as the CUDA kernels take)
        xp, dtype = (np, np.float32) if backend is None else (backend.xp, backend.dtype)
        self.xp, self.dtype = xp, dtype
        self.slices = rank_slices(config, self.shard)
        r = max_lora_rank
        self.a: list[dict[str, np.ndarray]] = []
        self.b: list[dict[str, np.ndarray]] = []
        self.ranks: list[dict[str, np.ndarray]] = []  # host int32 [L, parts], whatever the backend
        self.row_offsets: dict[str, list[int]] = {}  # fused -> each part's first output row
        for fused, parts in FUSED.items():
            outs = [_shape_on_rank(config, self.shard, p)[0] for p in parts]
            self.row_offsets[fused] = [sum(outs[:k]) for k in range(len(parts))]
        self.bounds = {fused: np.array(rows + [sum(_shape_on_rank(config, self.shard, p)[0] for p in FUSED[fused])],
                                       dtype=np.int32) for fused, rows in self.row_offsets.items()}
        for _ in range(config.num_hidden_layers):
            a, b, ranks = {}, {}, {}
            for fused, parts in FUSED.items():
                n_in = _shape_on_rank(config, self.shard, parts[0])[1]
                n_out = sum(_shape_on_rank(config, self.shard, p)[0] for p in parts)
                a[fused] = xp.zeros((max_loras, len(parts) * r, n_in), dtype=dtype)
                b[fused] = xp.zeros((max_loras, len(parts) * r, n_out), dtype=dtype)
                ranks[fused] = np.zeros((max_loras, len(parts)), dtype=np.int32)
            self.a.append(a)
            self.b.append(b)
            self.ranks.append(ranks)
        self.scale = xp.zeros(max_loras, dtype=np.float32)

    @property
    def nbytes(self) -> int:
        return sum(x.nbytes for layer in self.a + self.b for x in layer.values()) + self.scale.nbytes

    def clear(self, slot: int) -> None:
        for layer in self.a + self.b:
            for x in layer.values():
                x[slot] = 0.0
        for layer in self.ranks:
            for x in layer.values():
                x[slot] = 0
        self.scale[slot] = 0.0

    def set(self, slot: int, adapter: LoRAAdapter) -> None:
        """Copy `adapter` into `slot` (the previous occupant's weights are zeroed first)."""
        if adapter.rank > self.max_lora_rank:
            raise ValueError(f"LoRA adapter {adapter.path}: rank r={adapter.rank} exceeds max_lora_rank="
                             f"{self.max_lora_rank}")
        self.clear(slot)
        r, big_r = adapter.rank, self.max_lora_rank
        for (layer, module), (a, b) in adapter.weights.items():
            fused, k = _PART[module]
            rows, cols = self.slices[module]
            a, b = a[:, cols], b[rows]
            row = self.row_offsets[fused][k]
            self.a[layer][fused][slot, k * big_r:k * big_r + r] = self._put(a)
            self.b[layer][fused][slot, k * big_r:k * big_r + r, row:row + b.shape[0]] = self._put(b.T)
            self.ranks[layer][fused][slot, k] = r
        self.scale[slot] = adapter.scale

    def _put(self, w: np.ndarray) -> Any:
        w = np.ascontiguousarray(w, dtype=self.dtype)
        return w if self.xp is np else self.xp.asarray(w)


class LoRAStep:
    """One step's adapter rows: each row's slot ([T] int32, -1 = base), bound to the model's slots and kernels.
    `layer(n)` gives the hook a layer's view; `rows` (the last layer's kept rows) selects the slots of a subset."""

    def __init__(self, slots: LoRASlots, row_slots: np.ndarray, ops: Any, workspace: Any = None) -> None:
        self.weights, self.row_slots, self.ops = slots, row_slots, ops
        self.workspace = workspace  # models/workspace.py: where the shrink writes on the GPU (None: it allocates)

    def layer(self, n: int) -> "LoRALayer":
        return LoRALayer(self, n)


class LoRALayer:
    def __init__(self, step: LoRAStep, n: int) -> None:
        self.step, self.n = step, n

    def add(self, fused: str, x: Any, y: Any, rows: Any = None) -> Any:
        """y += the LoRA delta of projection `fused` on input x, in place, for the rows with an adapter."""
        step = self.step
        slots = step.row_slots if rows is None else step.row_slots[rows]
        w = step.weights
        ranks = w.ranks[self.n][fused]
        a = w.a[self.n][fused]
        t = step.ops.lora_shrink(x, a, slots, ranks, **out_kw(step.workspace, "lora_t", (x.shape[0], a.shape[1]),
                                                              np.float32))
        step.ops.lora_expand(t, w.b[self.n][fused], w.scale, slots, y, ranks, w.bounds[fused])
        return y


def step_for(slots: LoRASlots | None, row_slots: Any, ops: Any, workspace: Any = None) -> LoRAStep | None:
    """The step's LoRA view, or None when the model serves no adapters or no row of the batch has one (then the
    forward runs exactly as without LoRA)."""
    if slots is None or row_slots is None:
        return None
    if type(row_slots) is np.ndarray:  # (on the GPU: the device copy device_batch.to_device made)
        row_slots = np.ascontiguousarray(row_slots, dtype=np.int32)
    return LoRAStep(slots, row_slots, ops, workspace)


def attach(model: Any, weights: dict[str, np.ndarray], max_loras: int, max_lora_rank: int) -> LoRASlots:
    """Give `model` (a LlamaForCausalLM built from `weights`) `max_loras` empty LoRA slots; ValueError where it
    cannot serve adapters. The weights stay as they are: a step without adapter rows runs exactly as without LoRA
    (the numba set's gate_up keeps its fused SiLU), one with adapter rows multiplies the same gated panels plainly
    (ops.linear) and adds the gate and up deltas before silu_and_mul."""
    from .gemma3 import Gemma3ForCausalLM
    from .llama import LlamaForCausalLM

    ops = model.backend.ops
    if ops.lora_shrink is None or ops.lora_expand is None:
        raise ValueError(f"enable_lora: the {ops.name} kernel set has no LoRA kernels")
    kind = type(model)
    served = [(c.forward, c._mlp) for c in (LlamaForCausalLM, Gemma3ForCausalLM)]  # forwards with the LoRA hook
    if (kind.forward, kind._mlp) not in served or kind._attention is not LlamaForCausalLM._attention:
        raise ValueError(f"enable_lora: {model.config.architecture} models are not served with adapters yet "
                         f"(Llama-family and Gemma 3 blocks only)")
    if isinstance(max_loras, bool) or not isinstance(max_loras, int) or max_loras < 1:
        raise ValueError(f"max_loras must be a positive integer, got {max_loras!r}")
    if isinstance(max_lora_rank, bool) or not isinstance(max_lora_rank, int) or max_lora_rank < 1:
        raise ValueError(f"max_lora_rank must be a positive integer, got {max_lora_rank!r}")
    model.lora = LoRASlots(model.config, max_loras, max_lora_rank, model.shard, model.backend)
    if not model.backend.is_gpu:  # compile (or load) the CPU set's kernels now, not in the first adapter's request
        a, b, ranks = (model.lora.a[0]["o_proj"], model.lora.b[0]["o_proj"], model.lora.ranks[0]["o_proj"])
        slot = np.zeros(1, dtype=np.int32)
        t = ops.lora_shrink(np.zeros((1, a.shape[2]), dtype=np.float32), a, slot, ranks)
        ops.lora_expand(t, b, model.lora.scale, slot, np.zeros((1, b.shape[2]), dtype=np.float32), ranks,
                        model.lora.bounds["o_proj"])
    return model.lora
