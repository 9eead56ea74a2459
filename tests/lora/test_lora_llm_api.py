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


def test_bad_lora_settings_are_refused_at_start():
    from pagedserve.runtime.config import EngineConfig
    from pagedserve.sidecar.settings import load_settings

    with pytest.raises(ValueError, match="max_lora_rank must be a positive integer"):
        EngineConfig(enable_lora=True, max_lora_rank=0)
    env = {"PAGEDSERVE_SOCKET": "/tmp/x.sock"}
    with pytest.raises(ValueError, match="lora_modules needs enable_lora"):
        load_settings(None, {**env, "PAGEDSERVE_LORA_MODULES": "a=/x"})
    with pytest.raises(ValueError, match="each entry must be name=path, got 'a'"):
        load_settings(None, {**env, "PAGEDSERVE_ENABLE_LORA": "1", "PAGEDSERVE_LORA_MODULES": "a"})
    s = load_settings(None, {**env, "PAGEDSERVE_ENABLE_LORA": "1", "PAGEDSERVE_LORA_MODULES": "a=/x, b=/y",
                             "PAGEDSERVE_MAX_LORAS": "3"})
    assert s.engine_config().max_loras == 3 and s.engine_config().enable_lora is True


def test_lora_modules_flag_takes_several_entries():
    import argparse

    from pagedserve.sidecar.settings import add_settings_arguments, load_settings, parse_lora_modules

    parser = argparse.ArgumentParser()
    add_settings_arguments(parser)
    args = parser.parse_args(["--enable-lora", "--lora-modules", "a=/x", "b=/y", "--max-lora-rank", "8"])
    s = load_settings(args, {"PAGEDSERVE_SOCKET": "/tmp/x.sock"})
    assert parse_lora_modules(s.lora_modules) == {"a": "/x", "b": "/y"} and s.max_lora_rank == 8


def test_chat_takes_a_lora_request(tmp_path):
    cfg = load_hf_config(DATA / "tiny-llama")
    a = LoRARequest("a", 1, str(make_lora(tmp_path / "a", cfg, rank=8, std=0.15, seed=1)))
    llm = LLM(str(DATA / "tiny-llama"), device="cpu", num_kv_blocks=64, seed=0, enable_lora=True, max_lora_rank=8)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    chat = [{"role": "user", "content": "Hi"}]
    with_a = llm.chat(chat, params, lora_request=a)[0].outputs[0].token_ids
    prompt = llm.get_tokenizer().apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
    assert with_a == llm.generate(prompt, params, lora_request=a)[0].outputs[0].token_ids
    assert with_a != llm.chat(chat, params)[0].outputs[0].token_ids
