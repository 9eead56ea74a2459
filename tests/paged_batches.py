"""Random paged-attention batches for the CPU kernel tests: a K/V pool, block tables, query rows."""

from __future__ import annotations

import numpy as np


def make_batch(rng, seqs, num_kv, group, head_dim, block_size, num_blocks=None):
    """seqs: [(context_len, num_new)]. Blocks are handed out in a shuffled order, tables padded with 0."""
    max_blocks = max([-(-L // block_size) for L, _ in seqs] + [1])
    need = sum(-(-L // block_size) for L, _ in seqs)
    num_blocks = num_blocks or need + 3
    k = rng.standard_normal((num_blocks, block_size, num_kv, head_dim)).astype(np.float32)
    v = rng.standard_normal((num_blocks, block_size, num_kv, head_dim)).astype(np.float32)
    ids = rng.permutation(num_blocks)
    tables = np.zeros((len(seqs), max_blocks), dtype=np.int32)
    used = 0
    for i, (L, _) in enumerate(seqs):
        nb = -(-L // block_size)
        tables[i, :nb] = ids[used : used + nb]
        used += nb
    qsl = np.zeros(len(seqs) + 1, dtype=np.int32)
    qsl[1:] = np.cumsum([n for _, n in seqs])
    lens = np.array([L for L, _ in seqs], dtype=np.int32)
    q = rng.standard_normal((int(qsl[-1]), num_kv * group, head_dim)).astype(np.float32)
    return q, k, v, qsl, lens, tables


def assert_each_alone_equals_together(attention, batch, scale: float = 0.125) -> np.ndarray:
    """Batch invariance: every sequence's rows computed alone are the same bits as in the whole batch.
    Returns the whole batch's output."""
    q, k, v, qsl, lens, tables = batch
    together = attention(q, k, v, qsl, lens, tables, scale)
    for i in range(len(lens)):
        a, b = qsl[i], qsl[i + 1]
        alone = attention(q[a:b], k, v, np.array([0, b - a], np.int32), lens[i:i + 1], tables[i:i + 1], scale)
        np.testing.assert_array_equal(alone, together[a:b])
    return together

