"""Prefix caching: shared prompt prefixes are computed once, and change no output."""

from __future__ import annotations

import functools

import numpy as np

from engine_helpers import drain, make_engine

from pagedserve.runtime.core.block_pool import BlockPool
from pagedserve.runtime.core.kv_cache_manager import KVCacheManager
from pagedserve.runtime.sampling_params import SamplingParams


engine = functools.partial(make_engine, max_num_batched_tokens=256, num_kv_blocks=400)
run = drain


SYSTEM = np.random.default_rng(7).integers(3, 512, size=500).tolist()


def wave(e, tag, n=6):
    for i in range(n):
        user = np.random.default_rng(100 + i).integers(3, 512, size=5 + 3 * i).tolist()
        e.add_request(f"{tag}{i}", SYSTEM + user, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))


def test_cache_on_equals_cache_off_and_second_wave_hits(tiny):
    off = engine(tiny, enable_prefix_caching=False)
    wave(off, "a")
    ref = run(off)
    on = engine(tiny)
    wave(on, "a")
    first = run(on)
    wave(on, "b")
    second = run(on)
    for i in range(6):
        assert first[f"a{i}"].outputs[0].token_ids == ref[f"a{i}"].outputs[0].token_ids
        assert second[f"b{i}"].outputs[0].token_ids == ref[f"a{i}"].outputs[0].token_ids
        # 500 shared tokens = 31 full blocks of 16, at least; the user part may add more
        assert second[f"b{i}"].num_cached_tokens >= 496
    assert all(out.num_cached_tokens == 0 for out in ref.values())
    stats = on.get_stats()
    assert 0.4 < stats.prefix_cache_hit_rate < 1.0 and stats.prefix_cache_request_hit_rate >= 0.5
    assert on.kv_manager.usage().num_used_blocks == 0


def test_cache_salt_keeps_tenants_apart(tiny):
    e = engine(tiny)
    p = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    e.add_request("t1", SYSTEM, p, cache_salt="tenant-1")
    run(e)
    e.add_request("t2", SYSTEM, p, cache_salt="tenant-2")
    assert run(e)["t2"].num_cached_tokens == 0
    e.add_request("t1b", SYSTEM, p, cache_salt="tenant-1")
    assert run(e)["t1b"].num_cached_tokens == 496


def test_hit_is_capped_so_the_last_prompt_token_is_computed(tiny):
    e = engine(tiny)
    p = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    prompt = SYSTEM[:64]  # exactly 4 full blocks
    e.add_request("x", prompt, p)
    a = run(e)["x"]
    e.add_request("y", prompt, p)
    b = run(e)["y"]
    assert b.num_cached_tokens == 48 and b.outputs[0].token_ids == a.outputs[0].token_ids


def test_lookup_checks_tokens_against_hash_collisions():
    pool = BlockPool(4, 2)
    [b] = pool.allocate(1)
    assert pool.cache(b, block_hash=123, parent_hash=None, token_ids=(1, 2))
    assert pool.lookup(123, None, (1, 2)) == b
    assert pool.lookup(123, None, (1, 3)) is None  # same hash, other tokens: a collision, not a hit
    assert pool.lookup(123, 99, (1, 2)) is None  # same tokens under another prefix


def test_freed_cached_blocks_survive_until_evicted_tail_first():
    kv = KVCacheManager(num_blocks=6, block_size=2, enable_prefix_caching=True)
    tokens = [1, 2, 3, 4, 5, 6, 7]
    assert kv.allocate_slots("a", 0, 7)
    kv.cache_full_blocks("a", tokens, 7)
    kv.free("a")  # 3 full blocks cached (the partial 4th is not), all free
    assert kv.pool.num_cached_blocks == 3 and kv.num_free_blocks == 6
    assert len(kv.find_cached_prefix(tokens)) == 3
    # Free queue now: the 2 never-used blocks, then a's blocks tail first (partial, c2, c1, c0).
    # Taking 4 blocks uses the unused ones, the uncached partial one, then evicts the chain's tail.
    assert kv.allocate_slots("b", 0, 8)
    hit = kv.find_cached_prefix(tokens)
    assert len(hit) == 2  # the head of the chain survived, the tail was evicted
    kv.free("b")
    kv.check_integrity()
