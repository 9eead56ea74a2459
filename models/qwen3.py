"""Qwen3: the Llama block with qk-norm, a per-head RMSNorm of the queries and keys before rotary.

Its weights add self_attn.q_norm / k_norm [head_dim] to each layer (registry.qwen3_layer_shapes); under tensor
parallelism every rank holds them whole (a head's norm does not depend on the other heads). llama.cpp stores
Qwen3's q/k rows as they are (NeoX rotary), so a GGUF file needs no un-permute.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .layers import QKNormLayerWeights, qk_norm
from .llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    def _layer(self, n: int, weights: dict[str, np.ndarray]) -> QKNormLayerWeights:
        a = f"model.layers.{n}.self_attn."
        return QKNormLayerWeights(**vars(super()._layer(n, weights)), q_norm=self._put(weights[a + "q_norm.weight"]),
                                  k_norm=self._put(weights[a + "k_norm.weight"]))

    def _query(self, layer: QKNormLayerWeights, qkv: Any, cos: Any, sin: Any, k_cache: Any, v_cache: Any,
               slot_mapping: Any, **out: Any) -> Any:
        qkv = qk_norm(self.backend, qkv, layer.q_norm, layer.k_norm, self.num_heads, self.num_kv_heads,
                      self.config.head_dim, self.config.rms_norm_eps)
        return super()._query(layer, qkv, cos, sin, k_cache, v_cache, slot_mapping, **out)
