"""StructuredOutputManager: one grammar matcher per sequence, and the token bitmask of each step.

The life of a constrained request:

    make_request     params validated (structured_outputs_params.py); group.grammar = compiler Future
    scheduler        the request stays waiting until its Future is done (Request.waiting_for_grammar)
    each step        start_bitmask(seqs, drafts): a worker thread fills one bitmask row per constrained
                     row while the forward runs (llguidance drops the GIL), then the sampler sets the
                     logits of disallowed tokens to -inf (sampling_ops.apply_token_bitmask)
    speculation      a speculating sequence's 1 + k verify rows get the masks of the states after
                     each of its drafts (the matcher advanced tentatively, then rolled back), so every
                     row's distribution is the guided one; drafts were checked when proposed
                     (num_valid_drafts, spec_grammar.py)
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

from . import schema_check
from .grammar_compiler import GrammarCompiler
from ..structured_outputs_params import StructuredOutputsParams

log = structlog.get_logger("pagedserve.engine")


@dataclass(frozen=True)
class MaskRows:
    """The step's sampler-row layout for grammar masks: masked sequence i takes 1 + len(drafts[i]) rows (its
    state now, then after each draft), in order. Written once, here; the model runner reads it back."""

    starts: np.ndarray  # int64 [S]: sequence i's first row
    counts: np.ndarray  # int64 [S]

    @classmethod
    def of(cls, drafts: Sequence[Sequence[int]]) -> MaskRows:
        counts = np.asarray([1 + len(d) for d in drafts], dtype=np.int64)
        return cls(np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64), counts)

    def rows(self, first: int, last: int | None = None) -> range:
        """The sampler rows of masked sequences first .. last (last defaults to first)."""
        last = first if last is None else last
        return range(int(self.starts[first]), int(self.starts[last] + self.counts[last]))


@dataclass
class GrammarBitmask:
    """Allowed tokens of some sampler rows: rows[i] may only sample tokens whose bit is set in bits[i]."""

    rows: np.ndarray  # int64 [R], indices into the sampler's batch
    bits: np.ndarray  # int32 [R, ceil(V / 32)]
    layout: MaskRows | None = None  # the step's row layout (start_bitmask's)

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
        self.check_producible(params)
        future = self.compiler.submit(params.grammar_text)
        if params.warnings:  # lenient: accepted, but not all of it is enforced (the outputs say so too)
            log.warning("structured_outputs.not_enforced_exactly", kind=params.kind,
                        keywords=sorted({w.split(":", 1)[0] for w in params.warnings}), warnings=params.warnings)
            self.compiler.run_beside(schema_check.prepare, params)  # finished outputs are checked against it
        return future

    def check_producible(self, params: StructuredOutputsParams) -> None:
        """ValueError if a regex, grammar or choice holds a character this vocabulary cannot produce: the
        output could never match it (and llguidance would then let a wrong token through). Checked on
        the text as written, so such a character is refused even where the constraint may not need it
        (inside a character class, say); JSON schemas are exempt (JSON writes control bytes escaped)."""
        kind = params.kind
        if kind not in ("regex", "grammar", "choice"):
            return
        missing = self.compiler.unproducible_bytes()
        if not missing:
            return
        for text in (params.choice if kind == "choice" else [getattr(params, kind)]):
            if missing.isdisjoint(text.encode("utf-8", "surrogatepass")):
                continue
            ch = next(c for c in text if not missing.isdisjoint(c.encode("utf-8", "surrogatepass")))
            raise ValueError(f"structured_outputs.{kind} holds {ch!r}, which no token of this model's vocabulary "
                             f"can produce: the output could never match it")

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

    def num_valid_drafts(self, seq: Any, drafts: Sequence[int]) -> int:
        """How many leading drafts the sequence's grammar takes from its current state (the state is
        unchanged: llguidance advances tentatively and rolls back)."""
        m = self.matcher(seq)
        return len(drafts) if m is None or not drafts else int(m.validate_tokens(list(drafts)))

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

    def start_bitmask(self, seqs: Sequence[Any],
                      drafts: Sequence[Sequence[int]] | None = None) -> _PendingBitmask | None:
        """Fill the bitmask of the constrained sequences among `seqs` in a worker thread; None when none is
        constrained. .result() gives a GrammarBitmask whose rows number the sampler's rows: sequence i has
        1 + len(drafts[i]) of them (drafts: speculative verify rows; None = one row each), the first for
        the matcher's state now, row j + 1 for the state after its first j + 1 drafts."""
        guided = [i for i, s in enumerate(seqs) if s.group is not None and s.group.grammar is not None]
        if not guided:
            return None
        layout = MaskRows.of(drafts if drafts is not None else [[]] * len(seqs))
        entries = [(self.matcher(seqs[i]), list(drafts[i]) if drafts is not None else []) for i in guided]
        rows = np.concatenate([np.asarray(layout.rows(i)) for i in guided]).astype(np.int64)
        return _PendingBitmask(self, self._worker().submit(self._fill, rows, entries), layout)

    def fill_now(self, matchers: Sequence[Any]) -> np.ndarray:
        """The bitmask of each matcher's current state, filled on this thread: int32 [len, words]."""
        return self._fill(np.arange(len(matchers), dtype=np.int64), [(m, []) for m in matchers]).bits

    def _worker(self) -> ThreadPoolExecutor:
        if self._pool is None:
            import llguidance as llg

            self._executor = llg.LLExecutor()
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-bitmask")
        return self._pool

    def _fill(self, rows: np.ndarray, entries: list[tuple[Any, list[int]]]) -> GrammarBitmask:
        """entries: (matcher, drafts) in row order, each taking 1 + len(drafts) rows. llguidance advances a
        matcher through its drafts and rolls it back; rows past a draft the grammar refuses (none, when
        drafts were checked at proposal) stay all-allowed: the row before gives that draft probability 0,
        so it is rejected and the rows after it are never used."""
        from llguidance.numpy import fill_next_token_bitmask_par, fill_next_token_bitmask_par_with_draft_tokens

        self._worker()
        t0 = time.perf_counter()
        words = (self.compiler.ll_tokenizer.vocab_size + 31) // 32
        bits = np.full((len(rows), words), -1, dtype=np.int32)
        at, plain, drafted = 0, [], []  # llguidance's draft variant refuses an empty draft list
        for m, d in entries:
            if d:
                drafted.append((m, at, d))
            else:
                plain.append((m, at))
            at += 1 + len(d)
        if plain:
            fill_next_token_bitmask_par(self._executor, plain, bits)
        if drafted:
            fill_next_token_bitmask_par_with_draft_tokens(self._executor, drafted, bits)
        self.mask_time_s += time.perf_counter() - t0
        self.num_masked_tokens += len(rows)
        return GrammarBitmask(rows, bits)

    def shutdown(self) -> None:
        self.compiler.shutdown()
        if self._pool is not None:
            self._pool.shutdown(wait=False)


class _PendingBitmask:
    """The step's bitmask being filled; result() waits for it (and counts the wait)."""

    def __init__(self, manager: StructuredOutputManager, future: Future, layout: MaskRows) -> None:
        self._manager = manager
        self._future = future
        self._layout = layout

    def result(self) -> GrammarBitmask:
        t0 = time.perf_counter()
        out = self._future.result()
        self._manager.mask_wait_s += time.perf_counter() - t0
        out.layout = self._layout
        return out
