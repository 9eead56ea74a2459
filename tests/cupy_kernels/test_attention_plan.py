"""The GPU attention kernel's work plan, checked on the CPU.

`emulate` replays paged_attention.cu step by step in numpy float32: the tile -> sequence binary
search, the per-tile key range, the partition split of long decodes, 32-key tiles with zero-filled
keys past the tile's end, the base-2 online softmax and the partition reduce. It uses the same launch
decisions as the GPU path (cuda_ops.attention_launch) and is compared against the numpy reference,
so a mistake in the plan (a query tile never launched, a row written twice, a key outside the causal
window) fails here without a GPU. The CUDA code itself is covered by the GPU tests.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from pagedserve.cupy_kernels.cuda import ops as cuda_ops
from pagedserve.cupy_kernels.reference.paged_attention import paged_attention

TILE = cuda_ops.ATTN_TILE_N
PART = cuda_ops.PARTITION_SIZE


def _find_sequence(qsl, num_seqs, block_q, tile):
    lo, hi = 0, num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) >> 1
        if (int(qsl[mid]) - mid) // block_q + mid <= tile:
            lo = mid
        else:
            hi = mid - 1
    return lo


def emulate(query, k_cache, v_cache, qsl, seq_lens, block_tables, scale):
    """paged_attention.cu in numpy; also returns how many times each (token, head) was written."""
    num_tokens, num_heads, dim = query.shape
    block_size, num_kv = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv
    b = len(seq_lens)
    launch = cuda_ops.attention_launch(num_heads, num_kv, num_tokens, b)
    bm, bq = launch.block_m, launch.block_q
    max_parts = max(1, -(-int(block_tables.shape[1] * block_size) // PART))
    out = np.full((num_tokens, num_heads, dim), np.nan, dtype=np.float32)
    writes = np.zeros((num_tokens, num_heads), dtype=np.int64)
    part_acc = np.full((b, num_heads, max_parts, dim), np.nan, dtype=np.float32)
    part_ml = np.full((b, num_heads, max_parts, 2), np.nan, dtype=np.float32)
    scale_log2 = np.float32(scale * cuda_ops.LOG2E)
    for tile in range(launch.num_tiles):
        seq = _find_sequence(qsl, b, bq, tile)
        q_begin = int(qsl[seq])
        n = int(qsl[seq + 1]) - q_begin
        q0 = (tile - ((q_begin - seq) // bq + seq)) * bq
        assert q0 >= 0
        if q0 >= n:
            continue
        seq_len = int(seq_lens[seq])
        tile_q = min(bq, n - q0)
        first_pos = seq_len - n + q0
        kv_end = first_pos + tile_q
        split = n == 1 and seq_len > PART
        num_parts = -(-seq_len // PART) if split else 1
        rows = np.arange(bm)
        qi = rows // group
        pos = np.where(qi < tile_q, first_pos + qi, -1)
        heads = np.arange(num_kv)[:, None] * group + rows % group  # [KV, BM]
        for kv_head in range(num_kv):
            for part in range(num_parts):
                k_begin = part * PART if split else 0
                k_end = min(k_begin + PART, kv_end) if split else kv_end
                q = np.zeros((bm, dim), dtype=np.float32)
                valid = pos >= 0
                tokens = q_begin + q0 + qi[valid]
                q[valid] = query[tokens, heads[kv_head][valid]].astype(np.float32) * scale_log2
                m = np.full(bm, -np.inf, dtype=np.float32)
                row_sum = np.zeros(bm, dtype=np.float32)
                acc = np.zeros((bm, dim), dtype=np.float32)
                for t0 in range(k_begin, k_end, TILE):
                    keys = t0 + np.arange(TILE)
                    live = keys < k_end
                    k = np.zeros((TILE, dim), dtype=np.float32)
                    v = np.zeros((TILE, dim), dtype=np.float32)
                    blocks = block_tables[seq, keys[live] // block_size]
                    k[live] = k_cache[blocks, keys[live] % block_size, kv_head]
                    v[live] = v_cache[blocks, keys[live] % block_size, kv_head]
                    s = q @ k.T
                    visible = live[None, :] & (keys[None, :] <= pos[:, None])
                    s = np.where(visible, s, -np.inf).astype(np.float32)
                    m_new = np.maximum(m, s.max(axis=1))
                    m_use = np.where(m_new == -np.inf, 0, m_new).astype(np.float32)
                    p = np.exp2(s - m_use[:, None])
                    alpha = np.exp2(m - m_use)
                    row_sum = row_sum * alpha + p.sum(axis=1)
                    acc = acc * alpha[:, None] + p @ v
                    m = m_new
                for r in np.flatnonzero(valid):
                    head = heads[kv_head][r]
                    if not split:
                        token = q_begin + q0 + qi[r]
                        out[token, head] = acc[r] / row_sum[r]
                        writes[token, head] += 1
                    else:
                        part_acc[seq, head, part] = acc[r]
                        part_ml[seq, head, part] = (m[r], row_sum[r])
    for seq in range(b):  # the reduce kernel
        n = int(qsl[seq + 1] - qsl[seq])
        seq_len = int(seq_lens[seq])
        if n != 1 or seq_len <= PART:
            continue
        num_parts = -(-seq_len // PART)
        for head in range(num_heads):
            mz, lz = part_ml[seq, head, :num_parts, 0], part_ml[seq, head, :num_parts, 1]
            assert not np.isnan(mz).any(), "a partition of a split decode was never written"
            w = np.exp2(mz - mz.max())
            out[qsl[seq], head] = (part_acc[seq, head, :num_parts] * w[:, None]).sum(0) / (lz * w).sum()
            writes[qsl[seq], head] += 1
    return out, writes


def make_batch(rng, specs, num_kv, group, dim, block_size, spare_blocks=5):
    """specs: (seq_len, num_new) per sequence. Shuffled block tables; unused slots hold garbage."""
    lens = np.array([s for s, _ in specs], dtype=np.int32)
    news = np.array([n for _, n in specs], dtype=np.int64)
    qsl = np.zeros(len(specs) + 1, dtype=np.int32)
    np.cumsum(news, out=qsl[1:])
    needed = -(-lens // block_size)
    num_blocks = int(needed.sum()) + spare_blocks
    perm = rng.permutation(num_blocks)
    tables = np.zeros((len(specs), int(needed.max()) + 2), dtype=np.int32)
    at = 0
    for i, nb in enumerate(needed):
        tables[i, :nb] = perm[at:at + nb]
        at += nb
    shape = (num_blocks, block_size, num_kv, dim)
    k_cache = np.full(shape, 3e4, dtype=np.float32)  # never-written slots: finite garbage that would show
    v_cache = np.full(shape, -3e4, dtype=np.float32)
    for i, length in enumerate(lens):
        for p in range(length):
            blk, row = tables[i, p // block_size], p % block_size
            k_cache[blk, row] = rng.standard_normal((num_kv, dim))
            v_cache[blk, row] = rng.standard_normal((num_kv, dim))
    query = rng.standard_normal((int(qsl[-1]), num_kv * group, dim)).astype(np.float32)
    return query, k_cache, v_cache, qsl, lens, tables


MIXED = [(1, 1), (40, 40), (600, 1), (1500, 1), (700, 37), (513, 1), (512, 1), (33, 1), (90, 17), (1030, 3)]
DECODES = [(1, 1), (511, 1), (512, 1), (513, 1), (1200, 1), (64, 1), (31, 1)]


@pytest.mark.parametrize("block_size", cuda_ops.ATTN_BLOCK_SIZES)
@pytest.mark.parametrize("group", [1, 3, 4, 8])
@pytest.mark.parametrize("specs", [MIXED, DECODES], ids=["mixed", "decode_only"])
def test_kernel_plan_matches_reference(block_size, group, specs):
    rng = np.random.default_rng(group * 100 + block_size)
    query, k_cache, v_cache, qsl, lens, tables = make_batch(rng, specs, 2, group, 8, block_size)
    ref = paged_attention(query, k_cache, v_cache, qsl, lens, tables, 0.35)
    got, writes = emulate(query, k_cache, v_cache, qsl, lens, tables, 0.35)
    assert (writes == 1).all(), "every (token, head) must be written exactly once"
    np.testing.assert_allclose(got, ref, atol=2e-5, rtol=1e-4)


def test_tile_count_covers_every_query():
    """attention_launch's tile count (from T and B only) always covers ceil(n / block_q) tiles per sequence."""
    rng = np.random.default_rng(0)
    for _ in range(300):
        b = int(rng.integers(1, 12))
        news = rng.integers(1, 70, size=b) * (rng.random(b) < 0.6) + 1
        qsl = np.concatenate([[0], np.cumsum(news)])
        group = int(rng.choice([1, 2, 3, 4, 5, 7, 8, 16, 32]))
        launch = cuda_ops.attention_launch(group * 2, 2, int(qsl[-1]), b)
        covered = np.zeros(int(qsl[-1]), dtype=np.int64)
        for tile in range(launch.num_tiles):
            seq = _find_sequence(qsl, b, launch.block_q, tile)
            q0 = (tile - ((int(qsl[seq]) - seq) // launch.block_q + seq)) * launch.block_q
            n = int(news[seq])
            if q0 < n:
                covered[qsl[seq] + q0: qsl[seq] + min(q0 + launch.block_q, n)] += 1
        assert (covered == 1).all()


def test_launch_shapes():
    assert cuda_ops.attention_launch(32, 8, 64, 64) == cuda_ops.AttentionLaunch(4, 1, 64)  # decode batch
    assert cuda_ops.attention_launch(32, 8, 100, 3).block_m == 16
    assert cuda_ops.attention_launch(9, 3, 9, 9).block_m == 4  # SmolLM2 decode: group 3 in 4 rows
    assert cuda_ops.attention_launch(9, 3, 20, 2).block_q == 5
    assert cuda_ops.attention_launch(64, 2, 5, 5).block_m == 32
    with pytest.raises(ValueError, match="at most"):
        cuda_ops.attention_launch(66, 1, 1, 1)
    with pytest.raises(ValueError, match="multiple"):
        cuda_ops.attention_launch(9, 2, 1, 1)


def test_every_reachable_instantiation_is_in_the_table():
    names = set(cuda_ops.family_name_expressions("paged_attention"))
    for group in range(1, cuda_ops.MAX_QUERIES_PER_KV + 1):
        for tokens, seqs in ((4, 4), (9, 4)):
            bm = cuda_ops.attention_launch(group, 1, tokens, seqs).block_m
            for dim in cuda_ops.ATTN_HEAD_DIMS:
                for bs in cuda_ops.ATTN_BLOCK_SIZES:
                    assert cuda_ops.attention_kernel_name(dim, bs, bm) in names


def test_host_metadata_checks():
    tables = np.array([[0, 1], [2, 0]], dtype=np.int32)
    ok = cuda_ops._check_host_metadata([0, 3, 4], [20, 5], tables, 4, 16, 3)
    assert ok == 20
    with pytest.raises(ValueError, match="query_start_loc"):
        cuda_ops._check_host_metadata([0, 3, 5], [20, 5], tables, 4, 16, 3)
    with pytest.raises(ValueError, match="more query tokens"):
        cuda_ops._check_host_metadata([0, 3, 4], [2, 5], tables, 4, 16, 3)
    with pytest.raises(ValueError, match="needs 3 blocks"):
        cuda_ops._check_host_metadata([0, 3, 4], [40, 5], tables, 4, 16, 3)
    with pytest.raises(IndexError, match="block id"):
        cuda_ops._check_host_metadata([0, 3, 4], [20, 5], tables, 4, 16, 2)
    with pytest.raises(ValueError, match="at least one"):
        cuda_ops._check_host_metadata([0, 4, 4], [20, 5], tables, 4, 16, 3)


def test_numpy_arrays_never_dispatch_and_cupy_is_not_imported():
    code = (
        "import sys, numpy as np\n"
        "from pagedserve.cupy_kernels.reference import ops, paged_attention\n"
            "from pagedserve.cupy_kernels.cuda import ops as cuda_ops\n"
        "import pagedserve.models.llama\n"
        "assert not cuda_ops.is_cupy_array(np.zeros(2)) and not cuda_ops.is_cupy_array(None)\n"
        "ops.silu_and_mul(np.ones((2, 4), np.float32))\n"
        "assert 'cupy' not in sys.modules, 'importing the op layer imported cupy'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_is_cupy_array_by_module_name():
    fake = type("ndarray", (), {"__module__": "cupy._core.core"})()
    assert cuda_ops.is_cupy_array(fake)
    assert not cuda_ops.is_cupy_array(np.float16(1))


def test_partial_buffer_is_capped_whatever_the_batch_and_context():
    """256 decodes at 131,072 tokens with Llama-3.1-8B's 32 heads of 128: 1 GiB of partials in one
    launch; capped, each launch holds at most PARTITION_SCRATCH_BYTES."""
    heads, dim, parts = 32, 128, 131072 // cuda_ops.PARTITION_SIZE
    per_seq = cuda_ops.partition_bytes_per_seq(heads, dim, parts)
    assert 256 * per_seq > 1 << 30
    chunk = cuda_ops.partition_chunk(256, heads, dim, parts)
    assert chunk * per_seq <= cuda_ops.PARTITION_SCRATCH_BYTES and chunk >= 1
    assert cuda_ops.partition_chunk(256, heads, dim, 1) == 256  # nothing split: one launch
    assert cuda_ops.partition_chunk(8, heads, dim, 4) == 8  # small partials: one launch
