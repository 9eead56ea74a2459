"""N-gram (prompt lookup) proposals: continue the sequence the way it continued before.

Find the longest suffix of the sequence (prompt + output), between prompt_lookup_min and
prompt_lookup_max tokens, that also occurs earlier; propose the k tokens that followed its most
recent earlier occurrence::

    tokens   ... the cat sat on the mat . the cat sat on  |
    suffix (n=4)                              "cat sat on" ... longest earlier match: "the cat sat on"
    proposal                                  "the mat ." (the tokens after that match)

Vectorised over the whole sequence: for i = 0..max-1, compare every position j against the suffix
token i places back (tokens[j - i] == tokens[L - 1 - i]); the running AND down i gives, for each j,
how long a match of the suffix ends at j. One pass per i, O(prompt_lookup_max * L) in numpy.
"""

from __future__ import annotations

import numpy as np


def propose_ngram(tokens: np.ndarray, k: int, prompt_lookup_min: int, prompt_lookup_max: int) -> np.ndarray:
    """Up to k draft tokens (int64), or none when no n-gram of the allowed sizes recurs."""
    tokens = np.asarray(tokens, dtype=np.int64)
    length = tokens.shape[0]
    if k <= 0 or length < prompt_lookup_min + 1:
        return tokens[:0]
    # Candidate ends j of an earlier occurrence: j <= L - 2, so at least one token follows it.
    ends = np.arange(length - 1)
    run = np.ones(length - 1, dtype=bool)
    match_len = np.zeros(length - 1, dtype=np.int64)
    for i in range(min(prompt_lookup_max, length - 1)):
        pos = ends - i
        ok = pos >= 0
        run &= ok & (tokens[np.maximum(pos, 0)] == tokens[length - 1 - i])
        if not run.any():
            break
        match_len += run
    best = int(match_len.max()) if match_len.size else 0
    if best < prompt_lookup_min:
        return tokens[:0]
    j = int(np.flatnonzero(match_len == best)[-1])  # the most recent of the longest matches
    return tokens[j + 1 : j + 1 + k].copy()
