"""ForwardBatch: the one flat, variable-length batch the model sees each step (see DESIGN.md).

Prefill chunks and decodes are mixed freely. For three sequences scheduled with 3, 1 and 2 new tokens:

    input_ids       = [a0 a1 a2 | b7 | c4 c5]
    query_start_loc = [0, 3, 4, 6]
    seq_lens        = [3, 8, 6]        context length including the new tokens
    positions       = [0 1 2 | 7 | 4 5]
    logits_indices  = [2, 3, 5]        the last new token of each sequence that needs a sample

A sequence may want logits for more than its last token: a speculative verify step schedules a decode
as 1 + k tokens (the newest token and k draft tokens) and needs all 1 + k rows, one per position the
drafts are checked at. With b scheduled as [b7 d1 d2] and num_logits = 3 (and a mid-prompt chunk c
with num_logits = 0):

    input_ids       = [a0 a1 a2 | b7 d1 d2 | c4 c5]
    logits_indices  = [2, 3, 4, 5]     a's last row, then b's three rows; c has none

prompt_lens (optional): each sequence's prompt length, which LongRoPE picks its factors by (models/rope.py);
None where no chunk names one, and a chunk without one counts its seq_len.

KV cache groups (a model with sliding-window layers; runtime/core/kv_cache_groups.py): every group after
the first has its own block tables and slot mapping (group_block_tables, group_slot_mappings), and
layer_group says which group each layer reads and writes; `kv_tables(layer)` gives a layer its pair. A
batch without groups leaves all three empty: every layer uses block_tables and slot_mapping.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Sequence

import numpy as np


@dataclass
class ForwardBatch:
    input_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64
    slot_mapping: np.ndarray  # [T] int64, -1 = do not write
    query_start_loc: np.ndarray  # [B + 1] int32
    seq_lens: np.ndarray  # [B] int32
    block_tables: np.ndarray  # [B, max_blocks] int32, padded with 0
    logits_indices: np.ndarray  # [N] int64
    group_block_tables: tuple[Any, ...] = ()  # groups 1..G-1: [B, max_blocks] int32 each
    group_slot_mappings: tuple[Any, ...] = ()  # groups 1..G-1: [T] int64 each
    layer_group: tuple[int, ...] = ()  # per layer, its group (empty: group 0 for every layer)
    prompt_lens: Any = None  # [B] int32: each sequence's prompt length (LongRoPE's factors); None: seq_lens
    lora_slots: Any = None  # [T] int32: each row's LoRA slot, -1 = the base (models/lora.py); None: no adapter rows
    workspace: Any = None  # models/workspace.Workspace: where the ops write (a decode graph's); None: they allocate

    def group_of(self, layer: int) -> int:
        """The KV cache group `layer` reads and writes."""
        return self.layer_group[layer] if self.layer_group else 0

    def kv_tables(self, layer: int) -> tuple[Any, Any]:
        """(block_tables, slot_mapping) of the KV cache group that `layer` belongs to."""
        group = self.group_of(layer)
        if group == 0:
            return self.block_tables, self.slot_mapping
        return self.group_block_tables[group - 1], self.group_slot_mappings[group - 1]

    def for_layer(self, layer: int) -> ForwardBatch:
        """The batch as `layer` sees it: its group's block_tables and slot_mapping in the usual fields (the batch
        itself for group 0), so a layer's code reads batch.block_tables / batch.slot_mapping as before."""
        group = self.group_of(layer)
        if group == 0:
            return self
        return replace(self, block_tables=self.group_block_tables[group - 1],
                       slot_mapping=self.group_slot_mappings[group - 1])

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])


@dataclass
class SeqChunk:
    """What one sequence contributes to a step: its new tokens and where its context lives."""

    token_ids: Sequence[int]  # the new tokens scheduled this step
    num_computed_tokens: int  # tokens already in the KV cache before this step
    block_table: Sequence[int]
    # Logits rows wanted: the last `num_logits` new tokens (1 = a plain sample, 0 = a prefill chunk
    # short of the prompt's end, 1 + k = a speculative verify step with k draft tokens).
    num_logits: int = 1
    group_block_tables: Sequence[Sequence[int]] = ()  # the tables of KV cache groups 1.. (none: one group)
    prompt_len: int | None = None  # the sequence's prompt length (LongRoPE's factors); None: its seq_len
    lora_slot: int = -1  # the LoRA slot its rows run with (models/lora.py); -1: the base model


