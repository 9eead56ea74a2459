"""Draft-model proposals: a smaller model with the target's vocabulary runs k cheap decode steps.

The draft has its own paged KV pool and block tables (a KVCacheManager of its own, same discipline as
the target's: allocate_slots before a forward, truncate what was rejected, free when the sequence
leaves). What its cache holds is tracked per sequence, so it catches up on whatever the target
accepted since the last proposal::

    target tokens    t0 .. t(n-1)                      n tokens, t(n-1) the newest
    draft KV holds   t0 .. t(c-1)                      c <= n - 1
    step 1           feed t(c) .. t(n-1)  -> q1, d1    (a prefill the first time, then 1-2 tokens)
    step j = 2..k    feed d(j-1)          -> qj, dj
    afterwards       KV holds t0..t(n-1), d1..d(k-1); next time the drafts the target accepted stay
                     valid, the rest are truncated away

Drafts are drawn from q (the draft's distribution under the request's temperature/top_k/top_p/min_p;
penalties are left out: any q keeps the rejection sampler exact), greedy requests take the argmax. A
guided sequence's draft logits are masked by its grammar first (spec_grammar.DraftGuide), so q is the
masked distribution and every draft is one the grammar takes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from pagedserve.models.batch import SeqChunk, build_forward_batch
from pagedserve.cupy_kernels.backend import to_host
from pagedserve.models.config import ModelConfig
from pagedserve.models.kv_cache import allocate_kv_caches
from pagedserve.models.registry import expected_shapes
from pagedserve.models.loading.loader import LoadedModel, load_model

from ..core.kv_cache_manager import KVCacheManager
from ..sample.rejection_sampler import dense_probs
from ..sample.sampling_ops import _inverse_cdf
from ..sampling_params import SamplingType


@dataclass
class _DraftSeq:
    base: int = 0  # the target's token count when the last proposal was made
    computed: int = 0  # tokens whose draft K/V is written (valid if fed matches the target)
    fed: list[int] = field(default_factory=list)  # drafts written at positions base, base + 1, ...


def self_draft_weights(config: ModelConfig, weights: dict[str, np.ndarray],
                       num_layers: int) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """The target's embedding, first `num_layers` layers, final norm and lm_head, as a model of its own."""
    if num_layers >= config.num_hidden_layers:
        raise ValueError(f"speculative_config.draft_num_layers ({num_layers}) must be below the target's "
                         f"{config.num_hidden_layers} layers")
    draft_config = dataclasses.replace(config, num_hidden_layers=num_layers)
    return draft_config, {name: weights[name] for name in expected_shapes(draft_config)}


def load_draft(spec_model: str | None, num_layers: int | None, target: LoadedModel,
               use_cache: bool = True) -> tuple[ModelConfig, dict[str, np.ndarray], str]:
    """(config, weights, name) of the draft: a checkpoint, or a self-draft of the target's first layers."""
    if spec_model is None:
        assert num_layers is not None  # SpeculativeConfig guarantees one of the two
        cfg, w = self_draft_weights(target.config, target.weights, num_layers)
        return cfg, w, f"{target.name}[:{num_layers} layers]"
    loaded = load_model(spec_model, use_cache=use_cache)
    if loaded.config.vocab_size != target.config.vocab_size:
        raise ValueError(f"speculative_config.model: the draft's vocab_size ({loaded.config.vocab_size}) differs "
                         f"from the target's ({target.config.vocab_size}); a draft must share the vocabulary")
    return loaded.config, loaded.weights, loaded.name


