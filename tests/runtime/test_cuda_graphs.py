"""runtime/worker/cuda_graphs.py on the CPU: bucketing, padding, static buffers, replay and the eager fallback.

The CUDA part hides behind GraphCapturer; here a fake records the forward instead of capturing it and
"replays" it by calling it, so a replay reads the static buffers as they are at launch time, like a
real graph. The numpy model then checks the whole data path: padded replays give the eager logits and
write exactly the KV slots an eager step writes.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from structlog.testing import capture_logs

from pagedserve.models.batch import SeqChunk, build_forward_batch
from pagedserve.models.device_batch import unpack_batch
from pagedserve.models.kv_cache import allocate_kv_caches
from pagedserve.models.llama import LlamaForCausalLM
from pagedserve.runtime.config import EngineConfig
from pagedserve.runtime.worker.cuda_graphs import (DEFAULT_BATCH_SIZES, ArenaAllocator, ArenaExhausted, DecodeGraphs,
                                                   build_decode_graphs, context_buckets, default_batch_sizes,
                                                   graph_pool_reserve, is_decode_step, pack_decode_batch, padded_size,
                                                   resolve_batch_sizes)
from pagedserve.runtime.engine.llm_engine import LLMEngine
from pagedserve.runtime.sampling_params import SamplingParams

from engine_helpers import drain
from model_factory import random_model
from numerics import assert_close_model, model_tol

BS = 16


class FakeCapturer:
    def __init__(self, fail_on_capture: int | None = None) -> None:
        self.fail_on_capture = fail_on_capture
        self.events: list[str] = []
        self.num_captures = 0
        self.released = False

    def warmup(self, fn):
        self.events.append("warmup")
        fn()

    def capture(self, fn):
        self.num_captures += 1
        if self.num_captures == self.fail_on_capture:
            raise RuntimeError("operation not permitted when stream is capturing (fake)")
        self.events.append("capture")
        return fn

    def reserve(self):
        self.events.append("reserve")

    def upload(self, copies):
        for dst, src in copies:
            dst[...] = src

    def launch(self, graph):
        self.events.append("launch")
        graph()

    def synchronize(self):
        pass

    def pool_bytes(self):
        return 4096

    def release(self):
        self.released = True


def test_default_batch_sizes():
    assert default_batch_sizes(256) == DEFAULT_BATCH_SIZES
    assert default_batch_sizes(1000) == DEFAULT_BATCH_SIZES
    assert default_batch_sizes(10) == (1, 2, 4, 8, 10)
    assert default_batch_sizes(8) == (1, 2, 4, 8)
    assert default_batch_sizes(1) == (1,)
    assert resolve_batch_sizes(EngineConfig(max_num_seqs=20)) == (1, 2, 4, 8, 16, 20)
    assert resolve_batch_sizes(EngineConfig(max_num_seqs=20, cuda_graph_batch_sizes=[12, 3, 3])) == (3, 12)
    assert resolve_batch_sizes(EngineConfig(max_num_seqs=256, max_num_batched_tokens=12)) == (1, 2, 4, 8, 12)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 300), min_size=1, max_size=10, unique=True), st.integers(0, 320))
def test_padded_size_is_the_smallest_size_that_fits(sizes, n):
    sizes = sorted(sizes)
    fits = [s for s in sizes if s >= n]
    assert padded_size(n, sizes) == (min(fits) if fits and n > 0 else None)


def test_config_validates_graph_settings():
    with pytest.raises(ValueError, match="enable_cuda_graphs must be a bool"):
        EngineConfig(enable_cuda_graphs=1)
    for bad in ([], [0, 4], [4, 300], "8", [2.0], [True]):
        with pytest.raises(ValueError, match="cuda_graph_batch_sizes"):
            EngineConfig(cuda_graph_batch_sizes=bad, max_num_seqs=256)
    assert EngineConfig(cuda_graph_batch_sizes=[8, 1, 8]).cuda_graph_batch_sizes == (1, 8)


def test_gpu_block_sizes_are_checked_before_anything_is_loaded():
    with pytest.raises(ValueError,
                       match="block_size 8 runs on the CPU backend only; on the GPU it must be one of 16, 32"):
        EngineConfig(device="cuda", block_size=8)
    assert EngineConfig(device="cuda", block_size=32).block_size == 32
    assert EngineConfig(device="cpu", block_size=8).block_size == 8


def _decode_batch(lens, tables):
    chunks = [SeqChunk([7 + i], n - 1, t) for i, (n, t) in enumerate(zip(lens, tables))]
    return build_forward_batch(chunks, BS)


def test_is_decode_step():
    assert is_decode_step(_decode_batch([5, 30], [[0], [1, 2]]))
    mixed = build_forward_batch([SeqChunk([1], 4, [0]), SeqChunk([1, 2], 0, [1])], BS)
    assert not is_decode_step(mixed)
    no_logits = build_forward_batch([SeqChunk([1], 4, [0], num_logits=0)], BS)
    assert not is_decode_step(no_logits)
    # A speculative verify step (the newest token and two drafts, three logits rows) runs eagerly.
    verify = build_forward_batch([SeqChunk([1], 4, [0]), SeqChunk([5, 6, 7], 9, [1], num_logits=3)], BS)
    assert not is_decode_step(verify)


def test_padding_rows_write_nothing_and_read_one_key_of_block_0():
    batch = _decode_batch([5, 40, 17], [[3], [4, 5, 6], [7, 8]])
    i64, i32, layout = pack_decode_batch(batch, 8, 4)
    got = unpack_batch(i64, i32, layout)
    np.testing.assert_array_equal(got.input_ids[:3], batch.input_ids)
    np.testing.assert_array_equal(got.positions[:3], batch.positions)
    np.testing.assert_array_equal(got.slot_mapping, list(batch.slot_mapping) + [-1] * 5)
    np.testing.assert_array_equal(got.query_start_loc, np.arange(9))
    np.testing.assert_array_equal(got.seq_lens, [5, 40, 17, 1, 1, 1, 1, 1])
    np.testing.assert_array_equal(got.logits_indices, np.arange(8))
    assert got.block_tables.shape == (8, 4)
    np.testing.assert_array_equal(got.block_tables[:3, :3], batch.block_tables)
    assert (got.block_tables[3:] == 0).all() and (got.block_tables[:, 3] == 0).all()
    empty = unpack_batch(*pack_decode_batch(None, 2, 4))
    assert (empty.slot_mapping == -1).all() and (empty.seq_lens == 1).all()
    with pytest.raises(ValueError, match="does not fit"):
        pack_decode_batch(batch, 2, 4)


def _model_and_caches(num_blocks=40):
    cfg, weights = random_model(layers=2, vocab=61)
    model = LlamaForCausalLM(cfg, weights)
    return (model, allocate_kv_caches(cfg, num_blocks, BS, model.backend),
            allocate_kv_caches(cfg, num_blocks, BS, model.backend))


def _zero(kv):
    return all(not k.any() and not v.any() for k, v in kv)


def test_replays_match_eager_steps_and_write_the_same_kv():
    model, kv_eager, kv_graph = _model_and_caches()
    capturer = FakeCapturer()
    graphs = DecodeGraphs(model, kv_graph, (1, 4, 8), max_blocks=6, capturer=capturer)
    assert graphs.capture_all() and graphs.enabled
    # every graph warmed up (measuring the memory), one reservation, then capture + test launch each
    assert capturer.events == ["warmup"] * 3 + ["reserve"] + ["capture", "launch"] * 3
    assert _zero(kv_graph), "capturing (padding rows only) must not write the KV cache"
    rng = np.random.default_rng(0)
    lens = [int(n) for n in rng.integers(2, 60, size=7)]
    tables = [list(range(4 * i, 4 * i + 4)) for i in range(7)]
    # prefill everything eagerly in both caches
    prompt = build_forward_batch([SeqChunk(rng.integers(0, 61, n - 1).tolist(), 0, t)
                                  for n, t in zip(lens, tables)], BS)
    model.forward(prompt, kv_eager)
    model.forward(prompt, kv_graph)
    for rows in ([0, 1, 2], [3], [0, 1, 2, 3, 4, 5, 6], [6, 2]):  # padded to 4, 1, 8, 4
        batch = _decode_batch([lens[i] for i in rows], [tables[i] for i in rows])
        ref = model.forward(batch, kv_eager)
        got = graphs.run(batch)
        assert got is not None and got.shape == ref.shape
        # A padded batch may take another BLAS kernel (M = 4 rows instead of 3): same math, other rounding.
        assert_close_model(got, ref, model.config)
        assert (got.argmax(1) == ref.argmax(1)).all()
        for (ke, ve), (kg, vg) in zip(kv_eager, kv_graph):  # same slots written, nothing else
            assert np.array_equal(kg == 0, ke == 0) and np.array_equal(vg == 0, ve == 0)
            assert_close_model(kg, ke, model.config)
            assert_close_model(vg, ve, model.config)
        for i in rows:
            lens[i] += 1
    assert graphs.num_replays == 4


def test_steps_a_graph_cannot_take_run_eagerly():
    model, _, kv = _model_and_caches()
    graphs = DecodeGraphs(model, kv, (1, 2), max_blocks=2, capturer=FakeCapturer())
    assert graphs.capture_all()
    prefill = build_forward_batch([SeqChunk([1, 2, 3], 0, [0])], BS)
    assert graphs.run(prefill) is None  # not a decode step
    assert graphs.run(_decode_batch([3, 4, 5], [[0], [1], [2]])) is None  # more rows than the largest size
    assert graphs.run(_decode_batch([40], [[0, 1, 2]])) is None  # longer than the captured table width
    assert graphs.run(_decode_batch([4, 20], [[0], [1, 2]])) is not None
    assert graphs.num_replays == 1


def test_a_capture_error_drops_every_graph_and_logs_it():
    model, _, kv = _model_and_caches()
    capturer = FakeCapturer(fail_on_capture=2)
    graphs = DecodeGraphs(model, kv, (1, 2, 4), max_blocks=2, capturer=capturer)
    with capture_logs() as logs:
        assert not graphs.capture_all()
    assert not graphs.enabled and capturer.released
    assert "batch size 2" in graphs.disabled_reason and "not permitted" in graphs.disabled_reason
    failed = [e for e in logs if e["event"] == "cuda_graphs.capture_failed"]
    assert len(failed) == 1 and failed[0]["batch_size"] == 2 and failed[0]["fallback"] == "eager"
    assert "RuntimeError" in failed[0]["error"] and "Traceback" in failed[0]["traceback"]
    assert graphs.run(_decode_batch([4], [[0]])) is None


def test_build_decode_graphs_only_on_the_gpu_and_when_enabled():
    model, _, kv = _model_and_caches()
    assert build_decode_graphs(EngineConfig(device="cpu"), model, kv, 64, FakeCapturer()) is None
    model.backend = type(model.backend)("cupy", np, np.dtype(np.float32), model.backend.ops)  # claims to be the GPU
    assert build_decode_graphs(EngineConfig(enable_cuda_graphs=False), model, kv, 64, FakeCapturer()) is None
    graphs = build_decode_graphs(EngineConfig(max_num_seqs=6), model, kv, 64, FakeCapturer())
    assert graphs is not None and graphs.sizes == (1, 2, 4, 6) and graphs.max_blocks == 4
    assert build_decode_graphs(EngineConfig(max_num_seqs=6), model, kv, 64, FakeCapturer(fail_on_capture=1)) is None


def test_engine_steps_through_graphs_give_the_eager_tokens(tiny):
    """The model runner's routing: decode steps replay graphs, prefill steps stay eager, and greedy and
    seeded outputs are the eager engine's."""
    def engine():
        return LLMEngine(EngineConfig(device="cpu", max_num_batched_tokens=64, num_kv_blocks=256, max_num_seqs=8,
                                      seed=0), loaded=tiny)

    def run(e):
        rng = np.random.default_rng(5)
        for i in range(6):
            params = SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=i, max_tokens=5 + 3 * i, ignore_eos=True)
            e.add_request(str(i), rng.integers(3, 500, size=int(rng.integers(3, 90))).tolist(), params)
        done = drain(e, max_steps=500)
        return {k: (v.outputs[0].token_ids, v.outputs[0].cumulative_logprob) for k, v in done.items()}

    eager = run(engine())
    e = engine()
    e.runner.graphs = DecodeGraphs(e.model, e.runner.kv_caches, (1, 2, 4, 8), -(-e.max_model_len // 16),
                                   FakeCapturer())
    assert e.runner.graphs.capture_all()
    with_graphs = run(e)
    assert e.runner.graphs.num_replays > 10
    assert {k: v[0] for k, v in with_graphs.items()} == {k: v[0] for k, v in eager.items()}
    # Cumulative logprobs: each token's logprob moves by at most twice the logits' rounding tolerance.
    probe = build_forward_batch([SeqChunk(list(range(3, 90)), 0, list(range(6)))], 16)
    scale = float(np.abs(LlamaForCausalLM(tiny.config, tiny.weights).forward(
        probe, allocate_kv_caches(tiny.config, 6, 16, e.model.backend))).max())
    for k in eager:
        tol = len(eager[k][0]) * 2 * model_tol(tiny.config, scale)
        assert with_graphs[k][1] == pytest.approx(eager[k][1], rel=0, abs=tol)


def test_context_buckets_double_the_partitions_up_to_max_model_len():
    # block_size 16: 32 blocks per 512-key attention partition
    assert context_buckets(131072 // 16, 16) == (32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
    assert context_buckets(80, 16) == (32, 64, 80)
    assert context_buckets(6, 16) == (6,)
    assert context_buckets(100, 32) == (16, 32, 64, 100)


def test_replays_use_the_narrowest_bucket_and_upload_only_its_width():
    """A batch of short sequences replays the 1-partition graph and copies 32 table columns, not the
    80 of max_model_len; a batch with one 600-token sequence takes the 64-column graph. Both give the
    eager logits and KV."""
    model, kv_eager, kv_graph = _model_and_caches(num_blocks=200)
    capturer = FakeCapturer()
    graphs = DecodeGraphs(model, kv_graph, (1, 4), max_blocks=80, capturer=capturer)
    assert graphs.capture_all()
    assert sorted(graphs.captured) == [(1, 32), (1, 64), (1, 80), (4, 32), (4, 64), (4, 80)]
    rng = np.random.default_rng(3)
    lens = [30, 600, 45]
    tables = [list(range(0, 2)), list(range(2, 41)), list(range(41, 44))]
    prompt = build_forward_batch([SeqChunk(rng.integers(0, 61, n - 1).tolist(), 0, t)
                                  for n, t in zip(lens, tables)], BS)
    model.forward(prompt, kv_eager)
    model.forward(prompt, kv_graph)
    for rows, width in (([0, 2], 32), ([0, 1, 2], 64), ([1], 64)):
        batch = _decode_batch([lens[i] for i in rows], [tables[i] for i in rows])
        ref = model.forward(batch, kv_eager)
        got = graphs.run(batch)
        assert got is not None
        assert_close_model(got, ref, model.config)  # padded rows: another BLAS kernel, same math
        size = padded_size(len(rows), graphs.sizes)
        assert graphs.upload_bytes == 4 * size * 8 + (2 * size + 1 + size * width) * 4
        for i in rows:
            lens[i] += 1
    for (ke, ve), (kg, vg) in zip(kv_eager, kv_graph):  # same slots written, nothing else
        assert np.array_equal(kg == 0, ke == 0) and np.array_equal(vg == 0, ve == 0)
        assert_close_model(kg, ke, model.config)
        assert_close_model(vg, ve, model.config)


class RetryingPool:
    """CuPy's SingleDeviceMemoryPool in miniature: freed blocks are cached for reuse; when the
    underlying allocator fails, every cached block is given back to it and the allocation retried."""

    def __init__(self, allocate, give_back):
        self.allocate, self.give_back = allocate, give_back
        self.cached: dict[int, list[int]] = {}
        self.retries = 0

    def malloc(self, size):
        if self.cached.get(size):
            return self.cached[size].pop()
        try:
            return self.allocate(size)
        except MemoryError:
            self.retries += 1
            for blocks in self.cached.values():
                for b in blocks:
                    self.give_back(b)
            self.cached.clear()
            return self.allocate(size)

    def free(self, address, size):
        self.cached.setdefault(size, []).append(address)


class Device:
    """cudaMalloc / cudaFree over a small address space, first fit: freed memory is handed out again."""

    def __init__(self, capacity):
        self.capacity, self.live = capacity, {}

    def malloc(self, size):
        start = 0
        for a in sorted(self.live):
            if a - start >= size:
                break
            start = max(start, a + self.live[a])
        if start + size > self.capacity:
            raise MemoryError("out of memory")
        self.live[start] = size
        return start

    def free(self, address):
        del self.live[address]


def _capture_two_graphs(pool):
    """Graph A's temporaries are freed into the pool after its capture (the graph still writes there on
    every replay); graph B's capture then needs a size the cache cannot serve."""
    graph_a = [pool.malloc(1024) for _ in range(3)]
    for address in graph_a:
        pool.free(address, 1024)
    graph_b = [pool.malloc(2048)]
    return graph_a, graph_b


def _overlaps(a_blocks, a_size, b_blocks, b_size):
    return any(a < b + b_size and b < a + a_size for a in a_blocks for b in b_blocks)


def test_a_pool_retry_over_the_driver_aliases_a_graphs_memory():
    """Why the arena exists: over plain cudaMalloc the retry frees graph A's blocks and the driver hands
    the same bytes to graph B, so replaying A overwrites B's data."""
    device = Device(capacity=4096)
    pool = RetryingPool(device.malloc, device.free)
    graph_a, graph_b = _capture_two_graphs(pool)
    assert pool.retries == 1 and _overlaps(graph_a, 1024, graph_b, 2048)


def test_the_graph_arena_never_hands_out_the_same_bytes_twice():
    arena = ArenaAllocator(base=1 << 20, capacity=8192)
    pool = RetryingPool(arena.allocate, lambda address: None)  # giving back to the arena returns nothing
    # The arena is sized for A and B: no retry is needed, and none could alias anyway.
    graph_a, graph_b = _capture_two_graphs(pool)
    assert not _overlaps(graph_a, 1024, graph_b, 2048)
    assert all(a % ArenaAllocator.ALIGNMENT == 0 for a in graph_a + graph_b)
    # Too small for B: the pool's retry cannot alias A either; it fails, and capture_all drops the graphs.
    small = ArenaAllocator(base=0, capacity=3 * 1024 + 1000)
    pool = RetryingPool(small.allocate, lambda address: None)
    with pytest.raises(ArenaExhausted, match="2048 bytes requested"):
        _capture_two_graphs(pool)
    assert pool.retries == 1


def test_graph_pool_reserve_adds_a_margin():
    assert graph_pool_reserve(0) == 8 << 20
    assert graph_pool_reserve(400 << 20) == (500 << 20) + (8 << 20)


def test_decode_graphs_serve_adapters_from_the_slots_as_they_are_at_replay(tmp_path):
    """A model with LoRA slots is captured with its LoRA kernels reading a static per-row slot buffer: replays of
    mixed decode steps (two adapters and the base, padded) give the eager step's logits, and an adapter copied into
    a slot after the capture (the slot tables are written in place) is what the next replay serves. (Before, steps
    with adapter rows could not replay: the graphs had no LoRA, so a replay gave the base's logits.)"""
    from lora_helpers import make_lora
    from pagedserve.models import lora as model_lora
    from pagedserve.models.loading.peft import load_peft_adapter

    model, kv_eager, kv_graph = _model_and_caches()
    cfg = model.config
    adapters = [load_peft_adapter(make_lora(tmp_path / f"a{k}", cfg, rank=4, std=0.3, seed=k, **t), cfg)
                for k, t in enumerate([{}, {"targets": ("q_proj", "v_proj")}, {}])]
    model_lora.attach(model, {}, max_loras=3, max_lora_rank=4)
    model.lora.set(0, adapters[0])
    graphs = DecodeGraphs(model, kv_graph, (1, 4, 8), max_blocks=6, capturer=FakeCapturer())
    assert graphs.capture_all() and _zero(kv_graph)
    model.lora.set(2, adapters[1])  # after the capture
    rng = np.random.default_rng(1)
    lens = [int(n) for n in rng.integers(2, 40, size=5)]
    tables = [list(range(4 * i, 4 * i + 4)) for i in range(5)]
    slots = [0, -1, 2, 0, 2]
    prompt = build_forward_batch([SeqChunk(rng.integers(0, 61, n - 1).tolist(), 0, t, lora_slot=s)
                                  for n, t, s in zip(lens, tables, slots)], BS)
    model.forward(prompt, kv_eager)
    model.forward(prompt, kv_graph)

    def decode(rows):
        return build_forward_batch([SeqChunk([7 + i], lens[i] - 1, tables[i], lora_slot=slots[i]) for i in rows], BS)

    for step, rows in enumerate(([0, 1, 2], [0, 1, 2, 3, 4], [1], [4, 2])):
        if step == 2:
            model.lora.set(0, adapters[2])  # another adapter in slot 0: the graphs read it at replay
        batch = decode(rows)
        ref = model.forward(batch, kv_eager)
        got = graphs.run(batch)
        assert got is not None
        assert_close_model(got, ref, model.config)
        base = model.forward(replace_slots(batch), [(k.copy(), v.copy()) for k, v in kv_eager])  # no adapters
        if any(slots[i] >= 0 for i in rows):
            assert np.abs(ref - base).max() > 100 * model_tol(model.config, np.abs(base).max())
        for i in rows:
            lens[i] += 1
    assert graphs.num_replays == 4
    with pytest.raises(ValueError, match="lora_slots"):
        graphs.run(replace_slots(decode([0]), np.array([3], dtype=np.int32)))


def replace_slots(batch, slots=None):
    from dataclasses import replace

    return replace(batch, lora_slots=slots)
