"""Tensor parallelism on CPU: ranks as local processes, 1 BLAS thread each.

The claim is "the same model": greedy tokens equal TP=1's, and logits agree to float32 rounding. A
rank's row-parallel matmul sums its part of each dot product and the all-reduce adds the parts, so each
of the 2 x layers row-parallel reductions differs from TP=1's only in the order of its float32
additions; column-parallel matmuls compute the very same dot products, and the vocab-parallel embedding
adds exact zeros. That is what tests/numerics.py's model tolerance covers (sqrt(depth * n) * u * scale,
8 sigmas), so logits are compared with it; a wrong head, KV head or missing bias moves them by O(1).
"""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest
from engine_helpers import drain
from numerics import assert_close_model

from pagedserve.models.batch import SeqChunk, build_forward_batch
from pagedserve.models.loading.gguf_loader import is_quant_name
from pagedserve.models.loading.loader import load_model
from pagedserve.models.tensor_parallel import TPShard
from pagedserve.runtime import LLM, SamplingParams
from pagedserve.runtime.config import EngineConfig
from pagedserve.runtime.engine.llm_engine import LLMEngine
from pagedserve.runtime.executor import WorkerFailedError
from pagedserve.runtime.executor.mp_executor import check_world_size
from pagedserve.runtime.worker.worker import ExecuteModelRequest

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
PROMPTS = ["hello there", "the quick brown fox jumps over", "1 2 3 4 5 6 7 8 9 10 11 12 13 14"]


def _engine(model, tp: int, **kw) -> LLMEngine:
    cfg = dict(device="cpu", cpu_threads=1, num_kv_blocks=64, max_num_batched_tokens=64, seed=0,
               tensor_parallel_size=tp, collective_timeout_s=30.0)
    return LLMEngine(EngineConfig(model=str(model), **{**cfg, **kw}))


def _generate(engine: LLMEngine, prompts=PROMPTS, params=GREEDY) -> list[list[int]]:
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    done = drain(engine, max_steps=500)
    return [done[str(i)].outputs[0].token_ids for i in range(len(prompts))]


