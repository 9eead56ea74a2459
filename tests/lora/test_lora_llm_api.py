"""vLLM's offline names: LLM(enable_lora=True, max_loras=, max_lora_rank=, max_cpu_loras=) and
LLM.generate(..., lora_request=LoRARequest(name, int_id, path))."""

from __future__ import annotations

import pytest

from lora_helpers import DATA, make_lora
from pagedserve.models.config import load_hf_config
from pagedserve.runtime import LLM, LoRARequest, SamplingParams


def test_generate_with_lora_requests(tmp_path):
    cfg = load_hf_config(DATA / "tiny-llama")
    a = LoRARequest("a", 1, str(make_lora(tmp_path / "a", cfg, rank=8, std=0.15, seed=1)))
    b = LoRARequest("b", 2, str(make_lora(tmp_path / "b", cfg, rank=4, std=0.15, seed=2, targets=("q_proj", "v_proj"))))
    llm = LLM(str(DATA / "tiny-llama"), device="cpu", num_kv_blocks=64, seed=0, enable_lora=True, max_loras=2,
              max_lora_rank=8, max_cpu_loras=2)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompt = [5, 9, 13, 17, 21, 25, 29]
    one = llm.generate(prompt, params, lora_request=a)[0].outputs[0].token_ids
    mixed = [o.outputs[0].token_ids for o in llm.generate([prompt] * 3, params, lora_request=[a, None, b])]
    base = llm.generate(prompt, params)[0].outputs[0].token_ids
    assert mixed[0] == one and mixed[1] == base and len({tuple(m) for m in mixed}) == 3
    with pytest.raises(ValueError, match="2 lora_request entries for 3 prompts"):
        llm.generate([prompt] * 3, params, lora_request=[a, b])
    with pytest.raises(ValueError, match="'a' is already loaded"):
        llm.generate(prompt, params, lora_request=LoRARequest("a", 1, b.lora_path))
    assert not llm.engine.has_unfinished_requests()
    # The slots and the host LRU's two adapters are in the memory budget checked at start.
    assert llm.engine.memory_budget.lora_bytes == 2 * llm.engine.model.lora.nbytes > 0
