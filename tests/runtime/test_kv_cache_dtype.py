"""kv_cache_dtype through the engine (tiny committed Llama): 16-bit pools give float32's greedy tokens here, hold
twice the blocks in the same bytes, and everything that moves KV (prefix cache, copy-on-write of n > 1,
preemption, disaggregated transfer) moves 16-bit blocks as they are; unsupported dtypes are refused at start."""

from __future__ import annotations

import functools

import numpy as np
import pytest

import engine_helpers
from engine_helpers import InlineConnector, drain
from pagedserve.cupy_kernels import kernel_set
from pagedserve.runtime.config import EngineConfig
from pagedserve.runtime.engine.engine_view import EngineView
from pagedserve.runtime.kv_transfer.kv_connector import KVHandshakeError, check_compatible
from pagedserve.runtime.sampling_params import SamplingParams

# The numpy set: the numba set compiles its 16-bit attention loop nest at start (seconds); it has its own test below.
make_engine = functools.partial(engine_helpers.make_engine, num_kv_blocks=256, block_size=8, cpu_kernels="numpy")
SIXTEEN = ("bfloat16", "float16")
REDUCED = (*SIXTEEN, "int8", "fp8_e4m3", "fp8_e5m2")


def workload():
    """Greedy and seeded requests sharing a prompt's prefix (prefix-cache hits), n = 3 (forks: copy-on-write)."""
    rng = np.random.default_rng(3)
    long = [int(t) for t in rng.integers(3, 500, 90)]
    return [
        ("greedy", long, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)),
        ("seeded", long[:41], SamplingParams(temperature=0.9, seed=7, max_tokens=10, ignore_eos=True)),
        ("n3", long[:33], SamplingParams(temperature=1.0, n=3, seed=11, max_tokens=8, ignore_eos=True)),
        ("short", long[:5], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)),
        ("greedy2", long[:60] + [7, 8, 9], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)),
    ]


def run(engine, requests):
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    return {rid: [c.token_ids for c in out.outputs] for rid, out in drain(engine).items()}


def test_unknown_dtype_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of auto, float32, bfloat16, float16, int8, "
                                         r"fp8_e4m3, fp8_e5m2 \(or fp8 = fp8_e4m3\), got 'bf16'"):
        EngineConfig(kv_cache_dtype="bf16")
    assert EngineConfig(kv_cache_dtype="FP8").kv_cache_dtype == "fp8_e4m3"


@pytest.mark.parametrize("dtype", SIXTEEN)
def test_16_bit_pool_holds_twice_the_blocks_and_says_so(tiny, dtype):
    budget = 1 << 20
    f32 = make_engine(tiny, num_kv_blocks=None, kv_cache_memory_bytes=budget)
    half = make_engine(tiny, num_kv_blocks=None, kv_cache_memory_bytes=budget, kv_cache_dtype=dtype)
    w32, w16 = f32.executor.driver_worker, half.executor.driver_worker
    assert w32.kv_bytes_per_block() == 2 * w16.kv_bytes_per_block()
    assert half.num_kv_blocks == budget // w16.kv_bytes_per_block() >= 2 * f32.num_kv_blocks - 1
    assert w16.kv_caches[0][0].dtype == w16.kv_layout.storage and w16.kv_caches[0][0].itemsize == 2
    assert half.memory_budget.kv_cache_bytes <= budget  # the memory budget counts the pool's real bytes
    view = EngineView()
    view.engine = half
    assert view.model_info().kv_cache_dtype == dtype  # GetModelInfo's field 13, `pagedserve stats`
    assert f32.kv_layout.dtype == "float32"
    assert f32.kv_layout.requested == "auto"


@pytest.mark.parametrize("dtype", SIXTEEN)
def test_16_bit_greedy_tokens_equal_float32_on_the_tiny_model(tiny, dtype):
    greedy = [r for r in workload() if r[2].temperature == 0.0]
    assert run(make_engine(tiny, kv_cache_dtype=dtype), greedy) == run(make_engine(tiny), greedy)


