"""The Llama-family decoder (Llama, Mistral, Qwen2, Phi-3) over a paged KV cache, written against the op layer.

The registry (models/registry.py) names this class for those families and holds their shape table. Qwen2
only adds q/k/v bias (Llama's attention_bias: q/k/v and o_proj bias); Phi-3's fused qkv_proj / gate_up_proj
are split at load (hf_loader) and its LongRoPE lives in rope.py; Mistral and Phi-3 may attend over a sliding
window on every layer (config.sliding_window).
Weights arrive with Hugging Face names; at construction q/k/v are fused into one matrix and gate/up into
another, so each layer does four matmuls.

Other families subclass it and override the step they change (models/qwen3.py: q/k norms before rotary;
models/gemma3.py: four norms a layer, GELU, sliding windows): `_layer` (one layer's weights), `_query`
(qkv -> rotated query, key and value cached), `_attention`, `_mlp`, `_embed`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from pagedserve.cupy_kernels.backend import Backend, get_backend
from pagedserve.cupy_kernels.collectives import SingleRank
from pagedserve.cupy_kernels.reference.quant import QuantWeight, concat_rows

from . import activation_check, lora as lora_slots
from .batch import ForwardBatch
from .config import ModelConfig
from .device_batch import to_device
from .loading.gguf_loader import quant_weight
from .registry import check_weights, expected_shapes  # the shape table lives in the registry (re-exported here)
from .rope import RotaryEmbedding
from .tensor_parallel import TPShard
from .loading.weights_check import check_float16_range
from .workspace import Workspace, out_kw, takes_workspace


@dataclass
class LayerWeights:
    input_norm: Any
    qkv: Any  # [hidden, q_size + 2 * kv_size]  (matmul weights: [in, out] arrays, or the numba set's panels)
    qkv_bias: Any | None
    o_proj: Any  # [q_size, hidden]
    post_norm: Any
    gate_up: Any  # [hidden, 2 * intermediate]
    down: Any  # [intermediate, hidden]
    # The same four weights as GGUF blocks (cupy_kernels/reference/quant.py), for the numba set's few-row matmuls;
    # None for a model without them, on the GPU, and with the numpy reference set.
    qkv_q: QuantWeight | None = None
    o_proj_q: QuantWeight | None = None
    gate_up_q: QuantWeight | None = None
    down_q: QuantWeight | None = None
    o_proj_bias: Any | None = None  # [hidden] (Llama's attention_bias), added once after the all-reduce


class LlamaForCausalLM:
    """The whole model, or with `shard` and `comm` one tensor-parallel rank of it (tensor_parallel.py):
    `weights` then hold that rank's slices, and the forward all-reduces after o_proj and down and
    gathers the logits on rank 0 (the other ranks' forward returns None)."""

    # Each layer reads and writes through its KV cache group's block tables and slots (ForwardBatch.kv_tables),
    # so the worker may give sliding-window layers a group whose out-of-window blocks are released.
    reads_kv_cache_groups = True
    # The MLP is SiLU-gated (_mlp: ops.linear_silu_and_mul), so gate_up is packed for that op (a family with
    # another activation multiplies gate_up with ops.linear and sets this False).
    silu_gated_mlp = True

    def __init__(self, config: ModelConfig, weights: dict[str, np.ndarray], backend: Backend | None = None,
                 source: str = "weights", shard: TPShard | None = None, comm: Any = None) -> None:
        self.shard = shard = shard or TPShard()
        if self.silu_gated_mlp and config.hidden_act != "silu":  # a config made by hand (the loaders refuse it)
            raise ValueError(f"{source}: hidden_act={config.hidden_act!r}: the {config.architecture} model computes "
                             f"silu")
        check_weights(config, weights, source, shard)
        self.config = config
        self.backend = backend or get_backend("cpu")
        self.comm = comm if comm is not None else SingleRank()
        if self.comm.world_size != shard.world_size:
            raise ValueError(f"a rank of {shard.world_size} got a communicator of {self.comm.world_size}")
        _, self.num_heads = shard.heads(config)
        _, self.num_kv_heads = shard.kv_heads(config)
        self.q_size, self.kv_size = self.num_heads * config.head_dim, self.num_kv_heads * config.head_dim
        self.vocab_start, self.vocab_end = shard.vocab(config)
        self.vocab_per_rank = shard.vocab_per_rank(config)
        if self.backend.dtype == np.float16:  # a value float16 cannot hold would become inf on the device
            check_float16_range({name: weights[name] for name in expected_shapes(config, shard)}, source)
        put, put_t = self._put, self._put_t
        self.embed_tokens = put(weights["model.embed_tokens.weight"])
        self.norm = put(weights["model.norm.weight"])
        # Tied: the transposed view of the embedding (no copy; BLAS reads it as a transposed operand), or the
        # numba set's panels of it (a copy: 113 MB for SmolLM2; at 64 rows 9.7 against 14.0 ms per step).
        if config.tie_word_embeddings:
            self.lm_head = self._packed(weights["model.embed_tokens.weight"])
            if self.lm_head is None:
                self.lm_head = self.embed_tokens.T
        else:
            self.lm_head = put_t(weights["lm_head.weight"])
        self.layers: list[LayerWeights] = [self._layer(n, weights) for n in range(config.num_hidden_layers)]
        self.lm_head_q = None
        if self.backend.ops.name == "numba" and not shard.is_sharded:
            self._attach_quant(weights)
        self.rope = RotaryEmbedding(config, self.backend, weights.get("rope_freqs"), file_factors={
            f"{k}_factor": weights[f"rope_factors_{k}"] for k in ("short", "long") if f"rope_factors_{k}" in weights})
        self.scale = config.head_dim ** -0.5
        self.windows = [config.layer_window(n) for n in range(config.num_hidden_layers)]
        check_sliding_window(self.backend, self.windows)
        # Debug mode (models/activation_check.py): inf/NaN in the residual stream raises, per checkpoint.
        self.check_activations = activation_check.enabled_by_env()
        self.activation_peaks: dict[str, float] = {}
        # LoRA adapters' execution slots (models/lora.py attach); None: the model serves none, and costs nothing.
        self.lora: lora_slots.LoRASlots | None = None

    def _layer(self, n: int, weights: dict[str, np.ndarray]) -> LayerWeights:
        """Layer n's weights as the backend holds them (matmuls fused: qkv, gate_up)."""
        put, put_t = self._put, self._put_t
        p = f"model.layers.{n}."
        a = p + "self_attn."
        bias = None
        if self.config.attention_bias:
            bias = put(np.concatenate([weights[a + f"{x}_proj.bias"] for x in "qkv"]))
        return LayerWeights(
            input_norm=put(weights[p + "input_layernorm.weight"]),
            qkv=put_t(*(weights[a + f"{x}_proj.weight"] for x in "qkv")),
            qkv_bias=bias,
            o_proj=put_t(weights[a + "o_proj.weight"]),
            post_norm=put(weights[p + "post_attention_layernorm.weight"]),
            gate_up=put_t(weights[p + "mlp.gate_proj.weight"], weights[p + "mlp.up_proj.weight"],
                          gated=self.silu_gated_mlp),
            down=put_t(weights[p + "mlp.down_proj.weight"]),
            o_proj_bias=put(weights[a + "o_proj.bias"]) if self.config.o_proj_bias else None,
        )

    def _attach_quant(self, weights: dict[str, np.ndarray]) -> None:
        """Keep the GGUF blocks of each matmul weight that has them (gguf_loader.quant_weight) beside the
        float32 weight; a fused weight only when all its parts have blocks of one kind."""
        def fused(*names: str) -> QuantWeight | None:
            parts = [quant_weight(weights, name) for name in names]
            if any(p is None for p in parts) or len({p.kind for p in parts}) != 1:
                return None
            return parts[0] if len(parts) == 1 else concat_rows(parts)

        head = "model.embed_tokens.weight" if self.config.tie_word_embeddings else "lm_head.weight"
        self.lm_head_q = fused(head)
        for n, layer in enumerate(self.layers):
            a, p = f"model.layers.{n}.self_attn.", f"model.layers.{n}.mlp."
            layer.qkv_q = fused(*(a + f"{x}_proj.weight" for x in "qkv"))
            layer.o_proj_q = fused(a + "o_proj.weight")
            layer.gate_up_q = fused(p + "gate_proj.weight", p + "up_proj.weight")
            layer.down_q = fused(p + "down_proj.weight")

    @property
    def quantized_matmuls(self) -> int:
        """How many of the model's matmul weights carry GGUF blocks (logged at start)."""
        ws = [self.lm_head_q] + [w for layer in self.layers
                                 for w in (layer.qkv_q, layer.o_proj_q, layer.gate_up_q, layer.down_q)]
        return sum(w is not None for w in ws)

    def _put(self, w: np.ndarray):
        """A weight as the backend holds it. Host weights are read-only views: nothing writes a weight
        after load, and one array type (read-only is part of a numba type, and the weight cache's memory
        maps are read-only) means the kernels compiled at warm-up serve every model, however it loaded."""
        a = self.backend.asarray(np.ascontiguousarray(w, dtype=self.backend.dtype))
        if isinstance(a, np.ndarray) and a.flags.writeable:
            a = a.view()
            a.flags.writeable = False
        return a

    def _packed(self, *parts: np.ndarray, gated: bool = False):
        """The numba set's column panels of a float32 [out, in] weight, or of the rows of several parts in turn
        (numba_gemm.py), or of a gated [gate, up] pair; None elsewhere."""
        if self.backend.dtype != np.float32 or self.backend.is_gpu:
            return None
        return self.backend.ops.pack_weight([np.asarray(w, dtype=np.float32) for w in parts], gated=gated)

    def _put_t(self, *parts: np.ndarray, gated: bool = False):
        """A matmul weight, [out, in] in the checkpoint (the rows of `parts` in turn: a fused qkv or gate_up),
        in the form the backend's linear takes: the numba set's panels (packed from the parts, no
        concatenated copy first), or an [in, out] array for the others. gated: a gate_up that only
        ops.linear_silu_and_mul multiplies (the numba set's panels then hold gate and up side by side)."""
        packed = self._packed(*parts, gated=gated)
        if packed is not None:
            return packed
        return self._put((parts[0] if len(parts) == 1 else np.concatenate(parts)).T)

    def _embed(self, ids: Any, workspace: Any = None) -> Any:
        ops = self.backend.ops
        if not self.shard.is_sharded:
            return ops.embedding(self.embed_tokens, ids, **out_kw(workspace, "residual", (
                ids.shape[0], self.config.hidden_size), self.backend.dtype))
        # Vocab-parallel: rows of this rank's ids, zeros for the others'; the sum over ranks is exact.
        xp = self.backend.xp
        local = ids - self.vocab_start
        inside = (local >= 0) & (local < self.vocab_end - self.vocab_start)
        if self.vocab_end > self.vocab_start:
            rows = ops.embedding(self.embed_tokens, xp.where(inside, local, 0))
            rows = rows * inside[:, None].astype(self.backend.dtype)
        else:
            rows = xp.zeros((ids.shape[0], self.config.hidden_size), dtype=self.backend.dtype)
        return self.comm.all_reduce(rows)

    def _logits(self, x: Any, workspace: Any = None) -> Any:
        kw = {} if workspace is None else {"workspace": workspace, **workspace.out(
            "logits", (x.shape[0], self.lm_head.shape[1]), np.float32)}  # float32 straight from the GEMM's buffer
        logits = self.backend.ops.linear(x, self.lm_head, quant=self.lm_head_q, **kw).astype(np.float32, copy=False)
        if not self.shard.is_sharded:
            return logits
        pad = self.vocab_per_rank - logits.shape[1]  # the last ranks may hold fewer rows than ceil(V / N)
        if pad:
            logits = self.backend.xp.pad(logits, ((0, 0), (0, pad)))
        full = self.comm.gather(logits, axis=-1)
        return None if full is None else full[:, : self.config.vocab_size]

    def _query(self, layer: LayerWeights, qkv: Any, cos: Any, sin: Any, k_cache: Any, v_cache: Any,
               slot_mapping: Any, **out: Any) -> Any:
        """qkv [T, (H + 2 KV) D] -> the rotated query [T, H, D]; the rotated key and the value go to the cache.
        out: the op's out= and workspace= (a decode graph's buffers), or nothing."""
        return self.backend.ops.rotary_and_cache(qkv, self.num_heads, self.num_kv_heads, cos, sin, k_cache, v_cache,
                                                 slot_mapping, **out)

    def _attention(self, n: int, layer: LayerWeights, x: Any, cos_sin: tuple[Any, Any], kv: tuple[Any, Any],
                   batch: ForwardBatch, plans: dict[int, Any], rows: Any = None, add_to: Any = None,
                   lora: lora_slots.LoRALayer | None = None) -> Any:
        """Layer n's attention block on its normed input x: qkv, rotary and cache, paged attention (through the
        block tables of the layer's KV cache group, with its window), o_proj (all-reduced over the ranks).
        rows: None, or the rows o_proj (and so the block's output) is computed for (every row's K and V are
        still written: later steps read them). add_to: None, or the residual o_proj adds into (ops.linear_add,
        one rank), returned. lora: a step with adapter rows adds their deltas to qkv and o_proj (models/lora.py)."""
        ops = self.backend.ops
        k_cache, v_cache = kv
        block_tables, slot_mapping = batch.kv_tables(n)
        ws, t = batch.workspace, x.shape[0]  # ws: where each op writes (a decode graph's buffers), or None
        if (ops.linear_rotary_cache is not None and layer.qkv_bias is None and lora is None
                and type(self)._query is LlamaForCausalLM._query):  # nothing between the projection and rotary
            q = ops.linear_rotary_cache(x, layer.qkv, self.num_heads, self.num_kv_heads, *cos_sin, k_cache, v_cache,
                                        slot_mapping, quant=layer.qkv_q)
        else:
            qkv = ops.linear(x, layer.qkv, layer.qkv_bias, quant=layer.qkv_q,
                             **{} if ws is None else ws.out("qkv", (t, layer.qkv.shape[1]), x.dtype))
            if lora is not None:
                lora.add("qkv", x, qkv)
            q = self._query(layer, qkv, *cos_sin, k_cache, v_cache, slot_mapping, **{} if ws is None else {
                "workspace": ws, **ws.out("query", (t, self.num_heads, self.config.head_dim), x.dtype)})
        window = {} if self.windows[n] is None else {"sliding_window": self.windows[n]}
        attn = ops.paged_attention(q, k_cache, v_cache, batch.query_start_loc, batch.seq_lens, block_tables,
                                   self.scale, plan=plans[batch.group_of(n)], **window,
                                   **{} if ws is None else {"workspace": ws, **ws.out("attention", q.shape, q.dtype)})
        attn = attn.reshape(batch.num_tokens, self.q_size)
        if rows is not None:
            attn = attn[rows]
        if add_to is not None:  # (never with an o_proj bias: forward does not fuse then)
            out = ops.linear_add(attn, layer.o_proj, add_to, quant=layer.o_proj_q)
            return out if lora is None else lora.add("o_proj", attn, out, rows)
        out = ops.linear(attn, layer.o_proj, quant=layer.o_proj_q,
                         **{} if ws is None else ws.out("hidden", (attn.shape[0], layer.o_proj.shape[1]), attn.dtype))
        if lora is not None:
            lora.add("o_proj", attn, out, rows)
        out = self.comm.all_reduce(out)
        if layer.o_proj_bias is not None:
            out += layer.o_proj_bias
        return out

    def _mlp(self, layer: LayerWeights, x: Any, add_to: Any = None, lora: lora_slots.LoRALayer | None = None,
             rows: Any = None, workspace: Any = None) -> Any:
        """The gated MLP: down(silu(gate x) * up x), all-reduced (down is row-parallel); add_to, lora, rows: as
        _attention's (a LoRA step multiplies gate_up plainly, so its delta lands before the SiLU); workspace: where
        the ops write (models/workspace.py), or None."""
        ops, ws = self.backend.ops, workspace
        if lora is None:
            up = ops.linear_silu_and_mul(x, layer.gate_up, quant=layer.gate_up_q, **{} if ws is None else {
                "workspace": ws, **ws.out("act", (x.shape[0], layer.gate_up.shape[1] // 2), x.dtype)})
        else:
            t, width = x.shape[0], layer.gate_up.shape[1]
            gate_up = ops.linear(x, layer.gate_up, quant=layer.gate_up_q, **out_kw(ws, "gate_up", (t, width), x.dtype))
            up = ops.silu_and_mul(lora.add("gate_up", x, gate_up, rows), **out_kw(ws, "act", (t, width // 2), x.dtype))
        if add_to is not None:
            out = ops.linear_add(up, layer.down, add_to, quant=layer.down_q)
            return out if lora is None else lora.add("down", up, out, rows)
        out = ops.linear(up, layer.down, quant=layer.down_q,
                         **{} if ws is None else ws.out("hidden", (up.shape[0], layer.down.shape[1]), up.dtype))
        if lora is not None:
            lora.add("down", up, out, rows)
        return self.comm.all_reduce(out)

    def _prepare(self, batch: ForwardBatch, kv_caches: list[tuple[Any, Any]]) -> tuple[ForwardBatch, dict[int, Any]]:
        """The step's batch on the device (checked and uploaded once) and the attention plan of each KV cache
        group's block tables (once a step, not once a layer)."""
        cfg, ops = self.config, self.backend.ops
        if len(kv_caches) != cfg.num_hidden_layers:
            raise ValueError(f"expected {cfg.num_hidden_layers} KV cache layers, got {len(kv_caches)}")
        k0 = kv_caches[0][0]
        batch = to_device(batch, self.backend, int(k0.shape[1]), int(k0.shape[0]), cfg.vocab_size)
        plans = {}
        for n in range(cfg.num_hidden_layers):
            group = batch.group_of(n)
            if group not in plans:
                plans[group] = ops.plan_attention((batch.num_tokens, self.num_heads, cfg.head_dim), tuple(k0.shape),
                                                  batch.query_start_loc, batch.seq_lens, batch.kv_tables(n)[0])
        return batch, plans

    def forward(self, batch: ForwardBatch, kv_caches: list[tuple[Any, Any]]) -> Any:
        """Run one step; returns float32 logits [len(batch.logits_indices), vocab] (None on ranks > 0)."""
        cfg, ops = self.config, self.backend.ops
        # GPU: the step's metadata is checked and uploaded here, once (numpy: the batch as it is).
        batch, plans = self._prepare(batch, kv_caches)
        if batch.workspace is None and takes_workspace(self.backend):  # eager: buffers of its own (workspace.py)
            batch = replace(batch, workspace=Workspace(self.backend.xp))
        ws = batch.workspace  # where the ops write; None (numpy, numba): they allocate
        cos_sin = self.rope.cos_sin(batch)
        hidden = self._embed(batch.input_ids, ws)
        residual = None
        check, peaks = self.check_activations, {}
        keep = rows_wanting_logits(batch)
        # A set whose GEMM adds into its output (ops.linear_add: numba) takes o_proj's and down's outputs straight
        # into the residual; then only the norms remain (one rank: with several, the add follows the all-reduce).
        fused = ops.linear_add is not None and self.comm.world_size == 1 and not cfg.o_proj_bias
        lora = lora_slots.step_for(self.lora, batch.lora_slots, ops, ws)  # None: no adapter rows in this step
        for n, (layer, kv) in enumerate(zip(self.layers, kv_caches)):
            lk = {} if lora is None else {"lora": lora.layer(n)}
            if fused and residual is not None:  # the previous layer's down added its output already
                x = ops.rms_norm(residual, layer.input_norm, cfg.rms_norm_eps)
            else:
                x, residual = ops.add_rms_norm(hidden, residual, layer.input_norm, cfg.rms_norm_eps,
                                               **out_kw(ws, "normed", hidden.shape, hidden.dtype))
            if check:
                activation_check.check_residual(residual, self.backend.xp, f"layer {n} input", peaks)
            rows = keep if n == len(self.layers) - 1 else None
            if rows is not None:
                residual = residual[rows]
            hidden = self._attention(n, layer, x, cos_sin, kv, batch, plans, rows, residual if fused else None, **lk)
            if fused:
                x = ops.rms_norm(residual, layer.post_norm, cfg.rms_norm_eps)
            else:
                x, residual = ops.add_rms_norm(hidden, residual, layer.post_norm, cfg.rms_norm_eps,
                                               **out_kw(ws, "normed", hidden.shape, hidden.dtype))
            if check:
                activation_check.check_residual(residual, self.backend.xp, f"layer {n} after attention", peaks)
            hidden = self._mlp(layer, x, residual if fused else None, **lk, **({"rows": rows} if lk else {}),
                               **({} if ws is None else {"workspace": ws}))
        return self._final(hidden, residual, batch, peaks, selected=keep is not None, added=fused)

    def _final(self, hidden: Any, residual: Any, batch: ForwardBatch, peaks: dict[str, float],
               selected: bool = False, added: bool = False) -> Any:
        """The last add + norm on the rows that want logits, then the logits. selected: hidden and residual
        already hold only those rows (the last layer computed no others: rows_wanting_logits). added: the last
        down added hidden into residual already (ops.linear_add)."""
        # Every row wanting logits, in row order (rows_wanting_logits' None): nothing to gather (a gather would be a
        # copy, and inside a decode graph a CuPy expression).
        if not selected and len(batch.logits_indices) != batch.num_tokens:
            residual = residual[batch.logits_indices]
            if not added:  # (added: hidden is in residual already; no rows of it to gather)
                hidden = hidden[batch.logits_indices]
        ws = batch.workspace
        if added:
            x = self.backend.ops.rms_norm(residual, self.norm, self.config.rms_norm_eps)
        else:
            x, residual = self.backend.ops.add_rms_norm(hidden, residual, self.norm, self.config.rms_norm_eps,
                                                        **out_kw(ws, "normed", hidden.shape, hidden.dtype))
        if self.check_activations:
            activation_check.check_residual(residual, self.backend.xp, "final norm input", peaks)
            self.activation_peaks = peaks
        return self._logits(x, ws)


def rows_wanting_logits(batch: ForwardBatch) -> Any:
    """The rows the last layer computes past its K and V: the rows that want logits, when fewer than all (a
    prefill chunk's other tokens only feed later steps through the KV cache, so the last layer's o_proj and
    MLP on them would be thrown away: ~3% of a 30-layer prompt's matmuls). None: every row, in order. A row's
    bits do not change (each kernel's rows are computed independently of the batch's other rows)."""
    return batch.logits_indices if len(batch.logits_indices) < batch.num_tokens else None


def check_sliding_window(backend: Backend, windows: list[int | None]) -> None:
    """A model with sliding-window layers needs a kernel set whose paged attention takes `sliding_window`."""
    if all(w is None for w in windows):
        return
    import inspect

    if "sliding_window" not in inspect.signature(backend.ops.paged_attention).parameters:
        raise ValueError(f"the {backend.ops.name} kernel set's paged attention has no sliding window; this model "
                         f"has sliding-window layers")
