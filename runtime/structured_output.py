"""StructuredOutputManager: one grammar matcher per sequence, and the token bitmask of each step.

The life of a constrained request:

    make_request     params validated (structured_outputs_params.py); group.grammar = compiler Future
    scheduler        the request stays waiting until its Future is done (Request.waiting_for_grammar)
    each step        start_bitmask(seqs): a worker thread fills one bitmask row per constrained row
                     while the forward runs (llguidance drops the GIL), then the sampler sets the
                     logits of disallowed tokens to -inf (sampling_ops.apply_token_bitmask)
    after sampling   accept(seq, token): the matcher advances; when the grammar can take nothing but
                     end-of-sequence the request finishes with finish_reason "stop"

Matcher state follows the sequence: a sample forked from sequence 0 (n > 1, best_of) starts from a
fresh copy of the compiled template (no sample has produced a token yet); a forked beam copies its
parent's matcher. A preempted request keeps its output tokens and its matcher, whose state depends
only on those tokens, so recompute needs no rollback. End-of-sequence is allowed by the mask only where
the grammar may end (llguidance sets the EOS bits exactly then).

Bitmask layout (llguidance's): int32 [rows, ceil(V / 32)], bit j of word w allows token 32 * w + j.
"""

from __future__ import annotations

import concurrent.futures
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import structlog

from .grammar_compiler import GrammarCompiler
from .structured_outputs_params import StructuredOutputsParams

log = structlog.get_logger("pagedserve.engine")


@dataclass
class GrammarBitmask:
    """Allowed tokens of some sampler rows: rows[i] may only sample tokens whose bit is set in bits[i]."""

    rows: np.ndarray  # int64 [R], indices into the sampler's batch
    bits: np.ndarray  # int32 [R, ceil(V / 32)]

    def take(self, num_rows: int) -> GrammarBitmask | None:
        """The part for rows below num_rows (None if none of them is constrained)."""
        keep = self.rows < num_rows
        return GrammarBitmask(self.rows[keep], self.bits[keep]) if keep.any() else None

    def select(self, sampler_rows: Sequence[int]) -> GrammarBitmask | None:
        """The part for these sampler rows, renumbered 0.. in the given order (None if none is constrained):
        for sampling a subset of the step's rows on its own."""
        pos = {r: k for k, r in enumerate(sampler_rows)}
        keep = [i for i, r in enumerate(self.rows.tolist()) if r in pos]
        if not keep:
            return None
        return GrammarBitmask(np.asarray([pos[int(self.rows[i])] for i in keep], dtype=np.int64), self.bits[keep])

    def allowed(self, row: int, vocab_size: int) -> np.ndarray | None:
        """Row `row`'s allowed tokens as bool [vocab_size], or None if that row is not constrained."""
        k = np.flatnonzero(self.rows == row)
        if k.size == 0:
            return None
        bits = np.unpackbits(self.bits[k[0]].view(np.uint8), bitorder="little").astype(bool)
        return np.pad(bits, (0, max(0, vocab_size - bits.size)))[:vocab_size]


