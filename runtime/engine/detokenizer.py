"""Incremental detokenization with stop strings: token ids in, complete new text out.

Two things make streaming text harder than ``decode(all_ids)`` each step:

* **Partial characters.** With byte-level BPE (or SentencePiece byte fallback) one character can
  be spread over several tokens; decoding a prefix of them gives U+FFFD. We decode a small window
  of recent tokens and release text only when it does not end in U+FFFD (vLLM's prefix/read
  offset technique)::

        ids:   ... | prefix_offset ........ | read_offset ............ | len(ids)
                     already released,        not yet released
                     decoded again as context
        new text = decode(ids[prefix:])[len(decode(ids[prefix:read])):]

  The context tokens make decoders that treat a sequence's first token specially (SentencePiece
  drops its leading space) produce the same text as a decode of the whole sequence.

* **Stop strings.** A stop string can arrive split over tokens, so text that might be the start
  of one is held back until it is clear (at most len(longest stop) - 1 characters: only the
  longest tail of the text that is a proper prefix of some stop string). When a stop string
  appears, the text before it is released (and the stop string too with
  ``include_stop_str_in_output``), nothing after it, and ``stop_hit`` names it. If several
  appear in the same step, the one that ends first wins (as a character-by-character stream
  would see it); on a tie, the longer one. With ``include_stop_str_in_output`` nothing needs to
  be held back (vLLM does the same). Stop strings are only looked for in generated text.

Ending for another reason (``finish()``): held-back text is flushed; a trailing incomplete
character is dropped, as vLLM does, so no U+FFFD is ever produced by truncation. (A literal
U+FFFD as the very last character looks the same: it is held and dropped too.)

Each ``add_tokens`` call decodes only the window above (a few tokens of context plus the new
ones), so its cost does not grow with the length of the output.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

_REPLACEMENT = "\ufffd"
# Prompt tokens decoded as context for the first output tokens (vLLM's
# INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET); also the most context kept after a long delta.
_CONTEXT_TOKENS = 5
# When this many tokens are pending and the text still ends in U+FFFD, the model is producing
# invalid bytes rather than one split character (4 bytes at most): release the settled part so
# the window, and the cost of each call, stay bounded.
_MAX_PENDING_TOKENS = 16
# Tokens kept after the end of any character that can still change: 3 continuation bytes at most.
_SETTLE_TOKENS = 4
# Drop consumed ids from the front of the window once this many have piled up.
_TRIM_AT = 256


class SupportsDecode(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool) -> str: ...


@dataclass
class DeltaText:
    text: str  # newly released text (possibly "")
    stop_hit: str | None  # the stop string found in this step, if any


class IncrementalDetokenizer:
    """Turns a request's output tokens into text, step by step. See the module docstring."""

    def __init__(
        self,
        tokenizer: SupportsDecode,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
        stop: Sequence[str] | None = None,
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
    ) -> None:
        """``min_tokens``: stop strings completed before this many output tokens are ignored
        (matches the engine, which does not end a request before min_tokens)."""
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = [stop] if isinstance(stop, str) else list(stop or [])
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop strings must be non-empty strings")
        self.include_stop_str_in_output = include_stop_str_in_output
        self.min_tokens = min_tokens
        self._max_stop_len = max((len(s) for s in self.stop), default=0)

        # Only the prompt's tail matters, as decoding context.
        self._ids: list[int] = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._prefix_text: str | None = None  # decode(ids[prefix:read]), cached
        self.num_output_tokens = 0

        self._released: list[str] = []  # pieces of output_text
        self._held = ""  # decoded text held back as a possible stop-string start
        self._recent = ""  # last (max stop len - 1) chars of decoded output, for the search
        self._stop_hit: str | None = None
        self._finished = False

    @property
    def output_text(self) -> str:
        """All text released so far."""
        if len(self._released) > 1:
            self._released = ["".join(self._released)]
        return self._released[0] if self._released else ""

    @property
    def stop_hit(self) -> str | None:
        return self._stop_hit

    def add_tokens(self, new_ids: Sequence[int]) -> DeltaText:
        """Append generated tokens; return only the new, complete text they release.

        After a stop string has been hit the request is over: further tokens are ignored and the
        same stop string is reported again.
        """
        if self._stop_hit is not None or self._finished:
            return DeltaText("", self._stop_hit)
        if not new_ids:
            return DeltaText("", None)
        self._ids.extend(new_ids)
        self.num_output_tokens += len(new_ids)
        return self._release(self._decode_new(), final=False)

    def finish(self) -> str:
        """The request ended for another reason: release what is held back and return it.

        A trailing incomplete character (still U+FFFD) is dropped, as vLLM does. If the flushed
        text completes a stop string, it is cut there and ``stop_hit`` is set.
        """
        if self._stop_hit is not None or self._finished:
            return ""
        pending = ""
        if self._read_offset < len(self._ids):
            full = self._decode(self._prefix_offset, len(self._ids))
            pending = full[len(self._prefix_text_cached()) :].rstrip(_REPLACEMENT)
        delta = self._release(pending, final=True)
        self._finished = True
        return delta.text

    # -- decoding -------------------------------------------------------------------------------

    def _decode(self, start: int, stop: int) -> str:
        return self.tokenizer.decode(self._ids[start:stop], skip_special_tokens=self.skip_special_tokens)

    def _prefix_text_cached(self) -> str:
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._prefix_offset, self._read_offset)
        return self._prefix_text

    def _advance(self, new_read: int) -> None:
        # The tokens just released become the context of the next window, but no more than a
        # few of them: a long delta must not make the next call decode it all again.
        self._prefix_offset = max(self._read_offset, new_read - _CONTEXT_TOKENS)
        self._read_offset = new_read
        self._prefix_text = None
        if self._prefix_offset >= _TRIM_AT:
            del self._ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0

    def _decode_new(self) -> str:
        """Text of the pending tokens if it is complete, else "" (and they stay pending)."""
        prefix_text = self._prefix_text_cached()
        full = self._decode(self._prefix_offset, len(self._ids))
        if len(full) > len(prefix_text) and not full.endswith(_REPLACEMENT):
            self._advance(len(self._ids))
            return full[len(prefix_text) :]
        if len(self._ids) - self._read_offset > _MAX_PENDING_TOKENS:
            return self._release_settled(prefix_text, full)
        return ""

    def _release_settled(self, prefix_text: str, full: str) -> str:
        """Invalid bytes keep the text ending in U+FFFD: release up to a cut point whose text
        can no longer change, i.e. whose decode is a prefix of the whole window's decode, with
        enough tokens after it to complete any character it ends with."""
        if len(full) == len(prefix_text) and not full.endswith(_REPLACEMENT):
            # A run of tokens that decode to nothing (skipped special tokens): let them go.
            self._advance(len(self._ids))
            return ""
        for cut in range(len(self._ids) - _SETTLE_TOKENS, self._read_offset, -1):
            text = self._decode(self._prefix_offset, cut)
            if len(text) > len(prefix_text) and full.startswith(text):
                self._advance(cut)
                return text[len(prefix_text) :]
        return ""

    # -- stop strings ---------------------------------------------------------------------------

    def _release(self, new_text: str, final: bool) -> DeltaText:
        if not self.stop:
            if new_text:
                self._released.append(new_text)
            return DeltaText(new_text, None)

        region = self._recent + new_text
        # self._held is a suffix of self._recent: region[offset:] is the unreleased text.
        offset = len(self._recent) - len(self._held)
        hit = None
        if self.num_output_tokens >= self.min_tokens:
            hit = self._find_stop(region, len(self._recent))
        if hit is not None:
            stop, start = hit
            end = start + len(stop) if self.include_stop_str_in_output else start
            assert end >= offset, "released text contained the start of a stop string"
            text = region[offset:end]
            self._stop_hit = stop
            self._held = ""
        else:
            unreleased = region[offset:]
            keep = 0 if (final or self.include_stop_str_in_output) else self._stop_prefix_len(unreleased)
            text = unreleased[: len(unreleased) - keep]
            self._held = unreleased[len(unreleased) - keep :]
            self._recent = region[-(self._max_stop_len - 1) :] if self._max_stop_len > 1 else ""
        if text:
            self._released.append(text)
        return DeltaText(text, self._stop_hit)

    def _find_stop(self, region: str, new_start: int) -> tuple[str, int] | None:
        """The stop string occurrence that ends first among those ending after new_start."""
        best: tuple[int, int, str] | None = None  # (end, -len, stop)
        for stop in self.stop:
            # Only occurrences that end inside the new text; earlier ones were seen (or, before
            # min_tokens, deliberately ignored) already.
            start = region.find(stop, max(0, new_start - len(stop) + 1))
            if start >= 0:
                key = (start + len(stop), -len(stop), stop)
                if best is None or key < best:
                    best = key
        if best is None:
            return None
        end, neg_len, stop = best
        return stop, end + neg_len

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest tail of text that is a proper prefix of some stop string."""
        longest = 0
        for stop in self.stop:
            for k in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:k]):
                    longest = k
                    break
        return longest
