"""Speculative decoding in the engine: same greedy tokens, exact sampling, nothing leaked when rolled back."""

from __future__ import annotations

import numpy as np
import pytest

import engine_helpers
from chi_square import two_sample
from engine_helpers import drain

from pagedserve.runtime.engine.stats import spec_fields as _spec_fields
from pagedserve.runtime.config import EngineConfig
from pagedserve.runtime.engine.llm_engine import LLMEngine
from pagedserve.runtime.sampling_params import SamplingParams
from pagedserve.runtime.spec_decode.config import SpeculativeConfig

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1,
         "min_acceptance_rate": 0.0}
SUFFIX = {"method": "suffix", "num_speculative_tokens": 4, "suffix_decoding_max_tree_depth": 16,
          "suffix_decoding_max_cached_requests": 4, "min_acceptance_rate": 0.0}


def specs(data_dir):
    return {
        "ngram": NGRAM,
        "suffix": SUFFIX,
        # min_acceptance_rate 0: always speculate, whatever the policy would decide (these tests check exactness).
        "self_draft": {"method": "draft", "draft_num_layers": 1, "num_speculative_tokens": 3,
                       "min_acceptance_rate": 0.0},
        "other_draft": {"model": str(data_dir / "tiny-qwen2"), "num_speculative_tokens": 2, "min_acceptance_rate": 0.0},
        # The target as its own draft: every draft accepted, so bonus tokens and cuts at max_tokens and
        # stop tokens inside a run of accepted drafts are exercised.
        "same_draft": {"model": str(data_dir / "tiny-llama"), "num_speculative_tokens": 5, "min_acceptance_rate": 0.0},
    }


def make_engine(tiny, spec=None, **kw):
    return engine_helpers.make_engine(tiny, speculative_config=spec, **kw)


