"""The checks of a flat batch's metadata, in one place for everything that trusts it.

A flat (varlen) batch of B sequences and T query tokens is described by

    query_start_loc [B + 1]  sequence i's query tokens are rows query_start_loc[i] .. query_start_loc[i + 1] - 1
    seq_lens [B]             its context, the new tokens included
    block_tables [B, W]      the KV blocks of its context, in order (columns past what it needs: padding)
    slot_mapping [T]         the cache slot each new token's K and V go to; negative: no write

The kernels read the KV pool through these without bounds checks (a block id out of range is a wild read on
the CPU, an illegal address that kills the CUDA context on the GPU), so they are checked on the host first:

    models/device_batch.check_batch    a step's ForwardBatch, once, before its upload
    cuda/attention.paged_attention     host metadata handed to the CUDA op (device metadata is trusted)
    numba_cpu/attention_plan           the numba plan: the shapes here, the values in its compiled pass
                                       (_scan: one call instead of a dozen numpy ones), whose failure codes
                                       are turned into errors here (scan_error)
    reshape_and_cache, rotary_and_cache   slot_mapping (check_slot_mapping), in both kernel sets

Each error names its caller (`where`) and the field.
"""

from __future__ import annotations

import numpy as np


def check_sequence_count(query_start_loc: np.ndarray, seq_lens: np.ndarray, block_tables: np.ndarray,
                         where: str) -> int:
    """query_start_loc [B + 1], seq_lens [B] and block_tables [B, W] of integers; returns B."""
    num_seqs = seq_lens.shape[0] if seq_lens.ndim == 1 else -1
    if query_start_loc.shape != (num_seqs + 1,) or block_tables.ndim != 2 or block_tables.shape[0] != num_seqs:
        raise ValueError(f"{where}: query_start_loc {query_start_loc.shape}, seq_lens {seq_lens.shape} and "
                         f"block_tables {block_tables.shape} disagree on the number of sequences")
    if block_tables.dtype.kind not in "iu":
        raise ValueError(f"{where}: block_tables must hold integers, not {block_tables.dtype}")
    return num_seqs


def check_metadata(query_start_loc, seq_lens, block_tables, num_tokens: int, block_size: int, num_blocks: int,
                   where: str) -> int:
    """Check a batch's attention metadata against T = num_tokens and a pool of num_blocks blocks of block_size
    tokens: every sequence has at least one query token and no more than its context, its table covers its
    context, and every block it reads is in the pool (ValueError; IndexError for a block id). Returns the
    longest context (0 without sequences)."""
    qsl = np.asarray(query_start_loc, dtype=np.int64)
    lens = np.asarray(seq_lens, dtype=np.int64)
    tables = np.asarray(block_tables)
    b = check_sequence_count(qsl, lens, tables, where)
    if qsl[0] != 0 or qsl[-1] != num_tokens:
        raise ValueError(f"{where}: query_start_loc must be [{b + 1}] from 0 to {num_tokens}, got {qsl.tolist()}")
    if b == 0:
        return 0
    num_new = np.diff(qsl)
    if (num_new < 1).any():
        raise ValueError(f"{where}: every sequence needs at least one query token")
    if (lens < num_new).any():
        raise ValueError(f"{where}: a sequence has more query tokens than its seq_len")
    needed = -(-lens // block_size)
    if int(needed.max()) > tables.shape[1]:
        raise ValueError(f"{where}: a sequence of {int(lens.max())} tokens needs {int(needed.max())} blocks, "
                         f"block_tables has {tables.shape[1]} columns")
    used = tables[np.arange(tables.shape[1])[None, :] < needed[:, None]]  # the blocks the kernels read
    if used.size and (int(used.min()) < 0 or int(used.max()) >= num_blocks):
        raise IndexError(f"{where}: block_tables holds a block id outside [0, {num_blocks})")
    return int(lens.max())


def check_slot_mapping(slot_mapping: np.ndarray, num_slots: int, where: str, only_minus_one: bool = False) -> None:
    """Every slot below num_slots (IndexError). A negative slot writes nothing: the kernels skip any; a
    ForwardBatch (only_minus_one) marks it with -1 alone."""
    if not slot_mapping.size:
        return
    top = int(slot_mapping[0] if slot_mapping.size == 1 else slot_mapping.max())  # (one slot: ~1 us less)
    bad = top if top >= num_slots else None
    if bad is None and only_minus_one and int(slot_mapping.min()) < -1:
        bad = int(slot_mapping.min())
    if bad is not None:
        raise IndexError(f"{where}: slot_mapping holds a slot outside [-1, {num_slots}): slot {bad} is outside a "
                         f"cache of {num_slots} slots")


# The failure codes of numba_cpu/attention_plan._scan, the compiled pass over the same metadata.
SCAN_QUERY_START_LOC, SCAN_CONTEXT, SCAN_BLOCK_ID = 1, 2, 3


def scan_error(code: int, num_blocks: int, where: str) -> Exception | None:
    """The error for a failure code of the compiled pass (None for 0: the metadata passed)."""
    if code == SCAN_QUERY_START_LOC:
        return ValueError(f"{where}: query_start_loc must rise from 0 to the number of query tokens")
    if code == SCAN_CONTEXT:
        return ValueError(f"{where}: a sequence's context is shorter than its new tokens or longer than its block "
                          "table")
    if code == SCAN_BLOCK_ID:
        return IndexError(f"{where}: block_tables holds a block id outside [0, {num_blocks})")
    return None
