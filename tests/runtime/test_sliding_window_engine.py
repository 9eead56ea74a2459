"""The engine with KV cache groups (issue #35) on tiny-gemma3 (a sliding layer, window 8, and a global one):
sampled tokens and their log-probabilities the same bits with the groups on (the sliding layer's blocks
released as they leave the window, both layers in one shared K/V pair) as with them off (one table, a pair per
layer), for prompts and generations that run far past the window, through chunked prefill and a prefix hit."""

from __future__ import annotations

import shutil

import pytest

from pagedserve.models import llama
from pagedserve.runtime.llm import LLM
from pagedserve.runtime.sampling_params import SamplingParams

PROMPTS = [[(7 * i + 3) % 500 + 1 for i in range(60)], [(5 * i + 1) % 500 + 1 for i in range(37)],
           [(7 * i + 3) % 500 + 1 for i in range(45)]]  # the third: a prefix of the first (a cache hit)


@pytest.fixture
def model_dir(data_dir, tmp_path):
    """A copy of tiny-gemma3 read by every run of a test (the same weights even if the committed copy is
    regenerated meanwhile)."""
    return shutil.copytree(data_dir / "tiny-gemma3", tmp_path / "tiny-gemma3")


def run(model_dir, groups: bool, monkeypatch):
    monkeypatch.setattr(llama.LlamaForCausalLM, "reads_kv_cache_groups", groups, raising=False)
    llm = LLM(str(model_dir), enable_prefix_caching=True, block_size=8, max_num_batched_tokens=16)
    params = SamplingParams(max_tokens=40, temperature=1.0, seed=11, logprobs=3)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    kv = llm.engine.kv_manager
    kv.check_integrity()
    assert kv.usage().num_used_blocks == 0  # every block back (the null block not counted)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs], kv


def test_groups_on_and_off_give_the_same_bits(model_dir, monkeypatch):
    off, kv_off = run(model_dir, False, monkeypatch)
    on, kv_on = run(model_dir, True, monkeypatch)
    assert kv_off.group_windows == (None,) and kv_on.group_windows == (8, None)
    # both layers share one K/V pair: the same memory holds twice the blocks (less the null block)
    assert kv_on.usage().num_blocks == 2 * kv_off.usage().num_blocks - 1
    assert on == off
    chosen = [lp[t] for t, lp in zip(on[0][0], on[0][1])]
    assert len(set(chosen)) > 10  # the log-probabilities move step by step: the comparison has teeth


def test_a_long_prompt_holds_only_its_window_in_the_sliding_group(model_dir, monkeypatch):
    """Between the steps of a 300-token prompt's prefill, the sliding group holds at most the blocks of its
    window and the next chunk's; the global group all of them."""
    monkeypatch.setattr(llama.LlamaForCausalLM, "reads_kv_cache_groups", True, raising=False)
    llm = LLM(str(model_dir), block_size=8, max_num_batched_tokens=32)
    engine = llm.engine
    engine.add_request("r", [(3 * i) % 500 + 1 for i in range(300)], SamplingParams(max_tokens=1))
    kv = engine.kv_manager
    seen = 0
    for _ in range(20):  # 300 tokens in chunks of 32: 10 steps to the first token
        engine.step()
        if "r" not in kv:
            break
        sliding, full = kv.block_table("r", 0), kv.block_table("r", 1)
        assert len([b for b in sliding if b != kv.null_block]) <= 2  # window 8 = one block, + a partial one
        assert null_free_len(full, kv) == len(full) and len(full) == len(sliding)
        seen += 1
    assert seen >= 8 and "r" not in kv


def null_free_len(table, kv):
    return len([b for b in table if b != kv.null_block])


def test_requests_are_checked_against_a_groups_share_of_a_small_pool(model_dir, monkeypatch):
    """21 blocks over two groups (one the null block): a request is checked against 10 blocks (80 tokens), so one
    admitted alone always fits, even while its prompt lies inside the window; one that could not is refused."""
    monkeypatch.setattr(llama.LlamaForCausalLM, "reads_kv_cache_groups", True, raising=False)
    llm = LLM(str(model_dir), block_size=8, num_kv_blocks=21, max_num_batched_tokens=64)
    out = llm.generate([{"prompt_token_ids": [(3 * i) % 500 + 1 for i in range(70)]}],
                       SamplingParams(max_tokens=10, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 10
    with pytest.raises(ValueError, match="KV blocks"):
        llm.generate([{"prompt_token_ids": [5] * 75}], SamplingParams(max_tokens=10))