@pytest.mark.parametrize("dtype", REDUCED)
def test_prefix_cache_forks_preemption_and_transfer_carry_16_bit_blocks(tiny, dtype):
    """Each path that moves or shares blocks gives the tokens of each request run alone in a reduced pool: a block
    copied or shared wrong, a preempted request recomputed into another layout, or a transferred block written
    back other than it was read would change them."""
    alone = {}
    for req in workload():  # each request in its own engine: no sharing, no preemption
        alone.update(run(make_engine(tiny, kv_cache_dtype=dtype), [req]))
    e = make_engine(tiny, kv_cache_dtype=dtype)
    assert run(e, workload()) == alone  # prefix hits and n = 3's forks in one pool
    assert e.scheduler.num_cached_prompt_tokens > 0
    small = make_engine(tiny, kv_cache_dtype=dtype, num_kv_blocks=16, max_num_batched_tokens=16)
    assert run(small, workload()) == alone
    assert small.num_preemptions > 0, "the pool was meant to be small enough to force preemption"
    decode = make_engine(tiny, kv_cache_dtype=dtype)
    conn = InlineConnector(make_engine(tiny, kv_cache_dtype=dtype, max_num_batched_tokens=24))
    decode.enable_remote_prefill(conn)
    assert run(decode, workload()) == alone
    assert decode.kv_stats.remote_prefills > 0 and decode.kv_stats.local_prefill_fallbacks == 0


def test_decode_refuses_a_prefill_instance_of_another_dtype(tiny):
    decode = make_engine(tiny, kv_cache_dtype="bfloat16").kv_transfer_spec("decode")
    assert decode.dtype == "bfloat16" and decode.storage == np.uint16
    prefill = make_engine(tiny).kv_transfer_spec("prefill")
    with pytest.raises(KVHandshakeError, match=r"keeps its KV cache in float32 \(kv_cache_dtype\) and this instance "
                                               r"in bfloat16.*same --kv-cache-dtype"):
        check_compatible(decode, prefill, "unix:/p")
    check_compatible(decode, make_engine(tiny, kv_cache_dtype="bfloat16").kv_transfer_spec("prefill"), "unix:/p")


def test_draft_model_pool_takes_the_targets_dtype(tiny):
    greedy = [r for r in workload() if r[2].temperature == 0.0]
    spec = {"method": "draft", "draft_num_layers": 1, "num_speculative_tokens": 3, "min_acceptance_rate": 0.0}
    e = make_engine(tiny, kv_cache_dtype="bfloat16", speculative_config=spec)
    assert e.spec.draft.kv_caches[0][0].dtype == np.uint16  # bfloat16's bits, as the target's pool
    assert run(e, greedy) == run(make_engine(tiny, kv_cache_dtype="bfloat16"), greedy)
    assert e.spec.stats.num_draft_tokens > 0


@pytest.mark.slow
@pytest.mark.parametrize("dtype", REDUCED)
def test_numba_set_gives_the_reference_sets_tokens(tiny, dtype):
    """The numba set (its 16- or 8-bit loop nest, compiled at start, and its cache write) against the numpy set
    over the same reduced pool: the cache holds the same bits and the attention differs by float32 rounding only,
    so the tokens are the same (the numba set refused the 8-bit dtypes at start before it had their kernels)."""
    if kernel_set.numba_code_path() in (None, "baseline"):
        pytest.skip("the numba set is not taken here")
    e = make_engine(tiny, kv_cache_dtype=dtype, cpu_kernels="numba")
    assert e.backend.ops.name == "numba"
    assert run(e, workload()) == run(make_engine(tiny, kv_cache_dtype=dtype), workload())


def test_int8_pool_holds_its_scales_in_its_blocks(tiny):
    """An int8 pool: rows of head_dim values and their float32 scale (4 bytes), ~4x float32's blocks; the scales are
    in the blocks' own bytes, so a block's copy (copy-on-write, transfer) carries them."""
    f32 = make_engine(tiny)
    i8 = make_engine(tiny, kv_cache_dtype="int8")
    w32, w8 = f32.executor.driver_worker, i8.executor.driver_worker
    d = tiny.config.head_dim
    assert w8.kv_caches[0][0].dtype == np.int8 and w8.kv_caches[0][0].shape[-1] == d + 4
    assert w8.kv_bytes_per_block() * 4 * d == w32.kv_bytes_per_block() * (d + 4)
    assert i8.kv_transfer_spec("decode").block_bytes == w8.kv_bytes_per_block()


@pytest.mark.parametrize("dtype", ["bfloat16", "int8"])
def test_sliding_window_groups_take_the_dtype(dtype):
    """Gemma 3's KV cache groups (local layers' windows: arrays shared across layers) in a reduced pool: every
    pair in the dtype, and the tokens of each request alone in the same pool."""
    loaded = engine_helpers.tiny_loaded("tiny-gemma3")
    greedy = [r for r in workload() if r[2].temperature == 0.0]
    e = make_engine(loaded, kv_cache_dtype=dtype)
    worker = e.executor.driver_worker
    assert len(worker.kv_groups.windows) > 1 and all(k.dtype == worker.kv_layout.storage for k, _ in worker.kv_pairs)
    alone = {}
    for req in greedy:
        alone.update(run(make_engine(loaded, kv_cache_dtype=dtype), [req]))
    assert run(e, greedy) == alone
