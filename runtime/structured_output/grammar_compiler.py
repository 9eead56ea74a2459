"""GrammarCompiler: llguidance grammars -> token-level matchers, in a worker thread, with an LRU cache.

    make_request ---submit(grammar_text)---> cache hit?  yes: the same Future (often already done)
                                                        no:  a new Future; the worker thread builds
                                                             LLMatcher(tokenizer, grammar) into it
    scheduler: a request whose Future is not done stays waiting (Request.waiting_for_grammar)
    each sequence: template.deep_copy()  (about a microsecond; the template is never advanced)

Compiling against the tokenizer (the lexer's view of every token) takes well under a millisecond for
the JSON schemas people write, but can reach 100 ms or more for large grammars; llguidance drops the
GIL meanwhile, so the step loop keeps running. The LLTokenizer itself (~0.3 s for a 49k vocabulary)
is built on the first compile, so an engine that never sees a constraint never pays for it.

The cache is keyed by the grammar text and bounded (least recently used entries go first); a failed
compile is cached too, so the same bad grammar is not compiled again.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ..structured_outputs_params import MAX_ERROR_CHARS

DEFAULT_CACHE_SIZE = 256


class GrammarCompiler:
    def __init__(self, tokenizer: Any, vocab_size: int, cache_size: int = DEFAULT_CACHE_SIZE) -> None:
        """tokenizer: models.tokenizer.Tokenizer (its `backend` is a tokenizers.Tokenizer); vocab_size:
        the width of the model's logits (may exceed the tokenizer's vocabulary: padded embeddings)."""
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._ll_tokenizer: Any = None
        self.cache_size = cache_size
        self._cache: OrderedDict[str, Future] = OrderedDict()
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._unproducible: frozenset[int] | None = None
        self.compile_times_s: list[float] = []  # one per compile actually run (misses), for benchmarks
        self.num_hits = 0

    @property
    def ll_tokenizer(self) -> Any:
        """The llguidance tokenizer, built once from the model's own tokenizer (worker thread or caller)."""
        with self._lock:
            if self._ll_tokenizer is None:
                import llguidance as llg

                tok = self._tokenizer
                n_vocab = max(self._vocab_size, tok.vocab_size)
                self._ll_tokenizer = llg.LLTokenizer(tok.backend.to_str(), n_vocab=n_vocab,
                                                     eos_token=list(tok.eos_token_ids) or None)
            return self._ll_tokenizer

    def unproducible_bytes(self) -> frozenset[int]:
        """The bytes no token of the vocabulary contains (a byte-level BPE may lack some control bytes:
        SmolLM2 has no token for 0x06). A constraint that needs one can never be followed, and llguidance's
        mask then lets a token through that its parser refuses (found by the reliability fuzz)."""
        if self._unproducible is None:
            ll = self.ll_tokenizer
            seen: set[int] = set()
            for t in range(ll.vocab_size):
                seen.update(ll.decode_bytes([t]))
            self._unproducible = frozenset(range(256)) - seen
        return self._unproducible

    def submit(self, grammar_text: str) -> Future:
        """A Future of the template matcher for `grammar_text` (shared with every request that asks)."""
        with self._lock:
            fut = self._cache.get(grammar_text)
            if fut is not None:
                self._cache.move_to_end(grammar_text)
                self.num_hits += 1
                return fut
            fut = Future()
            self._cache[grammar_text] = fut
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)  # a request holding the evicted Future keeps it
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-compiler")
        self._pool.submit(self._compile, grammar_text, fut)
        return fut

    def run_beside(self, fn: Any, *args: Any) -> None:
        """fn(*args) on the worker thread, after the compiles submitted before it (errors are dropped: it
        only prepares what the caller would otherwise build itself)."""
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-compiler")
        self._pool.submit(fn, *args)

    def _compile(self, grammar_text: str, fut: Future) -> None:
        if not fut.set_running_or_notify_cancel():
            return
        try:
            import llguidance as llg

            tokenizer = self.ll_tokenizer
            t0 = time.perf_counter()
            matcher = llg.LLMatcher(tokenizer, grammar_text, log_level=0)
            self.compile_times_s.append(time.perf_counter() - t0)
            if matcher.is_error():
                msg = " ".join(matcher.get_error().split())[:MAX_ERROR_CHARS]
                raise ValueError(f"structured_outputs could not be compiled for this model's tokenizer: {msg}")
            fut.set_result(matcher)
        except BaseException as e:  # delivered to whoever waits on the Future
            fut.set_exception(e)

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
