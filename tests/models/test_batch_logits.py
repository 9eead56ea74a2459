"""build_forward_batch's logits rows: a count per sequence (0, 1, or 1 + k for a speculative verify)."""

from __future__ import annotations

import numpy as np
import pytest

from pagedserve.models.batch import SeqChunk, build_forward_batch


def test_logits_rows_per_sequence_are_a_count():
    chunks = [SeqChunk([1, 2, 3], 0, [0]), SeqChunk([7, 8, 9], 7, [1]), SeqChunk([4, 5], 4, [2], num_logits=0),
              SeqChunk([6], 3, [3], num_logits=1), SeqChunk([1, 2, 3, 4], 2, [4], num_logits=4)]
    batch = build_forward_batch(chunks, 16)
    np.testing.assert_array_equal(batch.query_start_loc, [0, 3, 6, 8, 9, 13])
    np.testing.assert_array_equal(batch.logits_indices, [2, 5, 8, 9, 10, 11, 12])
    assert batch.logits_indices.dtype == np.int64


@pytest.mark.parametrize("bad", [-1, 3])
def test_num_logits_outside_the_chunk_is_refused(bad):
    with pytest.raises(ValueError, match="num_logits"):
        build_forward_batch([SeqChunk([1, 2], 0, [0], num_logits=bad)], 16)
