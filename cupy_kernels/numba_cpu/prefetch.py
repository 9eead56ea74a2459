"""Memory hints for the numba kernels: the cache-line prefetch, and the order the attention loop nest
(attention.py) asks for a block's lines in.

A decode step reads every sequence's whole context from a pool far larger than the caches, in 16-token blocks
that lie anywhere in it, so the loop nest asks for the block one ahead in its reads while it computes on the
current one.

A core has about 16 misses to memory in flight of its own (its line fill buffers): with hints alone, a
256-sequence decode step read its KV at ~17 GB/s on the 2-core test VM, whose cores stream 32 GB/s. The L2's
stream prefetcher adds misses of its own, but follows one stream per 4 KB page: so a block of whole pages is
asked for as its pages' lines interleaved (line_order), every page's stream under way at once, and the first
line of each page of a block's V is asked for as its K is read, a segment ahead of the V pass (attention.py).
Measured on that VM (30 layers' own page-aligned pools, 2 threads, 192-token contexts): 256 sequences 145-149
-> 115 ms a step, 64 sequences 42-45 -> 31-32 ms; in the engine (bench/throughput.py --breakdown) attention
18.3 / 17.6 -> 15.8 / 15.2 s at 256 requests, 5.0 -> 4.35 s at 64.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba.core import types
from numba.extending import intrinsic

from .attention_ir import RUN
from .setup import JIT, numba
from .vector_ir import prefetch_ir

PAGE_BYTES = 4096  # the unit the L2 stream prefetcher follows


@intrinsic
def prefetch(typingctx, address, index):
    """Ask the CPU to start loading the cache line of float32 element `index` of the array at `address`
    (attention_ir.address; a hint: never faults, changes no value). The hardware prefetcher follows a
    stream within a block, but blocks lie anywhere in the pool; fetching the next block while this one is
    computed doubled the decode rate on pools larger than the L3 cache."""
    if not (isinstance(address, types.Integer) and isinstance(index, types.Integer)):
        return None

    def codegen(context, builder, signature, args):
        at = [context.cast(builder, v, t, types.intp) for v, t in zip(args, signature.args)]
        data = builder.inttoptr(at[0], ir.FloatType().as_pointer())
        prefetch_ir(builder, builder.gep(data, [at[1]]))
        return context.get_dummy_value()
    return types.none(address, index), codegen


@numba.njit(inline="always", **JIT)
def prefetch_part(cache_address, block, row, row_floats, block_size, part, part_floats, order):
    """Prefetch part `part` (part_floats floats, a multiple of 16) of the run of token rows row .. row + RUN - 1
    of `block` (each row: all kv heads, row_floats contiguous floats): as many hints, one per 64-byte line, as
    the run has lines; the block's runs together ask for each of its lines once. The hints are spread over the
    run's work, one part per query head's share of it: issued as one burst per run, the same hints were twice
    as slow, probably because a burst fills the core's queue of outstanding misses and the hints behind it are
    dropped. Hint i asks for the block's line at float offset order[i] (line_order)."""
    first = row * row_floats // 16  # the run's first hint
    end = first + min(RUN, block_size - row) * row_floats // 16
    base = block * block_size * row_floats
    for i in range(first + part * part_floats // 16, min(first + (part + 1) * part_floats // 16, end)):
        prefetch(cache_address, base + order[i])


def line_order(block_floats):
    """(order, page_floats): the order prefetch_part asks for a block's 64-byte lines in, as float offsets, and
    the floats per stream. A block of whole 4 KB pages (a pool from models.kv_cache.host_zeros starts on a page)
    is taken as its pages' lines interleaved, line k of every page before line k + 1 of any: each page's lines
    in order, all of its pages at once. Other blocks: one stream, in order. (A table: an integer division per
    hint cost what the streams gained.)"""
    lines = block_floats // 16
    streams = block_floats * 4 // PAGE_BYTES if block_floats * 4 % PAGE_BYTES == 0 else 1
    per = lines // streams
    order = np.empty(lines, dtype=np.int64)
    for i in range(lines):
        order[i] = ((i % streams) * per + i // streams) * 16
    return order, per * 16


line_order = numba.njit(inline="always", **JIT)(line_order)
