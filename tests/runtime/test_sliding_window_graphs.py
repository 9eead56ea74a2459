"""Decode graphs with KV cache groups (runtime/worker/decode_graphs.py, #35): a model whose layers read two
groups (a sliding layer, window 6, and a global one, sharing one K/V pair) replays its decode steps with each
group's tables and slots uploaded into static buffers of their own, matching eager steps; the sliding
group's entries older than the window point at a NaN-filled block, which neither path reads."""

from __future__ import annotations

import numpy as np
import pytest

from model_factory import random_model
from numerics import assert_close_model

from pagedserve.models.batch import SeqChunk, build_forward_batch
from pagedserve.models.kv_cache import allocate_kv_caches
from pagedserve.models.llama import LlamaForCausalLM
from pagedserve.runtime.core.kv_cache_manager import kv_cache_groups
from pagedserve.runtime.worker.cuda_graphs import DecodeGraphs

BS, WINDOW, NULL = 16, 6, 79


class FakeCapturer:
    """Records the forward instead of capturing it and "replays" it by calling it (test_cuda_graphs.py's)."""

    def warmup(self, fn):
        fn()

    def capture(self, fn):
        return fn

    def reserve(self):
        pass

    def upload(self, copies):
        for dst, src in copies:
            dst[...] = src

    def launch(self, graph):
        graph()

    def synchronize(self):
        pass

    def pool_bytes(self):
        return 0

    def release(self):
        pass


def _setup():
    cfg, weights = random_model(layers=2, vocab=61)
    model = LlamaForCausalLM(cfg, weights)
    model.windows = [WINDOW, None]
    groups = kv_cache_groups(model.windows)
    assert groups.windows == (WINDOW, None) and groups.num_tensors == 1
    caches = []
    for _ in range(2):  # eager, graphs
        pairs = allocate_kv_caches(cfg, 80, BS, model.backend, num_arrays=groups.num_tensors)
        for k, v in pairs:
            k[NULL] = v[NULL] = np.nan  # the "null block": never read
        caches.append([pairs[t] for t in groups.layer_tensor])
    return model, groups, caches


def _chunks(lens, news, tables, tokens):
    out = []
    for i, (n, new) in enumerate(zip(lens, news)):
        sliding, full = list(tables[i][0]), tables[i][1]
        first_kept = max(0, n - new - WINDOW + 1) // BS  # what the KV manager would have released
        sliding[:first_kept] = [NULL] * first_kept
        out.append(SeqChunk(tokens[i][n - new:n], n - new, sliding, group_block_tables=[full]))
    return out


def test_grouped_decode_replays_match_eager_steps():
    model, groups, (kv_eager, kv_graph) = _setup()
    graphs = DecodeGraphs(model, kv_graph, (1, 4, 8), max_blocks=5, capturer=FakeCapturer(),
                          layer_group=groups.layer_group)
    assert graphs.capture_all() and graphs.enabled
    rng = np.random.default_rng(0)
    lens = [int(n) for n in rng.integers(3, 60, size=5)]
    tables = [([8 * i + j for j in range(4)], [8 * i + 4 + j for j in range(4)]) for i in range(5)]
    tokens = [rng.integers(0, 61, 70).tolist() for _ in range(5)]
    prompt = build_forward_batch(_chunks([n - 1 for n in lens], [n - 1 for n in lens], tables, tokens), BS,
                                 groups.layer_group)  # positions 0 .. n - 2; the decodes write n - 1 on
    model.forward(prompt, kv_eager)
    model.forward(prompt, kv_graph)
    for rows in ([0, 1, 2], [3], [0, 1, 2, 3, 4], [4, 2]):
        batch = build_forward_batch(_chunks([lens[i] for i in rows], [1] * len(rows), [tables[i] for i in rows],
                                            [tokens[i] for i in rows]), BS, groups.layer_group)
        ref = model.forward(batch, kv_eager)
        got = graphs.run(batch)
        assert got is not None and np.isfinite(got).all()
        assert_close_model(got, ref, model.config)
        assert (got.argmax(1) == ref.argmax(1)).all()
        for (ke, _), (kg, _) in zip(kv_eager, kv_graph):
            assert np.array_equal(np.isnan(kg), np.isnan(ke)) and np.array_equal(kg == 0, ke == 0)
        for i in rows:
            lens[i] += 1
    assert graphs.num_replays == 4 and graphs.upload_bytes > 0


def test_a_batch_of_other_groups_is_refused():
    model, groups, (_, kv_graph) = _setup()
    graphs = DecodeGraphs(model, kv_graph, (1,), max_blocks=5, capturer=FakeCapturer(), layer_group=groups.layer_group)
    assert graphs.capture_all()
    one_group = build_forward_batch([SeqChunk([3], 4, [0])], BS)
    with pytest.raises(ValueError, match="KV cache groups"):
        graphs.run(one_group)
