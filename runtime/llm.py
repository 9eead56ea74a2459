"""The offline API, with vLLM's names: LLM(...).generate(prompts, params) and .chat(messages)."""

from __future__ import annotations

import sys
import time
from typing import Sequence, Union

from .core.beam_search import BeamSearchParams
from .config import EngineConfig
from .engine.llm_engine import LLMEngine
from .outputs import RequestOutput
from .lora.request import LoRARequest
from .sampling_params import SamplingParams

# vLLM's prompt forms too: {"prompt": text} and {"prompt_token_ids": [...]} (TextPrompt, TokensPrompt).
PromptType = Union[str, Sequence[int], dict]


def _is_single_prompt(prompts) -> bool:
    return isinstance(prompts, (str, dict)) or bool(prompts) and isinstance(prompts[0], int)


def _unwrap_prompt(prompt: PromptType) -> str | Sequence[int]:
    """A vLLM prompt dict -> the text or token ids the engine takes; other forms pass through."""
    if not isinstance(prompt, dict):
        return prompt
    keys = set(prompt)
    if keys == {"prompt"} and isinstance(prompt["prompt"], str):
        return prompt["prompt"]
    if keys == {"prompt_token_ids"} and isinstance(prompt["prompt_token_ids"], (list, tuple)):
        ids = prompt["prompt_token_ids"]
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ValueError(f"prompt_token_ids must be a list of ints, got {list(ids)[:5]!r}")
        return list(ids)
    raise ValueError(f"a prompt dict must be {{'prompt': str}} or {{'prompt_token_ids': [int, ...]}}, "
                     f"got keys {sorted(prompt)}")


def _per_prompt(lora_request, n: int) -> list:
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * n
    loras = list(lora_request)
    if len(loras) != n:
        raise ValueError(f"got {len(loras)} lora_request entries for {n} prompts")
    return loras


class LLM:
    """Run many prompts through the engine at once (continuous batching) and return whole outputs.

    `model=None` serves the embedded default, SmolLM2-135M-Instruct. Keyword arguments are
    EngineConfig fields (max_model_len, max_num_batched_tokens, max_num_seqs, enable_chunked_prefill,
    cost_aware_chunking, block_size, kv_cache_memory_bytes, gpu_memory_utilization, tensor_parallel_size,
    distributed_executor_backend, seed, device, ...). With tensor_parallel_size > 1 the engine starts
    rank processes; call shutdown() (or leave a `with LLM(...)` block) to stop them early.
    """

    def __init__(self, model: str | None = None, **engine_kwargs) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **engine_kwargs))
        self._counter = 0

    def shutdown(self) -> None:
        """Stop the tensor-parallel rank processes now (they also stop when this process exits)."""
        self.engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
                 priority: int | Sequence[int] | None = None) -> list[RequestOutput]:
        """Outputs in the order of `prompts`. A single prompt may be given bare (a str, one id list or one
        vLLM prompt dict). priority (vLLM's): one per prompt, lower runs first under scheduling_policy
        "priority" or "fair"; None = 0 each. lora_request (with enable_lora=True): one adapter for every prompt,
        or one per prompt (None: the base model), read from its path the first time its name is seen."""
        prompts = [prompts] if _is_single_prompt(prompts) else list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} sampling_params for {len(prompts)} prompts")
        priorities = [0] * len(prompts) if priority is None else list(
            [priority] * len(prompts) if isinstance(priority, int) else priority)
        if len(priorities) != len(prompts):
            raise ValueError(f"got {len(priorities)} priorities for {len(prompts)} prompts")
        loras = _per_prompt(lora_request, len(prompts))
        ids = []
        try:
            for prompt, p, prio, lora in zip(prompts, params, priorities, loras):
                ids.append(self._next_id())
                self.engine.add_request(ids[-1], _unwrap_prompt(prompt), p, priority=prio, lora_request=lora)
        except ValueError:
            self.engine.abort_request(ids)  # nothing half-queued is left behind
            raise
        return self._run(ids, use_tqdm)

    def beam_search(self, prompts: PromptType | Sequence[PromptType], params: BeamSearchParams,
                    use_tqdm: bool | None = None, lora_request: LoRARequest | None = None) -> list[RequestOutput]:
        """Beam search for each prompt; each output holds params.beam_width completions, best first."""
        prompts = [prompts] if _is_single_prompt(prompts) else list(prompts)
        ids = []
        try:
            for prompt in prompts:
                ids.append(self._next_id())
                self.engine.add_beam_request(ids[-1], _unwrap_prompt(prompt), params, lora_request=lora_request)
        except ValueError:
            self.engine.abort_request(ids)
            raise
        return self._run(ids, use_tqdm)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             add_generation_prompt: bool = True, use_tqdm: bool | None = None,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation (or a list of them) and generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tok = self.engine.tokenizer
        prompts = [tok.apply_chat_template(c, add_generation_prompt=add_generation_prompt, tokenize=True)
                   for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request)

    def _next_id(self) -> str:
        self._counter += 1
        return f"offline-{self._counter}"

    def _run(self, ids: list[str], use_tqdm: bool | None) -> list[RequestOutput]:
        show = sys.stderr.isatty() if use_tqdm is None else use_tqdm
        wanted = set(ids)
        final: dict[str, RequestOutput] = {}
        t0 = time.perf_counter()
        out_tokens = 0
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                out_tokens += len(out.outputs[0].new_token_ids)
                if out.finished and out.request_id in wanted:
                    final[out.request_id] = out
            if show:
                rate = out_tokens / max(time.perf_counter() - t0, 1e-9)
                print(f"\rProcessed prompts: {len(final)}/{len(ids)}  output {rate:,.0f} tok/s",
                      end="", file=sys.stderr, flush=True)
        if show:
            print(file=sys.stderr)
        return [final[i] for i in ids]