class DraftProposer:
    def __init__(self, model: Any, num_blocks: int, block_size: int, seed: int | None = None,
                 kv_storage: Any = None) -> None:
        """`model`: an instance of the draft config's registry model class (models/registry.py); `kv_storage`: its
        KV pool's dtype (the target's kv_cache_dtype; None: the backend's)."""
        self.model = model
        self.kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=False)
        self.kv_caches = allocate_kv_caches(model.config, num_blocks, block_size, model.backend, storage=kv_storage)
        self.xp = model.backend.xp
        self.generator = np.random.default_rng(seed)  # draws of unseeded requests
        self._seqs: dict[str, _DraftSeq] = {}

    def free(self, seq_id: str) -> None:
        self._seqs.pop(seq_id, None)
        self.kv.free(seq_id)

    def propose(self, requests: Sequence[Any], ks: Sequence[int],
                guide: Any = None) -> list[tuple[list[int], Any | None]]:
        """For each request (a decode: every token but the newest computed by the target), up to ks[i]
        drafts and the [len, V] distributions they were drawn from (None for greedy requests).
        guide: a spec_grammar.DraftGuide over `requests` (guided sequences draw under their grammar)."""
        xp = self.xp
        out: list[tuple[list[int], Any | None]] = [([], None)] * len(requests)
        live: list[int] = []
        chunks: list[SeqChunk] = []
        for i, (r, k) in enumerate(zip(requests, ks)):
            chunk = self._catch_up(r, k)
            if chunk is not None:
                live.append(i)
                chunks.append(chunk)
        drafts: dict[int, list[int]] = {i: [] for i in live}
        probs: dict[int, list[Any]] = {i: [] for i in live}
        step = 0
        while live:
            logits = self.model.forward(build_forward_batch(chunks, self.kv.block_size), self.kv_caches)
            if guide is not None:
                logits = guide.mask(logits, live, xp)
            tokens = self._draw(logits, [requests[i] for i in live], probs, live)
            step += 1
            next_live, chunks = [], []
            for row, i in enumerate(live):
                drafts[i].append(tokens[row])
                more = guide.advance(i, tokens[row]) if guide is not None else True
                if step < ks[i] and more:  # feed the draft to get the next one
                    r = requests[i]
                    position = r.num_tokens + step - 1
                    self._seqs[r.request_id].fed.append(tokens[row])
                    chunks.append(SeqChunk([tokens[row]], position, self.kv.block_table(r.request_id),
                                          prompt_len=r.num_prompt_tokens))
                    next_live.append(i)
            live = next_live
        for i in drafts:
            r = requests[i]
            state = self._seqs[r.request_id]
            state.computed = r.num_tokens + len(state.fed)
            q = xp.stack(probs[i]) if probs[i] and probs[i][0] is not None else None
            out[i] = (drafts[i], q)
        return out

    def _catch_up(self, r: Any, k: int) -> SeqChunk | None:
        """Reconcile what the draft cache holds with the target's tokens; the chunk to feed first."""
        state = self._seqs.get(r.request_id)
        tokens = r.all_token_ids
        n = len(tokens)
        if state is None:
            state = self._seqs[r.request_id] = _DraftSeq()
        else:  # drafts the target accepted keep their K/V; the rest is cut away
            common = 0
            for d in state.fed:
                if state.base + common >= n or tokens[state.base + common] != d:
                    break
                common += 1
            state.computed = min(state.base + common, state.computed, n - 1)
        state.base, state.fed = n, []
        self.kv.truncate(r.request_id, state.computed)
        # Room for the catch-up tokens and the k - 1 drafts fed back (the k-th is never fed).
        if not self.kv.allocate_slots(r.request_id, state.computed, n - state.computed + k - 1):
            self.free(r.request_id)  # the draft pool is full: no proposal this step
            return None
        return SeqChunk(tokens[state.computed:], state.computed, self.kv.block_table(r.request_id),
                        prompt_len=r.num_prompt_tokens)  # a LongRoPE draft rotates as the target does

    def _draw(self, logits: Any, requests: list[Any], probs: dict[int, list[Any]], live: list[int]) -> list[int]:
        xp = self.xp
        tokens = [0] * len(requests)
        greedy = [b for b, r in enumerate(requests) if r.sampling_params.sampling_type == SamplingType.GREEDY]
        rand = [b for b, r in enumerate(requests) if r.sampling_params.sampling_type != SamplingType.GREEDY]
        if greedy:
            picks = to_host(xp.argmax(logits[xp.asarray(np.asarray(greedy))], axis=1)).tolist()
            for b, t in zip(greedy, picks):
                tokens[b] = int(t)
                probs[live[b]].append(None)
        if rand:
            q = dense_probs(logits[xp.asarray(np.asarray(rand))], [requests[b].sampling_params for b in rand], xp)
            u = np.array([(requests[b].generator or self.generator).random() for b in rand])
            picks = to_host(_inverse_cdf(q, xp.asarray(u), xp)).tolist()
            for row, (b, t) in enumerate(zip(rand, picks)):
                tokens[b] = int(t)
                probs[live[b]].append(q[row])
        return tokens
