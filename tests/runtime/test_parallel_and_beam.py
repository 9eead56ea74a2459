"""n > 1 samples and beam search share KV blocks by fork; results match plain references."""

from __future__ import annotations

import functools

import numpy as np
import pytest

from engine_helpers import drain, make_engine
from numerics import model_tol

from pagedserve.cupy_kernels.backend import get_backend
from pagedserve.models.batch import SeqChunk, build_forward_batch
from pagedserve.models.kv_cache import allocate_kv_caches
from pagedserve.models.llama import LlamaForCausalLM
from pagedserve.models.loading.loader import load_model
from pagedserve.runtime.core.beam_search import BeamSearchParams, length_penalized
from pagedserve.runtime.sampling_params import SamplingParams


@pytest.fixture(scope="module", params=["tiny-llama", "tiny-qwen2"])
def tiny(request, data_dir):
    return load_model(data_dir / request.param)


engine = functools.partial(make_engine, max_num_batched_tokens=1024, num_kv_blocks=300)


def run(e, peak=None):
    """drain, noting the blocks in use after each step in `peak` when given."""
    return drain(e, on_step=None if peak is None else lambda e, _: peak.append(e.kv_manager.usage().num_used_blocks))


PROMPT = np.random.default_rng(3).integers(3, 500, size=512).tolist()


def test_n4_shares_prompt_blocks(tiny):
    p = SamplingParams(n=4, temperature=1.0, seed=11, max_tokens=16, ignore_eos=True)
    shared = engine(tiny, enable_prefix_caching=False)
    shared.add_request("r", PROMPT, p)
    peak_shared: list[int] = []
    out = run(shared, peak_shared)["r"]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1, "samples should differ"
    alone = engine(tiny, enable_prefix_caching=False)
    for i in range(4):
        alone.add_request(f"r{i}", PROMPT, SamplingParams(temperature=1.0, seed=11 + i, max_tokens=16, ignore_eos=True))
    peak_alone: list[int] = []
    run(alone, peak_alone)
    ratio = max(peak_shared) / max(peak_alone)
    assert ratio <= 0.30, f"peak blocks with sharing {max(peak_shared)} vs {max(peak_alone)} ({ratio:.0%})"
    assert shared.kv_manager.usage().num_used_blocks == 0


def test_sample_0_equals_n1_with_the_same_seed_and_samples_are_reproducible(tiny):
    e = engine(tiny)
    e.add_request("n4", PROMPT[:40], SamplingParams(n=4, temperature=0.9, seed=5, max_tokens=12, ignore_eos=True))
    e.add_request("n1", PROMPT[:40], SamplingParams(n=1, temperature=0.9, seed=5, max_tokens=12, ignore_eos=True))
    done = run(e)
    assert done["n4"].outputs[0].token_ids == done["n1"].outputs[0].token_ids
    e2 = engine(tiny)
    e2.add_request("again", PROMPT[:40], SamplingParams(n=4, temperature=0.9, seed=5, max_tokens=12, ignore_eos=True))
    again = run(e2)["again"]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in done["n4"].outputs]


def test_best_of_returns_the_most_likely_n(tiny):
    e = engine(tiny)
    e.add_request("b", PROMPT[:30],
                  SamplingParams(n=2, best_of=5, temperature=1.0, seed=2, max_tokens=8, ignore_eos=True))
    out = run(e)["b"]
    assert len(out.outputs) == 2
    assert out.outputs[0].cumulative_logprob >= out.outputs[1].cumulative_logprob
    e2 = engine(tiny)
    e2.add_request("all", PROMPT[:30], SamplingParams(n=5, temperature=1.0, seed=2, max_tokens=8, ignore_eos=True))
    everything = sorted((c.cumulative_logprob for c in run(e2)["all"].outputs), reverse=True)
    assert [c.cumulative_logprob for c in out.outputs] == pytest.approx(everything[:2])


# -- beam search against a plain reference ---------------------------------------------------------

def full_logprobs(model, tokens):
    kv = allocate_kv_caches(model.config, -(-len(tokens) // 16) + 1, 16, get_backend("cpu"))
    batch = build_forward_batch([SeqChunk(tokens, 0, list(range(len(kv[0][0]))))], 16)
    row = model.forward(batch, kv)[-1].astype(np.float64)
    return row - (row.max() + np.log(np.exp(row - row.max()).sum()))


def reference_beam_search(model, prompt, width, max_tokens, length_penalty, eos):
    """The rule of runtime/core/beam_search.py, written plainly with a full forward per beam per step."""
    beams = [([], 0.0)]
    done = []
    for _ in range(max_tokens):
        proposals = []
        for b, (toks, cum) in enumerate(beams):
            lp = full_logprobs(model, prompt + toks)
            order = sorted(range(len(lp)), key=lambda t: (-lp[t], t))[: 2 * width]
            proposals += [(cum + lp[t], b, r, t) for r, t in enumerate(order)]
        proposals.sort(key=lambda p: (-p[0], p[1], p[2]))
        new = []
        for pos, (score, b, _, t) in enumerate(proposals):
            if t in eos:
                if pos < width:
                    done.append((beams[b][0] + [t], score))
                continue
            new.append((beams[b][0] + [t], score))
            if len(new) == width:
                break
        beams = new
        if not beams:
            break
    done += beams
    done.sort(key=lambda h: -length_penalized(h[1], len(h[0]), length_penalty))
    return done[:width]


@pytest.mark.parametrize("width,length_penalty", [(2, 1.0), (4, 0.6)])
def test_beam_search_equals_brute_force(tiny, width, length_penalty):
    model = LlamaForCausalLM(tiny.config, tiny.weights)
    prompt = PROMPT[:9]
    # Use a frequent token as "eos" so that hypotheses really end early in this test.
    eos = tuple(tiny.config.eos_token_ids) + (int(np.argmax(full_logprobs(model, prompt))),)
    e = engine(tiny)
    e.model_config = type(e.model_config)(**{**e.model_config.__dict__, "eos_token_ids": eos})
    e.inputs.eos_token_ids = eos  # requests take their eos ids when they are built
    e.add_beam_request("beam", prompt, BeamSearchParams(beam_width=width, max_tokens=6, length_penalty=length_penalty))
    peak: list[int] = []
    got = run(e, peak)["beam"].outputs
    ref = reference_beam_search(model, prompt, width, 6, length_penalty, eos)
    assert [c.token_ids for c in got] == [h[0] for h in ref]
    # The engine's batched forward and the reference's one-sequence forward differ by rounding only:
    # each of the 6 logprobs is within 2x the logits' tolerance (log-softmax shifts by a logsumexp).
    scale = float(np.abs(full_logprobs(model, prompt)).max())
    np.testing.assert_allclose([c.cumulative_logprob for c in got], [h[1] for h in ref], rtol=0,
                               atol=6 * 2 * model_tol(tiny.config, scale))
    assert e.kv_manager.usage().num_used_blocks == 0
