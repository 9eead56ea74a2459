"""One parallel loop, compiled once, for every kernel that runs its work items on numba's threads.

numba compiles each `prange` as a parallel function of its own, with the marshalling of every variable the
loop body uses: around a serial kernel called by address with a dozen array arguments that took 0.5-1.1 s of
a first start's compiles, once per kernel (a count and one int64 array: 0.22 s; docs/benchmarks.md, cold
start). Here an item function takes `(item, words)`: `words`, an int64 array, holds its arrays as (address,
*shape) and its scalars as integers (a float as its float64 bits), in the order the caller packed them; the
item rebuilds its arrays (`array1` .. `array4`, `float_at`) and runs. `_LAUNCH` runs items 0 .. count-1 over
the threads apply_threads set, in one prange, taken in the schedule the caller set (numba.parallel_chunksize).

Two ways in: `run_items(address, count, pack(*parts))` packs in Python (~1 us an array: ctypes), for kernels
called a few times a step; `run_parts(address, count, parts)` packs in compiled code (`words_for`, `pack_into`;
one small serial function compiled per tuple of part types, ~0.1 s) and costs what a call of a prange kernel
did, for the per-layer kernels (GEMM, GGUF blocks, norms). An item that does real work calls its kernel by
address rather than inlining it: inlined into arrays rebuilt from words, LLVM made the GGUF-block loop 3-7%
slower.

Arrays travel as bare addresses: the caller holds them, C-contiguous (pack raises otherwise; pack_into does
not type other layouts), for the call. An item function is called by address, so it is compiled (and cached)
once for (int64, int64[::1]).
"""

from __future__ import annotations

import functools
import struct
from typing import Any

import numpy as np
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic
from numba.np.arrayobj import populate_array

from .setup import JIT_EXACT, call_compiled, native_address, numba

_WORDS = np.zeros(1, dtype=np.int64)  # the words' type: int64, 1-D, C-contiguous, writable


def _launch(address, count, words):
    for i in numba.prange(count):
        call_compiled(address, (np.int64(i), words))


_LAUNCH = numba.njit(parallel=True, **JIT_EXACT)(_launch)


def run_items(address: int, count: int, words: np.ndarray) -> None:
    """Items 0 .. count-1 of the item function at `address` (item_address), on numba's threads."""
    _LAUNCH(np.int64(address), np.int64(count), words)


@functools.lru_cache(maxsize=None)
def item_address(dispatcher: Any) -> int:
    """The machine code of an item function (dispatcher of f(item, words)), compiled or loaded once a process."""
    return native_address(dispatcher, (np.int64(0), _WORDS))


def pack(*parts: Any) -> np.ndarray:
    """The words of `parts`: an array as its address and shape (C-contiguous only), a float as its float64
    bits, an integer (or bool) as itself. (~1 us an array: its ctypes address is most of it.)"""
    words: list = []
    for p in parts:
        if type(p) is np.ndarray:
            if not p.flags.c_contiguous:
                raise ValueError(f"launch.pack: an array of shape {p.shape} is not C-contiguous")
            words.append(p.ctypes.data)
            words += p.shape
        elif isinstance(p, (float, np.floating)):
            words.append(float_word(float(p)))
        else:
            words.append(p)
    return np.array(words, dtype=np.int64)


_F64, _I64 = struct.Struct("d"), struct.Struct("q")


def float_word(value: float) -> int:
    """A float's word (its float64 bits), as pack makes it."""
    return _I64.unpack(_F64.pack(value))[0]


def _word(builder, words, at, k):
    """LLVM: words[at + k] (words: the int64 array's data pointer; at: an integer of any width)."""
    if at.type.width < 64:
        at = builder.sext(at, words.type.pointee)
    return builder.load(builder.gep(words, [builder.add(at, ir.Constant(at.type, k))]))


