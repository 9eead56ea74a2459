"""The GPU path above the kernels (GPU only: every test is marked `gpu`): metadata uploaded once per
step, CUDA graph replays against eager steps, the capture-error fallback, on-device sampling, KV
sizing, and the engine end to end.

Like test_cuda_ops.py this runs under pytest or tests/cupy_kernels/_mini_runner.py (no fixtures);
tests that need the engine's optional dependencies (tokenizers, structlog) skip without them.
Measured numbers go to PAGEDSERVE_GPU_ERRORS (see scripts/gpu_check.sh).
"""

from __future__ import annotations

import gc
import importlib.util
from pathlib import Path

import numpy as np
import pytest


def _gpu_tests():
    """test_cuda_ops.py's helpers (models, record), loaded under a name of our own."""
    spec = importlib.util.spec_from_file_location("pagedserve_gpu_tests_runtime",
                                                  Path(__file__).with_name("test_cuda_ops.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


T = _gpu_tests()
BS = 16


def _cp():
    import cupy

    return cupy


def _host(a) -> np.ndarray:
    return a.get() if hasattr(a, "get") else np.asarray(a)


def _prefill(model, kv_list, lens, tables, seed=0):
    from pagedserve.models.batch import SeqChunk, build_forward_batch

    rng = np.random.default_rng(seed)
    batch = build_forward_batch([SeqChunk(rng.integers(0, model.config.vocab_size, n).tolist(), 0, t)
                                 for n, t in zip(lens, tables)], BS)
    return [_host(model.forward(batch, kv)) for kv in kv_list]


def _decode(lens, tables, rows, vocab):
    from pagedserve.models.batch import SeqChunk, build_forward_batch

    return build_forward_batch([SeqChunk([(7 * i) % vocab], lens[i], tables[i]) for i in rows], BS)


@pytest.mark.gpu
def test_device_metadata_and_table_width_change_nothing():
    """Host metadata (checked, trimmed, uploaded once by the forward) and device metadata with tables
    four times wider than needed give bit-identical logits: the attention's partition split depends
    on each sequence's length only."""
    cp = _cp()
    from pagedserve.cupy_kernels.backend import get_backend
    from pagedserve.models.device_batch import pack_batch, unpack_batch
    from pagedserve.models.kv_cache import allocate_kv_caches

    _, gpu = T._model_pair("tiny-llama")
    lens, tables = [700, 33, 5], [list(range(0, 44)), list(range(44, 47)), [47]]
    kv_a = allocate_kv_caches(gpu.config, 64, BS, get_backend("cuda"))
    _prefill(gpu, [kv_a], lens, tables)
    kv_b = [(k.copy(), v.copy()) for k, v in kv_a]
    for step in range(3):
        batch = _decode([n + step for n in lens], tables, [0, 1, 2], gpu.config.vocab_size)
        ref = _host(gpu.forward(batch, kv_a))
        i64, i32, layout = pack_batch(batch, 4 * 44)
        got = _host(gpu.forward(unpack_batch(cp.asarray(i64), cp.asarray(i32), layout), kv_b))
        np.testing.assert_array_equal(got, ref)


def _graph_check(name: str, capturer=None):
    """Graph replays against eager steps on two copies of one KV cache. `capturer`: CupyGraphCapturer
    on a GPU; test_kernels_on_host.py passes a fake to run the same check on the emulated kernels."""
    from pagedserve.cupy_kernels.backend import get_backend
    from pagedserve.models.kv_cache import allocate_kv_caches
    from pagedserve.runtime.worker.cuda_graphs import CupyGraphCapturer, DecodeGraphs

    _, gpu = T._model_pair(name)
    cfg = gpu.config
    max_model_len = 1024
    lens = [700, 37, 120, 5, 300, 64, 1, 530]  # 700 and 530 decode in two partitions
    tables, at = [], 0
    for n in lens:
        nb = -(-(n + 16) // BS)
        tables.append(list(range(at, at + nb)))
        at += nb
    kv_e = allocate_kv_caches(cfg, at + 8, BS, get_backend("cuda"))
    _prefill(gpu, [kv_e], lens, tables)
    kv_g = [(k.copy(), v.copy()) for k, v in kv_e]
    graphs = DecodeGraphs(gpu, kv_g, (1, 2, 4, 8), -(-max_model_len // BS), capturer or CupyGraphCapturer())
    assert graphs.capture_all(), graphs.disabled_reason
    # 1. batches of exactly a captured size: the same kernels on the same shapes. Checked within
    # tolerance first (a wrong replay is far off), then bit for bit, which also needs cuBLAS to pick
    # the same GEMM algorithm under capture as eagerly (reported last, with its own message).
    bitwise = []
    for step, rows in enumerate([list(range(8)), [0, 1, 2, 3], [4, 5, 6, 7], [3], [6, 1]]):
        batch = _decode(lens, tables, rows, cfg.vocab_size)
        ref = _host(gpu.forward(batch, kv_e))
        got = _host(graphs.run(batch))
        assert got.shape == ref.shape
        T._compare_logits(got, ref, f"graphs/{name}/exact{step}")
        same = bool(np.array_equal(got, ref))
        for layer, ((ke, ve), (kg, vg)) in enumerate(zip(kv_e, kv_g)):
            for what, e, g in (("K", ke, kg), ("V", ve, vg)):
                e, g = _host(e).astype(np.float32), _host(g).astype(np.float32)
                gap = float(np.abs(e - g).max())
                assert gap <= 0.02 * float(np.abs(e).max()) + 1e-3, \
                    f"{name}: {what} cache of layer {layer} differs by {gap} after step {step} (a stray write?)"
                same = same and gap == 0.0
        bitwise.append(same)
        for i in rows:
            lens[i] += 1
        if step == 1:  # eager work between replays must not land in the graphs' memory, nor they in its
            scratch = allocate_kv_caches(cfg, 40, BS, get_backend("cuda"))
            _prefill(gpu, [scratch], [300, 100], [list(range(19)), list(range(19, 26))], seed=9)
            del scratch
    # 2. padded batches: row results may differ in the last bits (cuBLAS picks per M)
    worst = 0.0
    for step, rows in enumerate([[0, 1, 2], [0, 2, 4, 5, 7], [1, 3, 5, 6, 7]]):
        batch = _decode(lens, tables, rows, cfg.vocab_size)
        ref = _host(gpu.forward(batch, kv_e))
        got = _host(graphs.run(batch))
        assert got.shape == ref.shape
        T._compare_logits(got, ref, f"graphs/{name}/padded{step}")
        worst = max(worst, float(np.abs(got - ref).max()))
        for i in rows:
            lens[i] += 1
    T.record(f"graphs/{name}", padded_max_abs_diff=worst, replays=graphs.num_replays,
             capture_seconds=graphs.capture_seconds, exact_steps_bitwise=float(all(bitwise)))
    assert graphs.num_replays == 8
    assert all(bitwise), (f"{name}: exact-size replays are close to the eager steps but not bit-identical "
                          f"(per step: {bitwise}); cuBLAS likely chose another GEMM algorithm under capture")


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["tiny-llama", "random-smollm2"])
def test_decode_graph_replays_match_eager_steps(name):
    _graph_check(name)


class _SyncingModel:
    """A model whose forward reads a device value back to the host: illegal while capturing."""

    def __init__(self, model):
        self.model, self.config, self.backend = model, model.config, model.backend

    def forward(self, batch, kv):
        if int(batch.seq_lens.sum()) < 0:  # a device -> host copy
            raise AssertionError
        return self.model.forward(batch, kv)


@pytest.mark.gpu
def test_capture_error_falls_back_to_eager_and_the_device_stays_usable():
    from pagedserve.cupy_kernels.backend import get_backend
    from pagedserve.models.kv_cache import allocate_kv_caches
    from pagedserve.runtime.worker.cuda_graphs import CupyGraphCapturer, DecodeGraphs

    _, gpu = T._model_pair("tiny-llama")
    kv = allocate_kv_caches(gpu.config, 16, BS, get_backend("cuda"))
    before = _prefill(gpu, [kv], [20, 3], [[0, 1], [2]])[0]
    capturer = CupyGraphCapturer()
    graphs = DecodeGraphs(_SyncingModel(gpu), kv, (1, 2), 4, capturer)
    assert not graphs.capture_all() and not graphs.enabled
    assert "batch size 2" in graphs.disabled_reason
    assert not capturer.stream.is_capturing()
    assert capturer.pool_bytes() < 16 * 2**20  # what the failed capture held went back to the driver
    assert graphs.run(_decode([20, 3], [[0, 1], [2]], [0, 1], gpu.config.vocab_size)) is None
    kv2 = allocate_kv_caches(gpu.config, 16, BS, get_backend("cuda"))
    after = _prefill(gpu, [kv2], [20, 3], [[0, 1], [2]])[0]  # eager work still runs, with the same result
    np.testing.assert_array_equal(after, before)


@pytest.mark.gpu
def test_graph_pool_draws_only_from_the_reserved_arena():
    """Every block of the private graph pool lies inside the arena reserved before capture, and an
    arena too small fails the capture (graphs dropped) instead of a pool retry that frees graph memory."""
    from pagedserve.cupy_kernels.backend import get_backend
    from pagedserve.models.kv_cache import allocate_kv_caches
    from pagedserve.runtime.worker import cuda_graphs
    from pagedserve.runtime.worker.cuda_graphs import CupyGraphCapturer, DecodeGraphs

    _, gpu = T._model_pair("tiny-llama")
    kv = allocate_kv_caches(gpu.config, 64, BS, get_backend("cuda"))
    capturer = CupyGraphCapturer()
    graphs = DecodeGraphs(gpu, kv, (1, 4), 64, capturer)
    assert graphs.capture_all(), graphs.disabled_reason
    arena = capturer.arena
    assert arena is not None and arena.num_allocations > 0 and 0 < arena.used <= arena.capacity
    assert capturer.pool.total_bytes() <= arena.capacity
    graphs.disable("test")
    saved = cuda_graphs.GRAPH_POOL_MARGIN, cuda_graphs.GRAPH_POOL_SLACK_BYTES
    try:
        cuda_graphs.GRAPH_POOL_MARGIN, cuda_graphs.GRAPH_POOL_SLACK_BYTES = -0.9, 0
        small = DecodeGraphs(gpu, kv, (1, 4), 64, CupyGraphCapturer())
        assert not small.capture_all() and "arena" in small.disabled_reason
    finally:
        cuda_graphs.GRAPH_POOL_MARGIN, cuda_graphs.GRAPH_POOL_SLACK_BYTES = saved


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_greedy_argmax_goes_through_argmax_rows_with_numpys_rule(dtype):
    cp = _cp()
    from pagedserve.runtime.engine.model_runner import _DeviceArrayModule

    xp = _DeviceArrayModule(cp)
    logits = np.random.default_rng(1).standard_normal((6, 3000)).astype(dtype)
    logits[1, [5, 2000]] = 40  # tie: the first index
    logits[2, [900, 17]] = np.nan  # NaN: the first NaN
    logits[3] = -np.inf
    got = xp.argmax(cp.asarray(logits), axis=1)
    np.testing.assert_array_equal(_host(got), np.argmax(logits, axis=1))
    flags = cp.asarray(logits > 0)  # anything else goes to cupy.argmax
    np.testing.assert_array_equal(_host(xp.argmax(flags, axis=1)), np.argmax(logits > 0, axis=1))
    assert xp.float32 is cp.float32


@pytest.mark.gpu
def test_sampler_on_device_matches_numpy():
    """Every sampler path on CuPy arrays against the numpy sampler on the same logits and uniforms."""
    cp = _cp()
    from pagedserve.runtime.engine.model_runner import _DeviceArrayModule
    from pagedserve.runtime.sample.sampler import Sampler
    from pagedserve.runtime.sampling_params import SamplingParams

    rng = np.random.default_rng(3)
    vocab = 4096
    logits = (rng.standard_normal((12, vocab)) * 3).astype(np.float32)
    params = [
        SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, logprobs=5),
        SamplingParams(temperature=0.8, seed=1), SamplingParams(temperature=1.0, top_k=20, seed=2),
        SamplingParams(temperature=0.7, top_p=0.9, seed=3), SamplingParams(temperature=1.2, top_p=0.999, seed=4),
        SamplingParams(temperature=1.0, min_p=0.1, seed=5), SamplingParams(temperature=0.9, top_k=50, top_p=0.8, seed=6),  # noqa: E501
        SamplingParams(temperature=0.0, repetition_penalty=1.3), SamplingParams(temperature=1.0, presence_penalty=0.5,
                                                                                frequency_penalty=0.3, seed=7),
        SamplingParams(temperature=1.0, logprobs=3, seed=8), SamplingParams(temperature=0.0, logprobs=0),
    ]
    prompts = [rng.integers(0, vocab, 30).tolist() for _ in params]
    outputs = [rng.integers(0, vocab, 10).tolist() for _ in params]
    banned = [[int(np.argmax(logits[0]))]] + [[] for _ in params[1:]]

    def run(xp, arr):
        gens = [np.random.default_rng(p.seed) if p.seed is not None else None for p in params]
        return Sampler(0)(arr, params, gens, prompts, outputs, xp=xp, banned_token_ids=banned)

    ref = run(np, logits)
    got = run(_DeviceArrayModule(cp), cp.asarray(logits))
    assert isinstance(got.token_ids, np.ndarray) and isinstance(got.logprobs, np.ndarray)
    np.testing.assert_array_equal(got.token_ids, ref.token_ids)
    np.testing.assert_allclose(got.logprobs, ref.logprobs, rtol=1e-5, atol=1e-5)
    for g, r in zip(got.top_logprobs, ref.top_logprobs):
        if r is None:
            assert g is None
            continue
        assert [t for t, _ in g] == [t for t, _ in r]
        np.testing.assert_allclose([v for _, v in g], [v for _, v in r], rtol=1e-5, atol=1e-5)


def _tiny_loaded():
    try:
        import structlog  # noqa: F401
        import tokenizers  # noqa: F401
        from pagedserve.models.loading.loader import load_model
    except ImportError as e:
        pytest.skip(f"the engine needs its optional dependencies: {e}")
    return load_model(T.DATA / "tiny-llama")


def _generate(engine, requests):
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    done = {}
    for _ in range(5_000):  # bounded (this file also runs under _mini_runner, without engine_helpers' pytest.fail)
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                done[out.request_id] = [(c.token_ids, c.cumulative_logprob) for c in out.outputs]
    assert not engine.has_unfinished_requests(), "requests still unfinished after 5,000 steps"
    return done


@pytest.mark.gpu
def test_engine_on_gpu_same_tokens_with_and_without_graphs():
    """Four sequences decoding together (a captured size, so replays are bit-exact): greedy, seeded
    sampling and parallel sampling give the same tokens and logprobs with graphs on and off."""
    from pagedserve.runtime.config import EngineConfig
    from pagedserve.runtime.engine.llm_engine import LLMEngine
    from pagedserve.runtime.sampling_params import SamplingParams

    loaded = _tiny_loaded()
    rng = np.random.default_rng(2)
    requests = [
        ("greedy", rng.integers(3, 500, 40).tolist(), SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)),
        ("seeded", rng.integers(3, 500, 7).tolist(), SamplingParams(temperature=0.9, top_p=0.9, seed=5, max_tokens=24,
                                                                    ignore_eos=True)),
        ("n2", rng.integers(3, 500, 90).tolist(), SamplingParams(temperature=1.0, top_k=40, seed=6, n=2, max_tokens=24,
                                                                 ignore_eos=True, logprobs=2)),
    ]
    results = {}
    for graphs_on in (True, False):
        engine = LLMEngine(EngineConfig(device="cuda", num_kv_blocks=256, max_num_seqs=4, enable_cuda_graphs=graphs_on,
                                        cuda_graph_batch_sizes=(1, 2, 4), seed=0), loaded=loaded)
        assert (engine.runner.graphs is not None) == graphs_on
        results[graphs_on] = _generate(engine, requests)
        if graphs_on:
            replays = engine.runner.graphs.num_replays
            assert replays >= 20, replays
            T.record("engine/tiny-llama", graph_replays=replays)
        del engine
        gc.collect()
    assert results[True] == results[False], (
        "engine outputs differ with CUDA graphs on and off; if graphs/tiny-llama exact_steps_bitwise is 0 in "
        "gpu_results.json, replays differ from eager steps in the last bits (cuBLAS algorithm under capture) "
        "and sampling amplified it; otherwise the graph path is wrong")


@pytest.mark.gpu
def test_speculative_decoding_on_gpu_keeps_greedy_tokens_and_frees_both_pools():
    """Verify steps (eager, 1 + k logits rows), the rejection sampler on CuPy arrays and a draft model's own
    pool on the device: greedy tokens equal the run without speculation; seeded sampling runs through."""
    from pagedserve.runtime.config import EngineConfig
    from pagedserve.runtime.engine.llm_engine import LLMEngine
    from pagedserve.runtime.sampling_params import SamplingParams

    loaded = _tiny_loaded()
    rng = np.random.default_rng(3)
    base = rng.integers(3, 500, 12).tolist()
    requests = [("rep", base * 3, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)),
                ("plain", rng.integers(3, 500, 30).tolist(), SamplingParams(temperature=0.0, max_tokens=24,
                                                                            ignore_eos=True))]
    sampled = [("s", base * 2, SamplingParams(temperature=1.0, top_p=0.9, seed=3, max_tokens=16, ignore_eos=True))]
    results = {}
    # min_acceptance_rate 0: always speculate (the policy could switch drafts off; this checks exactness).
    for name, spec in (("off", None), ("ngram", {"method": "ngram", "prompt_lookup_min": 1, "min_acceptance_rate": 0.0}),  # noqa: E501
                       ("draft", {"method": "draft", "draft_num_layers": 1, "num_speculative_tokens": 3,
                                  "min_acceptance_rate": 0.0})):
        engine = LLMEngine(EngineConfig(device="cuda", num_kv_blocks=256, max_num_seqs=4, seed=0,
                                        speculative_config=spec), loaded=loaded)
        results[name] = _generate(engine, requests)
        _generate(engine, sampled)
        assert engine.kv_manager.usage().num_used_blocks == 0
        if spec is not None:
            assert engine.spec.stats.num_draft_tokens > 0
            if engine.spec.draft is not None:
                assert engine.spec.draft.kv.usage().num_used_blocks == 0
        del engine
        gc.collect()
    tokens = {k: {rid: [t for t, _ in v[rid]] for rid in v} for k, v in results.items()}
    assert tokens["ngram"] == tokens["off"] and tokens["draft"] == tokens["off"]


@pytest.mark.gpu
def test_kv_sizing_fills_gpu_memory_utilization():
    """After the engine sized its KV pool from the profile and ran a full-budget prefill and decodes,
    device memory in use is gpu_memory_utilization x total, within 512 MiB either way."""
    cp = _cp()
    from pagedserve.runtime.config import EngineConfig
    from pagedserve.runtime.engine.llm_engine import LLMEngine
    from pagedserve.runtime.sampling_params import SamplingParams

    loaded = _tiny_loaded()
    gc.collect()
    util = 0.1
    engine = LLMEngine(EngineConfig(device="cuda", gpu_memory_utilization=util, max_num_batched_tokens=2048,
                                    max_num_seqs=32, max_model_len=2048), loaded=loaded)
    s = engine.kv_sizing
    assert s is not None and s.num_blocks == engine.num_kv_blocks
    assert s.activation_peak_bytes > 0 and s.cuda_graph_bytes > 0 and s.weights_bytes > 0
    rng = np.random.default_rng(0)
    requests = [(f"r{i}", rng.integers(3, 500, 1000 if i < 2 else 3).tolist(),
                 SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)) for i in range(16)]
    _generate(engine, requests)
    cp.cuda.Device().synchronize()
    free, total = cp.cuda.runtime.memGetInfo()
    used = total - free
    target = util * total
    T.record("kv_sizing/tiny-llama", used_minus_target_mib=(used - target) / 2**20,
             activation_peak_mib=s.activation_peak_bytes / 2**20, cuda_graph_mib=s.cuda_graph_bytes / 2**20,
             non_pool_mib=s.non_pool_bytes / 2**20, kv_gib=s.kv_cache_bytes / 2**30)
    assert abs(used - target) <= 512 * 2**20, (used / 2**30, target / 2**30, s.log_fields())
    del engine
    gc.collect()


