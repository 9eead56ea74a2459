"""The qkv projection with the rotary embedding and the KV cache writes in the GEMM's tiles (numba set):
q = rotate(x @ Wq.T) comes back, rotate(x @ Wk.T) and x @ Wv.T go straight to their cache slots. The same bits
as numba_gemm.matmul followed by cache_write.rotary_and_cache (tests/cupy_kernels/test_numba_gemm_rotary.py),
without the [T, (H + 2 KV) D] output written by the GEMM and read back by a second pass.

A head's rotate-half pairs dimension i with i + D/2, which lie in different panels of the packed weight (PANEL
output columns each): a tile here takes two panels at once, the one holding columns c .. c + PANEL - 1 of a head
and the one D/2 further, so that each pair of a rotation is in its registers: _PAIR_ROWS rows x 2 panels (6 x 64
columns on AVX-512: 24 accumulators; 2 x 32 on AVX2's 16 registers). Each output is still numba_gemm's one FMA
chain over k in order, and the rotation is cache_write's (each product and sum rounded, no FMA). Keys and
values are stored as whole lines by non-temporal stores (slots lie all over a pool far larger than the caches),
a slot of -1 (padding) is skipped.

In bench/throughput.py's 256-request run (SmolLM2, 2 threads, AVX-512), the separate pass cost ~200 us a layer
of a 256-token decode step and ~600 of a 2,048-token prefill step (docs/notes/kernels.md).
"""

from __future__ import annotations

import functools

import numpy as np
from llvmlite import ir
from numba.core import types
from numba.extending import intrinsic

from ..batch_checks import check_slot_mapping
from ..host.malloc import aligned_empty
from . import launch
from .gemm import _LANES, AVX512, PANEL, PackedWeight, products_ir, row_passes
from .numerics import store_fence
from .setup import JIT_EXACT, apply_threads, call_compiled, native_address, numba
from .vector_ir import rotate_half

_PAIR_ROWS = 6 if AVX512 else 2  # rows of a tile over two panels (4 accumulator vectors a row)
Q, K, V = 0, 1, 2  # what a pair of panels holds: query columns (rotated, to q), key (rotated, to its slot), value
_F32 = np.dtype(np.float32)