def _tables_and_slots(tables: Sequence[Sequence[int]], seq_lens: np.ndarray, seq_index: np.ndarray,
                      positions: np.ndarray, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """One group's block tables [B, max_blocks] (padded with 0) and the slot of every new token."""
    max_blocks = max(1, max(len(t) for t in tables))
    block_tables = np.zeros((len(tables), max_blocks), dtype=np.int32)
    for i, table in enumerate(tables):
        needed = -(-int(seq_lens[i]) // block_size)
        if len(table) < needed:
            raise ValueError(f"sequence {i}: block table has {len(table)} blocks, needs {needed}")
        block_tables[i, : len(table)] = table
    blocks = block_tables[seq_index, positions // block_size].astype(np.int64)
    return block_tables, blocks * block_size + positions % block_size


def build_forward_batch(chunks: Sequence[SeqChunk], block_size: int,
                        layer_group: Sequence[int] = ()) -> ForwardBatch:
    """The step's batch; `layer_group`: each layer's KV cache group, when the chunks carry the tables of more
    than one (SeqChunk.group_block_tables)."""
    if not chunks:
        raise ValueError("build_forward_batch needs at least one sequence")
    counts = np.array([len(c.token_ids) for c in chunks], dtype=np.int64)
    if (counts <= 0).any():
        raise ValueError("every scheduled sequence needs at least one new token")
    computed = np.array([c.num_computed_tokens for c in chunks], dtype=np.int64)
    query_start_loc = np.zeros(len(chunks) + 1, dtype=np.int32)
    np.cumsum(counts, out=query_start_loc[1:])
    seq_lens = (computed + counts).astype(np.int32)
    input_ids = np.fromiter((t for c in chunks for t in c.token_ids), dtype=np.int64, count=int(counts.sum()))
    # positions: computed .. computed + count - 1 for each sequence, built without a Python loop per token.
    seq_index = np.repeat(np.arange(len(chunks)), counts)
    positions = np.arange(int(counts.sum()), dtype=np.int64) - query_start_loc[seq_index] + computed[seq_index]
    block_tables, slot_mapping = _tables_and_slots([c.block_table for c in chunks], seq_lens, seq_index, positions,
                                                   block_size)
    num_groups = 1 + len(chunks[0].group_block_tables)
    if any(len(c.group_block_tables) != num_groups - 1 for c in chunks):
        raise ValueError("every sequence of a step carries the block tables of the same KV cache groups")
    if (num_groups > 1 or layer_group) and (not layer_group or max(layer_group) >= num_groups or min(layer_group) < 0):
        raise ValueError(f"layer_group {tuple(layer_group)} does not name the step's {num_groups} KV cache groups")
    extra = [_tables_and_slots([c.group_block_tables[g] for c in chunks], seq_lens, seq_index, positions, block_size)
             for g in range(num_groups - 1)]
    num_logits = np.array([c.num_logits for c in chunks], dtype=np.int64)
    if ((num_logits < 0) | (num_logits > counts)).any():
        raise ValueError("num_logits must be between 0 and the sequence's number of new tokens")
    # Rows ends[i] - num_logits[i] .. ends[i] - 1 of each sequence, in sequence order, without a loop.
    ends = np.repeat(query_start_loc[1:].astype(np.int64), num_logits)
    offsets = np.arange(int(num_logits.sum()), dtype=np.int64) - np.repeat(np.cumsum(num_logits) - num_logits,
                                                                          num_logits)
    logits_indices = ends - np.repeat(num_logits, num_logits) + offsets
    prompt_lens = None
    if any(c.prompt_len is not None for c in chunks):
        prompt_lens = np.array([n if c.prompt_len is None else c.prompt_len for c, n in zip(chunks, seq_lens)],
                               dtype=np.int32)
        if (prompt_lens < 1).any():
            raise ValueError("a sequence's prompt_len must be at least 1")
    lora_slots = None
    if any(c.lora_slot >= 0 for c in chunks):
        lora_slots = np.repeat(np.array([c.lora_slot for c in chunks], dtype=np.int32), counts)
    return ForwardBatch(input_ids, positions, slot_mapping, query_start_loc, seq_lens, block_tables,
                        logits_indices, tuple(t for t, _ in extra), tuple(s for _, s in extra), tuple(layer_group),
                        prompt_lens, lora_slots)
