"""Gemma 3 (the text model, Gemma3ForCausalLM) over the paged KV cache.

Per layer, with the residual stream r (each norm an RMSNorm by (1 + w), folded into w at load: registry
.fold_gemma_norms):

    x = input_layernorm(r)
    a = post_attention_layernorm(attention(x))     q/k heads RMS-normed, then rotary; scale query_pre_attn_scalar^-0.5
    r = r + a
    m = post_feedforward_layernorm(down(gelu_tanh(gate(y)) * up(y))),  y = pre_feedforward_layernorm(r)
    r = r + m

The embedding is multiplied by sqrt(hidden) rounded to the weights' dtype (as transformers does), and the
lm_head is the embedding (tied). Layers marked "sliding_attention" in config.layer_types read only the last
`sliding_window` keys (the kernel sets' paged attention `sliding_window=`) and rotate with their own base
(rope_local_theta, 10,000); the "full_attention" ones use rope_theta (and rope_scaling, linear in the larger
models).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from . import activation_check, lora as lora_slots
from .batch import ForwardBatch
from .config import ModelConfig
from .layers import QKNormLayerWeights, gelu_tanh_and_mul, qk_norm
from .llama import LlamaForCausalLM, rows_wanting_logits
from .rope import RotaryEmbedding


@dataclass
class Gemma3LayerWeights(QKNormLayerWeights):
    pre_ff_norm: Any = None
    post_ff_norm: Any = None  # post_norm (LayerWeights) is post_attention_layernorm


class Gemma3ForCausalLM(LlamaForCausalLM):
    silu_gated_mlp = False  # GELU-tanh: gate_up goes through ops.linear (_mlp)

    def __init__(self, config: ModelConfig, weights: dict[str, np.ndarray], backend: Any = None,
                 source: str = "weights", shard: Any = None, comm: Any = None) -> None:
        if not config.tie_word_embeddings:
            raise ValueError(f"{source}: Gemma 3 ties its lm_head to the embedding (tie_word_embeddings)")
        super().__init__(config, weights, backend, source, shard, comm)
        self.scale = float(config.query_pre_attn_scalar or config.head_dim) ** -0.5
        self.local_rope = RotaryEmbedding(config, self.backend, theta=config.rope_local_theta or config.rope_theta,
                                          scaling=None)
        self.embed_scale = np.asarray(config.hidden_size ** 0.5, dtype=np.float32).astype(self.backend.dtype)

    def _layer(self, n: int, weights: dict[str, np.ndarray]) -> Gemma3LayerWeights:
        p = f"model.layers.{n}."
        put = self._put
        return Gemma3LayerWeights(**vars(super()._layer(n, weights)),
                                  q_norm=put(weights[p + "self_attn.q_norm.weight"]),
                                  k_norm=put(weights[p + "self_attn.k_norm.weight"]),
                                  pre_ff_norm=put(weights[p + "pre_feedforward_layernorm.weight"]),
                                  post_ff_norm=put(weights[p + "post_feedforward_layernorm.weight"]))

    def _embed(self, ids: Any) -> Any:
        return super()._embed(ids) * self.embed_scale

    def _query(self, layer: Gemma3LayerWeights, qkv: Any, cos: Any, sin: Any, k_cache: Any, v_cache: Any,
               slot_mapping: Any, **out: Any) -> Any:
        qkv = qk_norm(self.backend, qkv, layer.q_norm, layer.k_norm, self.num_heads, self.num_kv_heads,
                      self.config.head_dim, self.config.rms_norm_eps)
        return super()._query(layer, qkv, cos, sin, k_cache, v_cache, slot_mapping, **out)

    def _mlp(self, layer: Gemma3LayerWeights, x: Any, lora: lora_slots.LoRALayer | None = None,
             rows: Any = None) -> Any:
        """down(gelu_tanh(gate x) * up x), all-reduced; lora, rows: a step with adapter rows adds their gate/up deltas
        before the activation and their down delta after (models/lora.py), rows as LlamaForCausalLM._mlp's."""
        ops = self.backend.ops
        gate_up = ops.linear(x, layer.gate_up, quant=layer.gate_up_q)
        if lora is not None:
            lora.add("gate_up", x, gate_up, rows)
        up = gelu_tanh_and_mul(self.backend.xp, gate_up)
        out = ops.linear(up, layer.down, quant=layer.down_q)
        if lora is not None:
            lora.add("down", up, out, rows)
        return self.comm.all_reduce(out)

    def forward(self, batch: ForwardBatch, kv_caches: list[tuple[Any, Any]]) -> Any:
        """Run one step; returns float32 logits [len(batch.logits_indices), vocab] (None on ranks > 0)."""
        ops, eps = self.backend.ops, self.config.rms_norm_eps
        batch, plans = self._prepare(batch, kv_caches)
        sliding = [w is not None for w in self.windows]
        cos_sin = {s: (self.local_rope if s else self.rope).cos_sin(batch) for s in set(sliding)}
        hidden = self._embed(batch.input_ids)
        residual = None
        check, peaks = self.check_activations, {}
        keep = rows_wanting_logits(batch)
        lora = lora_slots.step_for(self.lora, batch.lora_slots, ops)  # None: no adapter rows in this step
        for n, (layer, kv) in enumerate(zip(self.layers, kv_caches)):
            x, residual = ops.add_rms_norm(hidden, residual, layer.input_norm, eps)
            if check:
                activation_check.check_residual(residual, self.backend.xp, f"layer {n} input", peaks)
            rows = keep if n == len(self.layers) - 1 else None
            lk = {} if lora is None else {"lora": lora.layer(n)}
            attn = ops.rms_norm(self._attention(n, layer, x, cos_sin[sliding[n]], kv, batch, plans, rows, **lk),
                                layer.post_norm, eps)
            if rows is not None:
                residual = residual[rows]
            x, residual = ops.add_rms_norm(attn, residual, layer.pre_ff_norm, eps)
            if check:
                activation_check.check_residual(residual, self.backend.xp, f"layer {n} after attention", peaks)
            hidden = ops.rms_norm(self._mlp(layer, x, **lk, **({"rows": rows} if lk else {})), layer.post_ff_norm, eps)
        return self._final(hidden, residual, batch, peaks, selected=keep is not None)