def _pair_tile(rows: int):
    """An intrinsic tile(a, a_at, lda, b, lo_at, hi_at, k, kind, t0, dst, dst_at, ldd, half, cs, sn, cs_at, cs_w,
    slots) over addresses (attention_ir.address) and float offsets: the products of A's rows t0 .. t0 + rows - 1
    (row r at a[a_at + r lda]) with the panels at b[lo_at:] and b[hi_at:] ([k, PANEL] each); for a Q or K pair
    rotated with cos/sin row t at cs[t cs_w + cs_at:] (lo' = lo c - hi s, hi' = hi c + lo s); then stored, the
    lo panel's columns at dst[row + dst_at], the hi panel's at dst[row + dst_at + half], where row is t ldd for
    Q, slots[t] ldd for K and V (non-temporal stores; slot -1: not stored)."""

    @intrinsic
    def tile(typingctx, a, a_at, lda, b, lo_at, hi_at, k, kind, t0, dst, dst_at, ldd, half, cs, sn, cs_at, cs_w,
             slots):
        args = (a, a_at, lda, b, lo_at, hi_at, k, kind, t0, dst, dst_at, ldd, half, cs, sn, cs_at, cs_w, slots)
        if not all(isinstance(v, types.Integer) for v in args):
            return None

        def codegen(context, builder, signature, llargs):
            v = [context.cast(builder, x, t, types.intp) for x, t in zip(llargs, signature.args)]
            (a_p, a_at, lda, b_p, lo_at, hi_at, k_v, kind, t0, dst_p, dst_at, ldd, half, cs_p, sn_p, cs_at, cs_w,
             slots_p) = v
            intp = a_at.type
            f32p = ir.FloatType().as_pointer()
            a_p, b_p, dst_p, cs_p, sn_p = (builder.inttoptr(p, f32p) for p in (a_p, b_p, dst_p, cs_p, sn_p))
            slots_p = builder.inttoptr(slots_p, ir.IntType(64).as_pointer())
            vf = ir.VectorType(ir.FloatType(), _LANES)

            def const(x):
                return ir.Constant(intp, x)

            def vec(ptr, offset):
                return builder.bitcast(builder.gep(ptr, [offset]), vf.as_pointer())

            halves = PANEL // _LANES  # vectors per panel row
            accs = products_ir(builder, a_p, a_at, lda, rows, b_p, [lo_at, hi_at], k_v)  # lo's vectors, then hi's
            nontemporal = builder.module.add_metadata([ir.Constant(ir.IntType(32), 1)])
            is_q, is_v = builder.icmp_signed("==", kind, const(Q)), builder.icmp_signed("==", kind, const(V))
            for r in range(rows):
                t = builder.add(t0, const(r))
                slot = builder.load(builder.gep(slots_p, [t]))
                row = builder.select(is_q, t, slot)
                with builder.if_then(builder.icmp_signed(">=", row, const(0))):
                    with builder.if_then(builder.not_(is_v)):  # rotate-half, as numerics.rotate
                        for h in range(halves):
                            at = builder.add(builder.add(builder.mul(t, cs_w), cs_at), const(h * _LANES))
                            c, s = (builder.load(vec(p, at), align=4) for p in (cs_p, sn_p))
                            y1, y2 = rotate_half(builder, builder.load(accs[r][h]), builder.load(accs[r][halves + h]),
                                                 c, s)
                            builder.store(y1, accs[r][h])
                            builder.store(y2, accs[r][halves + h])
                    lo = [builder.load(accs[r][h]) for h in range(halves)]
                    hi = [builder.load(accs[r][halves + h]) for h in range(halves)]
                    out = builder.add(builder.mul(row, ldd), dst_at)
                    with builder.if_else(is_q) as (query, cache):
                        for branch, streamed in ((query, False), (cache, True)):
                            with branch:
                                for h in range(halves):
                                    for value, at in ((lo[h], out), (hi[h], builder.add(out, half))):
                                        ptr = vec(dst_p, builder.add(at, const(h * _LANES)))
                                        store = builder.store(value, ptr, align=4 * _LANES if streamed else 4)
                                        if streamed:
                                            store.set_metadata("nontemporal", nontemporal)
            return context.get_dummy_value()

        return types.none(*args), codegen

    return tile


_TILE_BIG, _TILE2, _TILE1 = (_pair_tile(rows) for rows in (_PAIR_ROWS, 2, 1))


@numba.njit(**JIT_EXACT)
def _pair_rows(a, lda, t0, t1, b, lo_at, hi_at, k, kind, dst, dst_at, ldd, half, cs, sn, cs_at, cs_w, slots):
    """Rows t0 .. t1 - 1 of one pair of panels: tiles of _PAIR_ROWS rows, then of 2 and 1. Every argument
    an int64 (arrays as addresses): compiled once, serial, and called by address from _rotary_matmul's prange
    (numba_setup.call_compiled: inlined there, the tiles' code was optimised and emitted again with the parallel
    kernel's, ~1 s of a first start's compiles)."""
    t = t0
    while t + _PAIR_ROWS <= t1:
        _TILE_BIG(a, t * lda, lda, b, lo_at, hi_at, k, kind, t, dst, dst_at, ldd, half, cs, sn, cs_at, cs_w, slots)
        t += _PAIR_ROWS
    while t + 2 <= t1:
        _TILE2(a, t * lda, lda, b, lo_at, hi_at, k, kind, t, dst, dst_at, ldd, half, cs, sn, cs_at, cs_w, slots)
        t += 2
    if t < t1:
        _TILE1(a, t * lda, lda, b, lo_at, hi_at, k, kind, t, dst, dst_at, ldd, half, cs, sn, cs_at, cs_w, slots)


