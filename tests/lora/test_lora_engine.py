"""Serving adapters through the engine: mixed batches, slots and the host LRU, the prefix cache, and the features
that must work with an adapter (n > 1, beams, guided decoding, n-gram and draft speculation)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from engine_helpers import drain, make_engine, tiny_loaded
from lora_helpers import make_lora
from pagedserve.models.loading.peft import load_peft_adapter
from pagedserve.runtime.core.beam_search import BeamSearchParams
from pagedserve.runtime.lora import LoRARequest
from pagedserve.runtime.sampling_params import SamplingParams
from pagedserve.runtime.structured_outputs_params import StructuredOutputsParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPTS = [[(5 * i + 7 * k) % 200 + 3 for i in range(9 + 3 * k)] for k in range(5)]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    """Four adapters of the tiny Llama (ranks 8 and 16, rsLoRA on and off, all modules and q/v only)."""
    cfg = tiny_loaded().config
    root = tmp_path_factory.mktemp("loras")
    specs = [dict(rank=8), dict(rank=16, rslora=True), dict(rank=8, targets=("q_proj", "v_proj")),
             dict(rank=16, targets=("q_proj", "v_proj"), rslora=True)]
    return [LoRARequest(f"a{k}", k + 1, str(make_lora(root / f"a{k}", cfg, seed=k + 1, std=0.15, **s)))
            for k, s in enumerate(specs)]


def merged_loaded(request: LoRARequest):
    """The tiny Llama with the adapter folded into its weights (W + scale B A): the exact math."""
    loaded = tiny_loaded()
    adapter = load_peft_adapter(request.lora_path, loaded.config)
    w = dict(loaded.weights)
    for (n, module), (a, b) in adapter.weights.items():
        block = "mlp" if module.endswith(("gate_proj", "up_proj", "down_proj")) else "self_attn"
        name = f"model.layers.{n}.{block}.{module}.weight"
        w[name] = (w[name].astype(np.float64) + adapter.scale * (b.astype(np.float64) @ a)).astype(np.float32)
    return dataclasses.replace(loaded, weights=w)


def run(engine, items, params=GREEDY):
    """items: [(prompt, lora_request or None)] -> the greedy tokens of each, all in one engine run."""
    for k, (prompt, lora) in enumerate(items):
        if lora is not None:
            engine.lora.register(lora)
        engine.add_request(f"r{k}", prompt, params, lora_request=lora)
    out = drain(engine)
    return [out[f"r{k}"].outputs[0].token_ids for k in range(len(items))]


def lora_engine(**kw):
    return make_engine(enable_lora=True, **{"max_loras": 4, "max_lora_rank": 16, **kw})


def test_four_adapters_and_the_base_in_one_batch(adapters):
    items = list(zip(PROMPTS, [*adapters, None]))
    together = run(lora_engine(), items)
    for k, item in enumerate(items):
        assert run(lora_engine(), [item]) == [together[k]], f"request {k} alone"
    for k, lora in enumerate(adapters):  # each equals the model with that adapter merged into its weights
        assert run(make_engine(loaded=merged_loaded(lora)), [(PROMPTS[k], None)]) == [together[k]]
    assert run(make_engine(), [(PROMPTS[4], None)]) == [together[4]]
    assert len({tuple(t) for t in run(lora_engine(), [(PROMPTS[0], x) for x in [*adapters, None]])}) >= 4


def test_zero_b_adapter_gives_the_base_tokens(tmp_path):
    zero = LoRARequest("zero", 9, str(make_lora(tmp_path / "z", tiny_loaded().config, rank=8, zero_b=True)))
    assert run(lora_engine(), [(p, zero) for p in PROMPTS[:3]]) == run(make_engine(), [(p, None) for p in PROMPTS[:3]])


def test_more_adapters_than_slots_wait_evict_and_finish(adapters):
    engine = lora_engine(max_loras=1, max_cpu_loras=2)
    items = [(PROMPTS[k % 5], adapters[k % 3]) for k in range(6)] + [(PROMPTS[0], None)]
    got = run(engine, items)
    want = run(lora_engine(), items)
    assert got == want
    stats = engine.lora.stats()
    assert stats.resident == 1 and stats.evictions >= 2 and stats.loads >= 3 and engine.lora.num_held == 0
    # Read back from disk after the host LRU (2) dropped it: a waiting request does not block the base.
    assert stats.loaded == 3


def test_a_waiting_adapter_does_not_block_the_base(adapters):
    engine = lora_engine(max_loras=1, max_cpu_loras=2)
    for lora in adapters[:2]:
        engine.lora.register(lora)
    engine.add_request("a0", PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
                       lora_request=adapters[0])
    engine.add_request("a1", PROMPTS[1], GREEDY, lora_request=adapters[1])
    engine.add_request("base", PROMPTS[2], GREEDY)
    engine.step()
    running = {r.request_id for r in engine.scheduler.running}
    assert running == {"a0", "base"}  # a1 waits for the one slot; the base behind it runs
    drain(engine)


def test_prefix_cache_is_keyed_by_adapter(adapters):
    engine = lora_engine()
    prompt = PROMPTS[4]  # 21 tokens: one full block of 16
    for lora in adapters[:2]:
        engine.lora.register(lora)
    cached = {}
    for rid, lora in [("a", adapters[0]), ("b", adapters[1]), ("a2", adapters[0]), ("base", None)]:
        group = engine.add_request(rid, prompt, GREEDY, lora_request=lora)
        drain(engine)
        cached[rid] = group.first.num_cached_tokens
    assert cached == {"a": 0, "b": 0, "a2": 16, "base": 0}


def test_n_beams_and_guided_decoding_with_an_adapter(adapters):
    lora, merged = adapters[1], merged_loaded(adapters[1])
    # n > 1 (seeded samples): every sample is the one the merged model draws
    params = SamplingParams(n=3, temperature=0.8, seed=7, max_tokens=6, ignore_eos=True)
    samples = []
    for e, lr in ((lora_engine(), lora), (make_engine(loaded=merged), None)):
        if lr is not None:
            e.lora.register(lr)
        e.add_request("n", PROMPTS[0], params, lora_request=lr)
        samples.append([o.token_ids for o in drain(e)["n"].outputs])
    assert samples[0] == samples[1] and len(samples[0]) == 3
    # beams: the same beams as the merged model's
    beams = []
    for e, lr in ((lora_engine(), lora), (make_engine(loaded=merged), None)):
        if lr is not None:
            e.lora.register(lr)
        e.add_beam_request("b", PROMPTS[1], BeamSearchParams(beam_width=3, max_tokens=5), lora_request=lr)
        beams.append([o.token_ids for o in drain(e)["b"].outputs])
    assert beams[0] == beams[1]
    # guided decoding: the grammar holds and the tokens are the merged model's under the same grammar
    params = SamplingParams(temperature=0.0, max_tokens=12,
                            structured_outputs=StructuredOutputsParams(regex="[a-f]{3,6}"))
    guided = [run(lora_engine(), [(PROMPTS[2], lora)], params)[0],
              run(make_engine(loaded=merged), [(PROMPTS[2], None)], params)[0]]
    assert guided[0] == guided[1]


@pytest.mark.parametrize("spec", [{"method": "ngram", "num_speculative_tokens": 3},
                                  {"method": "draft", "draft_num_layers": 1, "num_speculative_tokens": 2}])
def test_speculation_drafts_with_the_base_and_verifies_with_the_adapter(adapters, spec):
    items = [(PROMPTS[k], adapters[k]) for k in range(3)] + [(PROMPTS[3], None)]
    assert run(lora_engine(speculative_config=spec), items) == run(lora_engine(), items)


def test_bad_adapters_are_refused_and_the_engine_serves_on(tmp_path, adapters):
    cfg = tiny_loaded().config
    engine = lora_engine(max_lora_rank=8)
    with pytest.raises(ValueError, match="max_lora_rank=8"):
        engine.add_request("x", PROMPTS[0], GREEDY, lora_request=LoRARequest("big", 1, str(adapters[1].lora_path)))
    with pytest.raises(ValueError, match="not found"):
        engine.add_request("x", PROMPTS[0], GREEDY, lora_request=LoRARequest("gone", 2, str(tmp_path / "none")))
    with pytest.raises(ValueError, match="'nope' is not loaded"):
        engine.make_request("x", PROMPTS[0], GREEDY, lora_request=LoRARequest("nope", 3, "/x"))
    with pytest.raises(ValueError, match="LoRA is not enabled"):
        make_engine().add_request("x", PROMPTS[0], GREEDY, lora_request=adapters[0])
    # An adapter that cannot be read back (its directory broken after the host LRU dropped it) fails its request
    # alone; the others finish and nothing leaks.
    engine = lora_engine(max_loras=1, max_cpu_loras=1)
    broken = LoRARequest("broken", 5, str(make_lora(tmp_path / "b", cfg, rank=8)))
    for lora in (broken, adapters[0]):
        engine.lora.register(lora)  # adapters[0] pushes broken out of the host LRU (1)
    (tmp_path / "b" / "adapter_model.safetensors").write_bytes(b"\x00" * 4)
    engine.add_request("bad", PROMPTS[0], GREEDY, lora_request=broken)
    engine.add_request("good", PROMPTS[1], GREEDY, lora_request=adapters[0])
    engine.add_request("base", PROMPTS[2], GREEDY)
    out = drain(engine)
    assert "could not be read again" in (out["bad"].error or "") and "safetensors" in out["bad"].error
    assert out["good"].error is None and len(out["good"].outputs[0].token_ids) == 8
    assert engine.lora.num_held == 0
    with pytest.raises(ValueError, match="max_cpu_loras"):
        lora_engine(max_loras=2, max_cpu_loras=1)


def test_tensor_parallel_shards_a_and_b_like_their_layers(adapters):
    """TP=2 on the tiny Llama (2 heads, its 1 KV head on both ranks, the MLP split 128/128): the same tokens as one
    rank, for adapters on every projection and on q/v only, mixed with the base."""
    from lora_helpers import DATA
    from pagedserve.runtime.config import EngineConfig
    from pagedserve.runtime.engine.llm_engine import LLMEngine

    items = [(PROMPTS[0], adapters[0]), (PROMPTS[1], adapters[2]), (PROMPTS[2], None), (PROMPTS[3], adapters[1])]
    engine = LLMEngine(EngineConfig(model=str(DATA / "tiny-llama"), device="cpu", cpu_threads=1, num_kv_blocks=64,
                                    max_num_batched_tokens=64, seed=0, tensor_parallel_size=2,
                                    collective_timeout_s=30.0, enable_lora=True, max_loras=2, max_lora_rank=16))
    try:
        got = run(engine, items)
    finally:
        engine.shutdown()
    assert got == run(lora_engine(), items)


def test_disaggregated_prefill_names_the_adapter_in_the_handoff(adapters):
    """The decode instance sends the adapter's name with the prompt's blocks to fetch; the prefill instance
    computes them with that adapter: the same tokens as one instance, every block freed on both sides."""
    from engine_helpers import InlineConnector

    long_prompts = [(PROMPTS[k % 5] * 4)[:40] for k in range(4)]  # two full blocks before the last token
    items = [(long_prompts[0], adapters[0]), (long_prompts[1], adapters[2]), (long_prompts[2], None),
             (long_prompts[3], adapters[1])]
    want = run(lora_engine(), items)
    prefill, decode = lora_engine(max_num_batched_tokens=24), lora_engine()
    for lora in adapters[:3]:
        prefill.lora.register(lora)
    conn = InlineConnector(prefill)
    decode.enable_remote_prefill(conn)
    assert run(decode, items) == want
    assert decode.kv_stats.remote_prefills == 4 and decode.kv_stats.local_prefill_fallbacks == 0
    assert [s.lora_name for s in conn.specs] == ["a0", "a2", None, "a1"]
    assert decode.kv_manager.usage().num_used_blocks == 0 and prefill.kv_manager.usage().num_used_blocks == 0
