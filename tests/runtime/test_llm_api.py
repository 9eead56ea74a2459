"""The offline API as vLLM code calls it: the seeds' example, hub names, vLLM's prompt dicts."""

from __future__ import annotations

import pytest

from pagedserve.runtime import LLM, SamplingParams
from pagedserve.runtime.config import EngineConfig


@pytest.mark.slow
def test_the_seeds_example_runs_as_written_on_the_embedded_model():
    # The seeds' lines, with the model name changed and max_tokens shortened for time.
    llm = LLM(model=None, tensor_parallel_size=1, gpu_memory_utilization=0.94, enable_chunked_prefill=True,
              max_num_batched_tokens=2048, max_model_len=8192)
    prompts = ["Explain paged attention in one sentence.", "Write a haiku about GPUs."]
    outputs = llm.generate(prompts, SamplingParams(temperature=0.2, top_p=0.9, max_tokens=12))
    assert [o.prompt for o in outputs] == prompts
    tok = llm.get_tokenizer()
    for o in outputs:
        c = o.outputs[0]
        assert 1 <= len(c.token_ids) <= 12 and c.finish_reason in ("length", "stop")
        assert c.text == tok.decode(c.token_ids, skip_special_tokens=True)


def test_a_hub_name_says_what_to_do_and_downloads_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError) as e:
        LLM(model="meta-llama/Meta-Llama-3.1-8B-Instruct", tensor_parallel_size=1)
    msg = str(e.value)
    assert "neither a local file nor a directory" in msg and "downloads nothing" in msg
    assert "huggingface-cli download meta-llama/Meta-Llama-3.1-8B-Instruct --local-dir" in msg
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("kwargs, field", [
    ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
    ({"gpu_memory_utilization": 0}, "gpu_memory_utilization"),
    ({"gpu_memory_utilization": "0.9"}, "gpu_memory_utilization"),
    ({"tensor_parallel_size": 0}, "tensor_parallel_size"),
    ({"distributed_executor_backend": "slurm"}, "distributed_executor_backend"),
])
def test_engine_settings_are_validated_on_the_cpu_too(kwargs, field):
    with pytest.raises(ValueError, match=field):
        EngineConfig(device="cpu", **kwargs)


@pytest.fixture(scope="module")
def tiny_llm(data_dir):
    return LLM(str(data_dir / "tiny-llama"), device="cpu", num_kv_blocks=64, seed=0)


def test_vllm_prompt_dicts_give_what_plain_prompts_give(tiny_llm):
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    ids = tiny_llm.get_tokenizer().encode("hello there")
    plain = tiny_llm.generate(["hello there", ids], greedy)
    dicts = tiny_llm.generate([{"prompt": "hello there"}, {"prompt_token_ids": ids}], greedy)
    assert [o.outputs[0].token_ids for o in dicts] == [o.outputs[0].token_ids for o in plain]
    single = tiny_llm.generate({"prompt_token_ids": ids}, greedy)
    assert len(single) == 1 and single[0].outputs[0].token_ids == plain[1].outputs[0].token_ids


@pytest.mark.parametrize("prompt, match", [
    ({"text": "hi"}, "a prompt dict must be"),
    ({"prompt": "hi", "prompt_token_ids": [1]}, "a prompt dict must be"),
    ({"prompt_token_ids": ["1"]}, "prompt_token_ids must be a list of ints"),
])
def test_bad_prompt_dicts_are_refused(tiny_llm, prompt, match):
    with pytest.raises(ValueError, match=match):
        tiny_llm.generate([prompt])
    assert not tiny_llm.engine.has_unfinished_requests()