def _array_intrinsic(ndim: int):
    """An intrinsic f(words, at, dtype) -> the C-contiguous `ndim`-D array of `dtype` packed at words[at:] (its
    address, then its shape), without numba's IR inlining (which cost ~40 ms of compile per call site)."""

    @intrinsic
    def array_at(typingctx, words, at, dtype):
        if not (isinstance(words, types.Array) and words.dtype == types.int64 and words.ndim == 1
                and isinstance(at, types.Integer) and isinstance(dtype, types.NumberClass)):
            return None
        array_t = types.Array(dtype.dtype, ndim, "C")

        def codegen(context, builder, signature, args):
            data = context.make_array(signature.args[0])(context, builder, args[0]).data
            intp = context.get_value_type(types.intp)
            shape = [_word(builder, data, args[1], 1 + i) for i in range(ndim)]
            itemsize = context.get_abi_sizeof(context.get_data_type(dtype.dtype))
            strides, step = [], ir.Constant(intp, itemsize)
            for extent in reversed(shape):
                strides.insert(0, step)
                step = builder.mul(step, extent)
            out = context.make_array(array_t)(context, builder)
            pointer = builder.inttoptr(_word(builder, data, args[1], 0), out.data.type)
            populate_array(out, data=pointer, shape=cgutils.pack_array(builder, shape),
                           strides=cgutils.pack_array(builder, strides), itemsize=ir.Constant(intp, itemsize),
                           meminfo=None)
            return out._getvalue()

        return array_t(words, at, dtype), codegen

    return array_at


array1, array2, array3, array4 = (_array_intrinsic(n) for n in (1, 2, 3, 4))


@intrinsic
def float_at(typingctx, words, at):
    """The float packed at words[at] (as float64)."""
    if not (isinstance(words, types.Array) and words.dtype == types.int64 and isinstance(at, types.Integer)):
        return None

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        return builder.bitcast(_word(builder, data, args[1], 0), ir.DoubleType())

    return types.float64(words, at), codegen


def _part_words(t) -> int | None:
    """How many words pack_into writes for a value of numba type t (None: a type it does not pack)."""
    if isinstance(t, types.Array):
        return 1 + t.ndim if t.layout == "C" else None
    if isinstance(t, (types.Integer, types.Boolean, types.Float)):
        return 1
    return None


def _packs(parts) -> bool:
    return isinstance(parts, types.BaseTuple) and all(_part_words(t) is not None for t in parts.types)


@intrinsic
def words_for(typingctx, parts):
    """Inside numba: how many words pack_into writes for the tuple `parts` (a constant of its type)."""
    if not _packs(parts):
        return None
    count = sum(_part_words(t) for t in parts.types)

    def codegen(context, builder, signature, args):
        return ir.Constant(ir.IntType(64), count)

    return types.int64(parts), codegen


@intrinsic
def pack_into(typingctx, words, parts):
    """Inside numba: words[:words_for(parts)] = the values of the tuple `parts`, as pack makes them (C-contiguous
    arrays as address and shape, floats as float64 bits, integers and booleans as themselves)."""
    if not (isinstance(words, types.Array) and words.dtype == types.int64 and words.layout == "C" and _packs(parts)):
        return None

    def codegen(context, builder, signature, args):
        i64 = ir.IntType(64)
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        at = 0
        for k, t in enumerate(parts.types):
            v = builder.extract_value(args[1], k)
            if isinstance(t, types.Array):
                arr = context.make_array(t)(context, builder, v)
                values = [builder.ptrtoint(arr.data, i64)] + cgutils.unpack_tuple(builder, arr.shape, t.ndim)
            elif isinstance(t, types.Float):
                values = [builder.bitcast(context.cast(builder, v, t, types.float64), i64)]
            else:
                values = [context.cast(builder, v, t, types.int64)]
            for value in values:
                builder.store(value, builder.gep(data, [ir.Constant(i64, at)]))
                at += 1
        return context.get_dummy_value()

    return types.none(words, parts), codegen


def _run_parts(launch, item, count, serial, parts):
    words = np.empty(words_for(parts), dtype=np.int64)
    pack_into(words, parts)
    if serial:
        for i in range(count):
            call_compiled(item, (np.int64(i), words))
    else:
        call_compiled(launch, (item, count, words))


_RUN_PARTS = numba.njit(**JIT_EXACT)(_run_parts)


@functools.lru_cache(maxsize=None)
def launch_address() -> int:
    """The machine code of the shared prange (_LAUNCH), compiled or loaded once a process."""
    return native_address(_LAUNCH, (np.int64(0), np.int64(0), _WORDS))


def run_parts(item: int, count: int, parts: tuple, serial: bool = False) -> None:
    """run_items(item, count, pack(*parts)), the packing done in compiled code (no ctypes: ~1 us an array less);
    compiled once for each tuple of part types. serial: the items one after the other on this thread, without
    the prange, so numba's thread count is neither read nor set (a one-row norm: 0.7 us against 1.8 through
    the prange on one thread, and ~1.4 us more each time the count changes between a step's kernels)."""
    _RUN_PARTS(launch_address(), item, count, serial, parts)