class StructuredOutputManager:
    def __init__(self, tokenizer: Any, vocab_size: int, cache_size: int | None = None) -> None:
        kwargs = {} if cache_size is None else {"cache_size": cache_size}
        self.compiler = GrammarCompiler(tokenizer, vocab_size, **kwargs)
        self._executor: Any = None  # llguidance.LLExecutor, made on first use
        self._pool: ThreadPoolExecutor | None = None
        self._pending: list[Any] = []  # SequenceGroups whose grammar is still compiling
        # For benchmarks: time filling bitmasks (worker thread, beside the forward), and time the step
        # then still waited for them (what the masks add to a step's critical path).
        self.mask_time_s = 0.0
        self.mask_wait_s = 0.0
        self.num_masked_tokens = 0

    # -- requests ---------------------------------------------------------------------------------

    def compile(self, params: StructuredOutputsParams) -> Future:
        return self.compiler.submit(params.grammar_text)

    def track(self, group: Any) -> None:
        """An added group with a grammar: poll_failed reports it if its compile fails."""
        if not group.grammar.done() or group.grammar.exception() is not None:
            self._pending.append(group)

    def poll_failed(self) -> list[tuple[Any, BaseException]]:
        """Groups whose grammar failed to compile since the last call (they never took a KV block)."""
        failed, still = [], []
        for group in self._pending:
            if not group.grammar.done():
                still.append(group)
            elif group.grammar.exception() is not None:
                failed.append((group, group.grammar.exception()))
        self._pending = still
        return failed

    def wait_for_any(self, timeout_s: float) -> None:
        """Block until some pending grammar is compiled (or timeout_s): an engine with nothing else to
        run waits here instead of spinning."""
        pending = [g.grammar for g in self._pending if not g.grammar.done()]
        if pending:
            concurrent.futures.wait(pending, timeout=timeout_s, return_when=concurrent.futures.FIRST_COMPLETED)

    # -- per sequence -----------------------------------------------------------------------------

    @staticmethod
    def matcher(seq: Any) -> Any:
        """The sequence's matcher (created from the compiled template on first use), or None."""
        if seq.matcher is None:
            group = seq.group
            if group is None or group.grammar is None:
                return None
            seq.matcher = group.grammar.result().deep_copy()
        return seq.matcher

    @staticmethod
    def fork(parent: Any, child: Any) -> None:
        if parent.matcher is not None:
            child.matcher = parent.matcher.deep_copy()

    def accept(self, seq: Any, token_id: int) -> bool | None:
        """Advance the sequence's matcher by its new token. None: unconstrained; True: the grammar is
        complete (only end-of-sequence could follow, or it was just consumed); False: keep going."""
        m = self.matcher(seq)
        if m is None:
            return None
        if not m.consume_token(token_id):
            # The mask allowed only tokens the grammar takes, so this is a bug, not bad input.
            raise RuntimeError(f"structured output of {seq.request_id} rejected token {token_id}: "
                               f"{m.get_error()[:200]}")
        return m.is_stopped()

    # -- the step's bitmask -----------------------------------------------------------------------

    def start_bitmask(self, seqs: Sequence[Any]) -> _PendingBitmask | None:
        """Fill the bitmask of the constrained sequences among `seqs` (the sampler's rows, in order) in a
        worker thread; None when none is constrained. .result() gives a GrammarBitmask."""
        rows = [i for i, s in enumerate(seqs) if s.group is not None and s.group.grammar is not None]
        if not rows:
            return None
        matchers = [self.matcher(seqs[i]) for i in rows]
        if self._pool is None:
            import llguidance as llg

            self._executor = llg.LLExecutor()
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-bitmask")
        words = (self.compiler.ll_tokenizer.vocab_size + 31) // 32
        return _PendingBitmask(self, self._pool.submit(self._fill, np.asarray(rows, dtype=np.int64), matchers, words))

    def _fill(self, rows: np.ndarray, matchers: list[Any], words: int) -> GrammarBitmask:
        from llguidance.numpy import fill_next_token_bitmask_par

        t0 = time.perf_counter()
        bits = np.zeros((len(matchers), words), dtype=np.int32)
        fill_next_token_bitmask_par(self._executor, [(m, k) for k, m in enumerate(matchers)], bits)
        self.mask_time_s += time.perf_counter() - t0
        self.num_masked_tokens += len(matchers)
        return GrammarBitmask(rows, bits)

    def shutdown(self) -> None:
        self.compiler.shutdown()
        if self._pool is not None:
            self._pool.shutdown(wait=False)


class _PendingBitmask:
    """The step's bitmask being filled; result() waits for it (and counts the wait)."""

    def __init__(self, manager: StructuredOutputManager, future: Future) -> None:
        self._manager = manager
        self._future = future

    def result(self) -> GrammarBitmask:
        t0 = time.perf_counter()
        out = self._future.result()
        self._manager.mask_wait_s += time.perf_counter() - t0
        return out
