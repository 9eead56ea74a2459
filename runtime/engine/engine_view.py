"""What the server reads of a running engine, besides requests and the published stats snapshot: the
tokenizer, the model's facts, live counters, shutdown. AsyncEngine is one; sidecar/ reads the engine only
through it (tests/sidecar/test_engine_joint.py checks that nothing reaches past it).

Safe from the event loop or any thread: the tokenizer is stateless, the facts fixed, and the counters plain
ints the worker bumps (reading one is atomic).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping, Sequence

from ..kv_transfer.kv_connector import KVTransferStats
from ..lora.view import LoRAView
from ..outputs import EngineInfo

if TYPE_CHECKING:
    from .llm_engine import LLMEngine


class EngineView(LoRAView):
    engine: LLMEngine

    @property
    def vocab_size(self) -> int:
        return self.engine.model_config.vocab_size

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text` (ValueError for a non-str). Seconds for a very long text: call it off the loop."""
        return self.engine.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def tokenize_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                      tools: list[dict] | None = None) -> list[int]:
        """Token ids of a conversation rendered by the model's chat template (ValueError when there is none);
        `tools`: OpenAI's tool objects for the prompt (sidecar/tool_calls.py's ToolPlan.template_tools)."""
        return self.engine.tokenizer.apply_chat_template(list(messages), add_generation_prompt=add_generation_prompt,
                                                         tokenize=True, tools=tools)

    def detokenize(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.engine.tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def model_info(self) -> EngineInfo:
        e = self.engine
        return EngineInfo(architecture=e.model_config.architecture, max_model_len=e.max_model_len,
                          vocab_size=e.model_config.vocab_size, block_size=e.block_size, dtype=str(e.backend.dtype),
                          backend=e.backend.name, num_kv_blocks=e.num_kv_blocks, kernels=e.backend.ops.name,
                          blas_kernel=(e.blas or {}).get("architecture") or "", blas_threads=e.cpu_threads or 0,
                          numba_code_path=e.numba_code_path or "", kv_cache_dtype=e.kv_layout.dtype)

    @property
    def memory_budget_bytes(self) -> int:
        """The engine's memory budget, as checked at start (runtime/worker/memory_budget.py)."""
        return self.engine.memory_budget.total_bytes

    def prefix_cache_counts(self) -> tuple[int, int]:
        """(prompt tokens looked up in the prefix cache, of those found cached) since start; live counters."""
        sched = self.engine.scheduler
        return sched.num_prompt_tokens, sched.num_cached_prompt_tokens

    def kv_transfer_stats(self) -> KVTransferStats:
        """A copy of the disaggregated-serving counters as they are now, not as of the last `stats` snapshot:
        a decode instance's are bumped before the stream that used them moves on, so a reader never sees
        them late."""
        return self.engine.kv_stats.snapshot()

    @property
    def can_send_kv_blocks(self) -> bool:
        """Whether this engine can copy whole KV blocks out for a decode instance: not under tensor
        parallelism, where each rank holds a slice of every block."""
        return self.engine.block_io is not None

    def count_kv_sent(self, num_blocks: int, num_bytes: int) -> None:
        """Count blocks sent to a decode instance (the KVTransfer servicer, once the last chunk is out)."""
        stats = self.engine.kv_stats
        stats.kv_blocks_sent += num_blocks
        stats.kv_bytes_sent += num_bytes

    def shutdown(self) -> None:
        """Stop the engine's rank processes (tensor parallelism; a no-op for one rank). After stop() or a failure."""
        self.engine.shutdown()