def workload(n, seed):
    """Prompts that repeat themselves (n-gram lookup finds matches) mixed with plain random ones."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        base = rng.integers(3, 512, size=int(rng.integers(4, 40))).tolist()
        prompt = base * int(rng.integers(1, 4)) if i % 2 == 0 else base
        out.append((prompt, int(rng.integers(1, 40))))
    return out


run_all = drain  # checks both pools (the engine's and a draft model's) after every step, and for leaks at the end


def greedy_params(i, max_tokens, stop=None):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, stop_token_ids=stop)


def _outputs(engine, reqs, stops):
    for i, (prompt, max_tokens) in enumerate(reqs):
        engine.add_request(str(i), prompt, greedy_params(i, max_tokens, stops.get(i)))
    done = run_all(engine)
    return {rid: [c.token_ids for c in out.outputs] for rid, out in done.items()}, done


SMALL = dict(num_kv_blocks=16, max_num_batched_tokens=64)  # preemption certain, prefill chunked


@pytest.fixture(scope="module")
def greedy_baseline(tiny):
    """The workload without speculation: stop tokens taken from the middle of some outputs (so a stop can
    fall inside a run of accepted drafts), and the outputs with those stops."""
    reqs = workload(12, seed=3)
    plain, _ = _outputs(make_engine(tiny, **SMALL), reqs, {})
    stops = {i: [plain[str(i)][0][len(plain[str(i)][0]) // 2]] for i in range(0, 12, 3) if len(plain[str(i)][0]) > 2}
    engine = make_engine(tiny, **SMALL)
    plain, _ = _outputs(engine, reqs, stops)
    assert engine.num_preemptions > 0, "the pool was meant to be small enough to force preemption"
    return reqs, stops, plain


@pytest.mark.parametrize("method", ["ngram", "suffix", "self_draft", "other_draft", "same_draft"])
def test_greedy_tokens_are_the_same_with_and_without_speculation(tiny, data_dir, greedy_baseline, method):
    reqs, stops, plain = greedy_baseline
    e = make_engine(tiny, specs(data_dir)[method], **SMALL)
    got, done = _outputs(e, reqs, stops)
    assert e.num_preemptions > 0
    assert got == plain
    for i, (_, max_tokens) in enumerate(reqs):
        for c in done[str(i)].outputs:
            assert len(c.token_ids) <= max_tokens
    stats = e.spec.stats
    assert stats.num_draft_tokens > 0 and 0 <= stats.num_accepted_tokens <= stats.num_draft_tokens
    if method == "same_draft":
        assert stats.num_accepted_tokens == stats.num_draft_tokens
    es = e.get_stats()
    assert (es.spec_method, es.spec_num_draft_tokens, es.spec_num_accepted_tokens) == \
        (stats.method, stats.num_draft_tokens, stats.num_accepted_tokens)
    assert es.spec_mean_accepted_length == pytest.approx(1 + stats.num_accepted_tokens / stats.num_drafts)
    assert _spec_fields(es)["spec_method"] == stats.method and _spec_fields(make_engine(tiny).get_stats()) == {}
    assert e.kv_manager.usage().num_used_blocks == 0
    if e.spec.draft is not None:
        assert e.spec.draft.kv.usage().num_used_blocks == 0


def test_rollback_with_aborts_leaves_no_block_and_no_hash_of_a_rejected_token(tiny, data_dir):
    rng = np.random.default_rng(7)
    e = make_engine(tiny, specs(data_dir)["other_draft"], num_kv_blocks=48)
    reqs = workload(8, seed=11)
    for i, (prompt, max_tokens) in enumerate(reqs):
        # Odd requests sample (every third of those with n = 2 samples forked from the prompt).
        p = SamplingParams(temperature=1.0, seed=i, max_tokens=max_tokens + 10, ignore_eos=True,
                           n=2 if i % 3 == 1 else 1, logprobs=2 if i % 4 == 1 else None) if i % 2 else \
            SamplingParams(temperature=0.0, max_tokens=max_tokens + 10, ignore_eos=True)
        e.add_request(str(i), prompt, p)

    aborted, truth = [], set()
    bs = e.block_size

    def abort_some(engine, step):
        # What each live sequence holds now: any prefix-cache hash registered so far must be of these.
        for r in engine.scheduler.running:
            truth.update(tuple(r.all_token_ids[j * bs:(j + 1) * bs]) for j in range(r.num_tokens // bs))
        if rng.random() < 0.15 and engine.groups:
            aborted.append(str(rng.choice(sorted(engine.groups))))
            engine.abort_request(aborted[-1])

    run_all(e, on_step=abort_some)
    assert aborted
    assert e.spec.stats.num_draft_tokens > e.spec.stats.num_accepted_tokens  # rejections happened
    assert e.kv_manager.usage().num_used_blocks == 0
    assert e.spec.draft.kv.usage().num_used_blocks == 0
    # Every hash in the prefix cache covers tokens some sequence really had, never a rejected draft.
    cached = [b.token_ids for b in e.kv_manager.pool._blocks if b.block_hash is not None]
    assert cached and all(t in truth for t in cached)


def _next3(engine, prompt, num, temperature, seed_base):
    """Counts of the first three tokens of `num` samples of `prompt`, as flat ids a*V*V + b*V + c."""
    V = engine.model_config.vocab_size
    for i in range(num):
        engine.add_request(str(i), prompt, SamplingParams(temperature=temperature, max_tokens=3, ignore_eos=True,
                                                          seed=seed_base + i))
    done = drain(engine, max_steps=20 * num, integrity=False)
    ids = np.array([done[str(i)].outputs[0].token_ids for i in range(num)])
    return np.bincount(ids[:, 0] * V * V + ids[:, 1] * V + ids[:, 2], minlength=V ** 3)


@pytest.mark.slow
def test_end_to_end_samples_match_the_distribution_without_speculation(tiny):
    """20,000 samples of the next 3 tokens from one context, with a self-draft and without: one distribution.

    The second token is a verified draft (accepted about 15% of the time here, so both the acceptance and the
    residual draw matter) and the third the bonus or the target's own. The 20,000-sample test of the rule itself,
    on synthetic p and q, is tests/runtime/test_rejection_sampler.py.
    """
    prompt = [int(t) for t in np.random.default_rng(0).integers(3, 512, size=17)]
    kw = dict(max_num_batched_tokens=4096, max_num_seqs=256, num_kv_blocks=2048)
    num = 20_000
    plain = _next3(make_engine(tiny, **kw), prompt, num, 1.5, 0)
    spec = {"method": "draft", "draft_num_layers": 1, "num_speculative_tokens": 2, "min_acceptance_rate": 0.0}
    e = make_engine(tiny, spec, **kw)
    speculated = _next3(e, prompt, num, 1.5, 10 ** 6)
    stats = e.spec.stats
    assert stats.num_draft_tokens >= num and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    stat, df, p_value = two_sample(plain, speculated)
    assert df > 5, "the test needs a spread-out distribution"
    assert p_value > 1e-3, f"chi-square {stat:.1f} on {df} degrees of freedom, p = {p_value:.2e}"


def test_a_verify_step_is_a_decode_booked_as_one_plus_k_tokens(tiny):
    e = make_engine(tiny, NGRAM, max_num_batched_tokens=3)
    prompt = [5, 6, 7, 8] * 4
    e.add_request("a", prompt, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    while not e.scheduler.running or e.scheduler.running[0].is_prefilling:
        e.step()
    r = e.scheduler.running[0]
    e.spec.propose(e.scheduler.running)
    assert len(r.spec_token_ids) == 4 and not r.is_prefilling  # drafts are not tokens of the sequence
    sched = e.scheduler.schedule()
    # Budget 3: the newest token and two drafts; the lookahead is cut to fit, never the decode itself.
    assert [(s.num_new_tokens, len(s.spec_token_ids)) for s in sched.scheduled] == [(3, 2)]
    assert len(e.kv_manager.block_table("a")) * e.block_size >= r.num_computed_tokens + 3


def test_drafts_never_run_past_max_tokens_or_max_model_len(tiny):
    e = make_engine(tiny, NGRAM, max_model_len=40)
    e.add_request("a", [5, 6, 7, 8] * 8, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    e.add_request("b", [9, 10] * 3, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))

    def check_drafts(e, _):
        for r in e.scheduler.running:
            assert r.num_output_tokens + len(r.spec_token_ids) + 1 <= r.sampling_params.max_tokens
            assert r.num_tokens + len(r.spec_token_ids) + 1 <= 40

    drain(e, max_steps=100, on_step=check_drafts)


@pytest.mark.parametrize("config, field", [
    ({"method": "medusa"}, "method"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 4}, "prompt_lookup_min"),
    ({"method": "ngram", "model": "x"}, "model"),
    ({"method": "draft"}, "draft_num_layers"),
    ({"method": "ngram", "min_acceptance_rate": 2}, "min_acceptance_rate"),
    ({"num_spec_tokens": 4}, "unknown field"),
    ({"method": "suffix", "suffix_decoding_max_tree_depth": 0}, "suffix_decoding_max_tree_depth"),
    ({"method": "suffix", "suffix_decoding_max_tree_depth": 1000}, "suffix_decoding_max_tree_depth"),
    ({"method": "suffix", "suffix_decoding_max_cached_requests": -1}, "suffix_decoding_max_cached_requests"),
    ({"method": "suffix", "suffix_decoding_max_spec_factor": 0}, "suffix_decoding_max_spec_factor"),
    ({"method": "suffix", "suffix_decoding_min_token_prob": 1.5}, "suffix_decoding_min_token_prob"),
    ({"method": "suffix", "draft_num_layers": 2}, "need method 'draft'"),
    ("ngram", "speculative_config must be a dict"),
])
def test_bad_speculative_configs_name_the_field(config, field):
    with pytest.raises(ValueError, match=field):
        EngineConfig(speculative_config=config)


def test_config_spellings():
    assert EngineConfig(speculative_config={"model": "/m", "num_speculative_tokens": 3}).speculative_config == \
        SpeculativeConfig(method="draft", model="/m", num_speculative_tokens=3)
    assert EngineConfig(speculative_config=None).speculative_config is None


def test_a_draft_with_another_vocabulary_is_refused(tiny, data_dir):
    import dataclasses

    from pagedserve.runtime.spec_decode.draft_proposer import load_draft

    other = dataclasses.replace(tiny, config=dataclasses.replace(tiny.config, vocab_size=1024))
    with pytest.raises(ValueError, match="vocab_size"):
        load_draft(str(data_dir / "tiny-qwen2"), None, other)
    with pytest.raises(ValueError, match="draft_num_layers"):
        make_engine(tiny, {"method": "draft", "draft_num_layers": 2})  # tiny-llama has 2 layers


def test_the_offline_api_takes_vllms_speculative_config(data_dir):
    from pagedserve.runtime.llm import LLM

    prompt = [7, 8, 9, 10] * 5
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    plain = LLM(str(data_dir / "tiny-llama"), device="cpu", num_kv_blocks=64).generate(prompt, params)
    llm = LLM(str(data_dir / "tiny-llama"), device="cpu", num_kv_blocks=64,
              speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
                                  "prompt_lookup_min": 2})
    assert llm.generate(prompt, params)[0].outputs[0].token_ids == plain[0].outputs[0].token_ids
    assert llm.engine.spec.stats.method == "ngram"
    llm = LLM(str(data_dir / "tiny-llama"), device="cpu", num_kv_blocks=64,
              speculative_config={"method": "suffix", "num_speculative_tokens": 4,
                                  "suffix_decoding_max_tree_depth": 16, "min_acceptance_rate": 0.0})
    assert llm.generate(prompt, params)[0].outputs[0].token_ids == plain[0].outputs[0].token_ids
    assert llm.engine.spec.stats.method == "suffix"


def test_speculation_under_tensor_parallelism_keeps_greedy_tokens(data_dir):
    """Verify steps go through the executor to every rank; the draft model runs beside the driver."""
    def run(tp, spec):
        e = LLMEngine(EngineConfig(model=str(data_dir / "tiny-llama"), device="cpu", num_kv_blocks=64,
                                   tensor_parallel_size=tp, speculative_config=spec))
        try:
            e.add_request("a", [5, 6, 7, 8] * 6, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
            return drain(e, max_steps=200)["a"].outputs[0].token_ids, e.spec
        finally:
            e.shutdown()

    plain, _ = run(1, None)
    for spec in (NGRAM, {"method": "draft", "draft_num_layers": 1, "min_acceptance_rate": 0.0}):
        tokens, decoder = run(2, spec)
        assert tokens == plain and decoder.stats.num_draft_tokens > 0


def test_samples_still_to_fork_are_not_lost_to_a_verify_step(tiny):
    """Chunked prefill can leave just the prompt's last token, which looks like a decode: a verify step then
    would complete the prompt without the other samples forking from it. No drafts until they have."""
    e = make_engine(tiny, NGRAM, max_num_batched_tokens=8)
    e.add_request("n2", [5, 6, 7, 8] * 2 + [5], SamplingParams(n=2, temperature=1.0, seed=1, max_tokens=6,
                                                                 ignore_eos=True))
    e.step()  # 8 of the 9 prompt tokens
    r = e.scheduler.running[0]
    assert r.num_tokens - r.num_computed_tokens == 1
    e.spec.propose(e.scheduler.running)
    assert r.spec_token_ids == []  # prompt lookup would have matched [6, 7, 8]
    out = run_all(e)["n2"].outputs
    assert len(out) == 2 and all(len(c.token_ids) == 6 for c in out)