@pytest.mark.gpu
def test_activation_check_catches_a_float16_overflow_the_cpu_does_not_have():
    """Weights within float16's range whose MLP output is not: float32 on the CPU is fine, float16 on
    the GPU overflows to inf, and the debug check names where."""
    from pagedserve.cupy_kernels.backend import get_backend
    from pagedserve.models.activation_check import NonFiniteActivationError
    from pagedserve.models.batch import SeqChunk, build_forward_batch
    from pagedserve.models.kv_cache import allocate_kv_caches
    from pagedserve.models.llama import LlamaForCausalLM

    cfg, weights = T._load_tiny("tiny-llama")
    weights = dict(weights)
    weights["model.layers.0.mlp.down_proj.weight"] = np.full_like(weights["model.layers.0.mlp.down_proj.weight"], 6e4)
    batch = build_forward_batch([SeqChunk([5, 6, 7, 8], 0, [0])], BS)
    cpu = LlamaForCausalLM(cfg, weights, get_backend("cpu"))
    cpu.check_activations = True
    cpu.forward(batch, allocate_kv_caches(cfg, 4, BS, cpu.backend))
    assert max(cpu.activation_peaks.values()) > 65504  # float32 holds it
    gpu = LlamaForCausalLM(cfg, weights, get_backend("cuda"))
    gpu.check_activations = True
    with pytest.raises(NonFiniteActivationError, match="float16 overflows above 65504"):
        gpu.forward(batch, allocate_kv_caches(cfg, 4, BS, gpu.backend))