def _pair_item(item, words):
    """Item `item` of a row block: a pair of panels (in `order`) and its share of the block's rows (one of
    `parts`), by _pair_rows at its address. Run by launch.py's one prange (a prange of its own compiled in 0.7 s);
    `words` (_run_pairs): _pair_rows' address, x's address and columns, the panels', cos', sin's, the slots', q's
    and the caches' addresses, num_heads, num_kv_heads, head_dim, cos' columns, the block's rows m0 .. m1, parts,
    order."""
    pair_rows, a, k, b, cs, sn, sl, dq, dk, dv = (words[0], words[1], words[2], words[3], words[4], words[5],
                                                 words[6], words[7], words[8], words[9])
    num_heads, num_kv_heads, head_dim, cs_w, m0, m1, parts = (words[10], words[11], words[12], words[13], words[14],
                                                              words[15], words[16])
    order = launch.array1(words, 17, np.int64)
    half = head_dim // 2
    pairs_per_head = half // PANEL
    kv_row = num_kv_heads * head_dim
    pair, part = order[item // parts], item % parts
    r0 = m0 + ((m1 - m0) * part // parts) // 12 * 12
    r1 = m1 if part == parts - 1 else m0 + ((m1 - m0) * (part + 1) // parts) // 12 * 12
    head, within = pair // pairs_per_head, (pair % pairs_per_head) * PANEL
    col = head * head_dim + within  # the lo panel's first column in qkv
    kind, dst, dst_at, ldd = Q, dq, col, num_heads * head_dim
    if head >= num_heads + num_kv_heads:
        kind, dst, dst_at, ldd = V, dv, col - num_heads * head_dim - kv_row, kv_row
    elif head >= num_heads:
        kind, dst, dst_at, ldd = K, dk, col - num_heads * head_dim, kv_row
    call_compiled(pair_rows, (a, k, r0, r1, b, col * k, (col + half) * k, k, np.int64(kind), dst, dst_at, ldd, half,
                              cs, sn, np.int64(within), cs_w, sl))
    store_fence()  # the streamed rows, before any thread reads the cache


_PAIRS = numba.njit(**JIT_EXACT)(_pair_item)


def _run_pairs(x, panels, num_heads, num_kv_heads, head_dim, cos, sin, slots, q, k_cache, v_cache, passes, parts,
               order) -> None:
    """The kernel (matmul_rotary_cache checks, allocates and picks passes and parts): the rows in `passes` blocks
    (numba_gemm.row_passes), each block's pairs of panels shared out over the threads, a pair's rows in `parts`.
    Every array C-contiguous."""
    m = x.shape[0]
    n_pairs = (num_heads + 2 * num_kv_heads) * (head_dim // 2 // PANEL)
    words = launch.pack(_pair_rows_address(), x.ctypes.data, x.shape[1], panels.ctypes.data, cos.ctypes.data,
                        sin.ctypes.data, slots.ctypes.data, q.ctypes.data, k_cache.ctypes.data, v_cache.ctypes.data,
                        num_heads, num_kv_heads, head_dim, cos.shape[1], 0, 0, parts, order)
    address = launch.item_address(_PAIRS)
    for i in range(passes):
        m0 = (i * m // passes) // 12 * 12
        m1 = m if i == passes - 1 else ((i + 1) * m // passes) // 12 * 12
        if m1 > m0:
            words[14], words[15] = m0, m1
            launch.run_items(address, n_pairs * parts, words)


@functools.lru_cache(maxsize=None)
def _pair_order(num_heads: int, num_kv_heads: int, pairs_per_head: int) -> np.ndarray:
    """The order the prange takes the pairs in: the key and value pairs spread evenly among the query pairs
    (pair j of the 2 KV pph cache pairs at place (2j + 1) n / (4 KV pph) of n), so that a thread's contiguous
    share of them holds its share of the slot writes; in the order of the columns, all of them fell to the last
    thread."""
    nq, nc = num_heads * pairs_per_head, 2 * num_kv_heads * pairs_per_head
    n = nq + nc
    places = {(2 * j + 1) * n // (2 * nc): nq + j for j in range(nc)}
    queries = iter(range(nq))
    return np.array([places[i] if i in places else next(queries) for i in range(n)], dtype=np.int64)


@functools.lru_cache(maxsize=None)
def _pair_rows_address() -> int:
    """_pair_rows' machine code (compiled, or loaded from the cache, once a process)."""
    return native_address(_pair_rows, (np.int64(0),) * 18)


def fuses(x: np.ndarray, w, num_heads: int, num_kv_heads: int, cos, sin, k_cache, v_cache) -> bool:
    """Whether matmul_rotary_cache takes these: float32 throughout, a plain packed qkv weight of (H + 2 KV) D
    columns with D a multiple of two panels, caches C-contiguous on a cache line with rows of whole lines."""
    if not (isinstance(w, PackedWeight) and not w.gated and k_cache.ndim == 4 and k_cache.shape == v_cache.shape):
        return False
    head_dim = k_cache.shape[3]
    return (x.dtype == cos.dtype == sin.dtype == k_cache.dtype == v_cache.dtype == _F32 and x.ndim == 2
            and k_cache.shape[2] == num_kv_heads and num_heads >= 1 and head_dim % (2 * PANEL) == 0
            and w.out_features == (num_heads + 2 * num_kv_heads) * head_dim and x.shape[1] == w.in_features
            and k_cache.flags.c_contiguous and v_cache.flags.c_contiguous and k_cache.flags.writeable
            and v_cache.flags.writeable and k_cache.ctypes.data % 64 == 0 and v_cache.ctypes.data % 64 == 0
            and (num_kv_heads * head_dim) % 16 == 0)


def matmul_rotary_cache(x: np.ndarray, w: PackedWeight, num_heads: int, num_kv_heads: int, cos: np.ndarray,
                        sin: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, slot_mapping) -> np.ndarray:
    """rotary_and_cache(matmul(x, w), ...) in the GEMM's tiles: returns the rotated query [T, H, D]; the rotated
    key and the value go to their slots (-1: none). The same bits. Raises ValueError where `fuses` is False."""
    if not fuses(x, w, num_heads, num_kv_heads, cos, sin, k_cache, v_cache):
        raise ValueError(f"matmul_rotary_cache: x {x.dtype} {x.shape}, weight {getattr(w, 'shape', None)} for "
                         f"{num_heads} + 2 x {num_kv_heads} heads, caches {k_cache.shape} do not fit")
    t, head_dim = x.shape[0], k_cache.shape[3]
    if cos.shape != sin.shape or cos.ndim != 2 or cos.shape[0] < t or cos.shape[1] < head_dim // 2:
        raise ValueError(f"matmul_rotary_cache: cos {cos.shape} and sin {sin.shape} for {t} tokens of head_dim "
                         f"{head_dim}")
    slot_mapping = np.ascontiguousarray(slot_mapping, dtype=np.int64)
    if slot_mapping.shape != (t,):
        raise ValueError(f"matmul_rotary_cache: slot_mapping {slot_mapping.shape} for {t} tokens")
    check_slot_mapping(slot_mapping, k_cache.shape[0] * k_cache.shape[1], "matmul_rotary_cache")
    q = aligned_empty((t, num_heads, head_dim))
    if t:
        x = np.ascontiguousarray(x)
        threads = apply_threads(parallel=True)
        pairs = (num_heads + 2 * num_kv_heads) * head_dim // (2 * PANEL)
        parts = 2 if threads > 1 and pairs % threads and t >= 2 * 12 else 1  # an odd count of pairs: split rows
        _run_pairs(x, w.panels, num_heads, num_kv_heads, head_dim, np.ascontiguousarray(cos),
                   np.ascontiguousarray(sin), slot_mapping, q, k_cache, v_cache, row_passes(t, x.shape[1]), parts,
                   _pair_order(num_heads, num_kv_heads, head_dim // (2 * PANEL)))
    return q


def warm_up() -> None:
    """Compile the kernel for the types the model passes."""
    from .gemm import pack

    heads, kv, d = 2, 1, 2 * PANEL
    k_cache, v_cache = aligned_empty((2, 4, kv, d)), aligned_empty((2, 4, kv, d))  # on a line, as the pool
    cs = np.ones((3, d // 2), dtype=np.float32)
    matmul_rotary_cache(np.ones((3, 8), dtype=np.float32), pack(np.ones(((heads + 2 * kv) * d, 8), np.float32)),
                        heads, kv, cs, cs, k_cache, v_cache, np.array([0, 1, -1]))