def _prefill_logits(engine: LLMEngine, ids: list[int]) -> np.ndarray:
    """Logits of every position of one prompt, through the executor (blocks 0.. of a fresh pool)."""
    table = list(range(-(-len(ids) // engine.block_size)))
    batch = build_forward_batch([SeqChunk(ids, 0, table, num_logits=len(ids))], engine.block_size)
    return np.asarray(engine.executor.execute_model(ExecuteModelRequest(batch)))


def _check_same_model(model, tp: int) -> None:
    one = _engine(model, 1)
    many = _engine(model, tp)
    try:
        assert many.executor.world_size == tp and len(many.executor.procs) == tp - 1
        ids = one.tokenizer.encode(PROMPTS[1] * 3)
        ref, got = _prefill_logits(one, ids), _prefill_logits(many, ids)
        assert got.shape == ref.shape == (len(ids), one.model_config.vocab_size)
        assert_close_model(got, ref, one.model_config)
        assert (got.argmax(1) == ref.argmax(1)).all()
        # _prefill_logits wrote KV slots the block manager does not know of; requests overwrite before reading.
        assert _generate(many) == _generate(one)
        many.check_integrity()
    finally:
        many.shutdown()


def test_tp2_is_the_same_model_on_tiny_llama(data_dir):
    _check_same_model(data_dir / "tiny-llama", 2)  # 2 heads, 1 KV head replicated, untied lm_head


def test_tp3_is_the_same_model_on_tiny_qwen2_with_biases(data_dir):
    # 3 heads (so TP=3, not 2), 1 KV head replicated on every rank, q/k/v biases sliced with their rows,
    # intermediate 128 split 43/43/42, tied embeddings (vocab-parallel embedding doubles as lm_head).
    _check_same_model(data_dir / "tiny-qwen2", 3)


def test_tp2_is_the_same_model_with_llama_attention_bias(data_dir, tmp_path):
    # q/k/v biases sliced with their rows; the o_proj bias replicated and added once, after the all-reduce
    from model_factory import edited_copy, random_biases

    modules = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
    _check_same_model(edited_copy(data_dir, tmp_path, "tiny-llama32", {"attention_bias": True},
                                  random_biases(data_dir, "tiny-llama32", modules)), 2)


@pytest.mark.slow
def test_tp3_is_the_same_model_on_the_embedded_smollm2(smollm2_path):
    _check_same_model(smollm2_path, 3)  # 9 heads, 3 KV heads: one each (TP=2 cannot split 9 heads)


@pytest.mark.parametrize("model, tp, match", [
    ("tiny-qwen2", 2, "tensor_parallel_size 2 must divide the model's 3 attention heads"),
    ("tiny-llama", 4, "tensor_parallel_size 4 must divide the model's 2 attention heads"),
])
def test_a_split_that_does_not_divide_the_heads_is_refused_at_start(data_dir, model, tp, match):
    with pytest.raises(ValueError, match=match):
        _engine(data_dir / model, tp)


def test_tp2_on_the_embedded_smollm2_is_refused_naming_its_9_heads(smollm2_path):
    with pytest.raises(ValueError, match="tensor_parallel_size 2 must divide the model's 9 attention heads"):
        _engine(smollm2_path, 2)


def test_more_gpu_ranks_than_local_gpus_is_refused_without_ray():
    class Runtime:
        @staticmethod
        def getDeviceCount():
            return 1

    class Backend:  # what check_world_size reads of a CuPy backend
        is_gpu = True

        class xp:
            class cuda:
                runtime = Runtime

    with pytest.raises(ValueError, match="tensor_parallel_size 2 needs one GPU per rank but this host has 1"):
        check_world_size(EngineConfig(tensor_parallel_size=2), Backend, "mp")
    check_world_size(EngineConfig(tensor_parallel_size=2), Backend, "ray")  # Ray places ranks on other hosts


def test_each_rank_reads_only_its_slices(data_dir):
    full = load_model(data_dir / "tiny-llama")
    part = load_model(data_dir / "tiny-llama", shard=TPShard(1, 2))
    cfg = full.config
    q = part.weights["model.layers.0.self_attn.q_proj.weight"]
    np.testing.assert_array_equal(q, full.weights["model.layers.0.self_attn.q_proj.weight"][cfg.head_dim:])
    down = part.weights["model.layers.1.mlp.down_proj.weight"]
    np.testing.assert_array_equal(down, full.weights["model.layers.1.mlp.down_proj.weight"][:, 128:])
    assert part.weights["lm_head.weight"].shape == (256, cfg.hidden_size)
    full_bytes = sum(w.nbytes for w in full.weights.values())
    part_bytes = sum(w.nbytes for w in part.weights.values())
    assert part_bytes < 0.6 * full_bytes  # norms and the replicated KV head are all that is not halved


def test_a_rank_reads_its_slices_of_the_gguf_conversion_cache(smollm2_path, smollm2_loaded):
    # The embedded GGUF's conversion cache is float32 safetensors: rank 2 of 3 memory-maps it and copies
    # out only its slices (heads 6-8, KV head 2, MLP columns 1024-1535, vocabulary rows 32768-49151).
    part = load_model(smollm2_path, shard=TPShard(2, 3))
    full, cfg = smollm2_loaded.weights, smollm2_loaded.config
    assert part.from_cache and part.shard == TPShard(2, 3)
    hd = cfg.head_dim
    for name, index in [("model.layers.5.self_attn.q_proj.weight", np.s_[6 * hd : 9 * hd]),
                        ("model.layers.5.self_attn.k_proj.weight", np.s_[2 * hd : 3 * hd]),
                        ("model.layers.5.self_attn.o_proj.weight", np.s_[:, 6 * hd : 9 * hd]),
                        ("model.layers.5.mlp.up_proj.weight", np.s_[1024:1536]),
                        ("model.layers.5.mlp.down_proj.weight", np.s_[:, 1024:1536]),
                        ("model.embed_tokens.weight", np.s_[32768:49152]),
                        ("model.norm.weight", np.s_[:])]:
        np.testing.assert_array_equal(part.weights[name], full[name][index], err_msg=name)
    # the GGUF blocks (for the one-process CPU set's few-row matmuls) stay behind: a rank has none
    assert any(is_quant_name(n) for n in full) and not any(is_quant_name(n) for n in part.weights)


def test_a_rank_killed_mid_generation_fails_the_step_at_once_and_for_good(data_dir):
    engine = _engine(data_dir / "tiny-llama", 2)
    try:
        engine.add_request("long", "hello", SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True))
        for _ in range(3):
            engine.step()
        rank1 = engine.executor.procs[0]
        os.kill(rank1.pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(WorkerFailedError, match=rf"rank 1 \(pid {rank1.pid}\) exited with code -9"):
            for _ in range(100):  # the very next step fails; bounded in any case
                engine.step()
                assert time.monotonic() - t0 < 30, "a dead rank must fail the step, not hang it"
        assert time.monotonic() - t0 < 30
        with pytest.raises(WorkerFailedError, match="failed earlier"):
            engine.step()
    finally:
        engine.shutdown()


def test_llm_api_takes_tensor_parallel_size_and_shuts_its_ranks_down(data_dir):
    with LLM(str(data_dir / "tiny-llama"), device="cpu", cpu_threads=1, num_kv_blocks=64,
             tensor_parallel_size=2) as llm:
        procs = list(llm.engine.executor.procs)
        out = llm.generate([{"prompt": PROMPTS[0]}], GREEDY)
        assert len(out[0].outputs[0].token_ids) == GREEDY.max_tokens
    for p in procs:
        p.join(10)
        assert p.exitcode == 0  # stopped when asked, not killed


def test_tp2_ranks_hold_their_kv_heads_in_the_pools_dtype(data_dir):
    """kv_cache_dtype reaches every rank (each builds its pool from the config): tp=2 over a bfloat16 pool gives
    the single-rank bfloat16 engine's greedy tokens."""
    one = _engine(data_dir / "tiny-llama", 1, kv_cache_dtype="bfloat16", cpu_kernels="numpy")
    many = _engine(data_dir / "tiny-llama", 2, kv_cache_dtype="bfloat16", cpu_kernels="numpy")
    try:
        assert many.executor.driver_worker.kv_caches[0][0].dtype == np.uint16
        assert _generate(many) == _generate(one)
    finally:
        many.shutdown()