@pytest.mark.gpu
def test_device_sampler_with_cupy_reads_back_once_and_matches_the_host_path():
    """The sampler's device path with real CuPy arrays (its API: argsort, cumsum with dtype, scatter
    with broadcast indices, one packed .get()): tokens as the numpy path gives them where both walk the
    same order, top-p draws inside the nucleus."""
    cp = _cp()
    from pagedserve.runtime.sample import sampling_device
    from pagedserve.runtime.engine.model_runner import _DeviceArrayModule
    from pagedserve.runtime.sample.sampler import Sampler

    spec = importlib.util.spec_from_file_location(
        "pagedserve_sampling_device_tests", Path(__file__).resolve().parents[1] / "runtime" / "test_sampling_device.py")
    S = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(S)
    params = S._params()
    logits = S._logits(len(params), 8192, seed=11)
    gets = []
    real_fetch = sampling_device.fetch
    sampling_device.fetch = lambda parts, xp: gets.append(len(parts)) or real_fetch(parts, xp)

    def run(xp, arr):
        gens = [np.random.default_rng(p.seed) if p.seed is not None else None for p in params]
        return Sampler(0)(arr, params, gens, [[1, 2, 3]] * len(params), [[5, 5, 9]] * len(params), xp=xp,
                          banned_token_ids=[[], [7], [], [], [], [], [], []])

    try:
        dev = run(_DeviceArrayModule(cp), cp.asarray(logits))
    finally:
        sampling_device.fetch = real_fetch
    host = run(np, logits)
    assert len(gets) == 2  # the device call's one transfer, and the host call's
    same = [0, 1, 2, 4, 5, 6]
    np.testing.assert_array_equal(dev.token_ids[same], host.token_ids[same])
    for b in (3, 7):
        x = logits[b] / params[b].temperature
        keep, _ = sampling_device.nucleus_mask(x[None], np.array([params[b].top_p], np.float32), np)
        assert keep[0, dev.token_ids[b]]
    assert [t for t, _ in dev.top_logprobs[3]] == [t for t, _ in host.top_logprobs[3]]
