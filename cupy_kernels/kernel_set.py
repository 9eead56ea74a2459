"""The op table: one set of kernels per backend, chosen once when the backend is made.

    numpy   the reference (ops.py, paged_attention.py): plain numpy, runs everywhere
    numba   CPU kernels compiled from Python (numba_ops.py, numba_attention.py); matmuls on weights packed
            at load (numba_gemm.py) or, for a few rows, on a GGUF file's blocks (numba_quant.py)
    cuda    CuPy + the .cu kernels (cuda_ops.py)

models/ calls `backend.ops.linear(...)` and never asks what kind of array it holds. Every entry has the
signature of its numpy reference, and every non-reference entry is tested against that reference.

The CUDA table refuses host arrays: a numpy activation reaching a GPU op is a bug upstream (a forgotten
upload), and running it silently on the CPU would hide it. Host *metadata* (slot_mapping, block tables,
...) stays allowed there: cuda_ops checks and uploads it.
"""

from __future__ import annotations

import functools
import importlib.util
import threading
from dataclasses import dataclass, field, fields, replace
from typing import Any, Callable

from .reference import lora as reference_lora, ops, paged_attention

CPU_KERNEL_SETS = ("auto", "numba", "numpy")


def _op(device_arg: int | None = None) -> Any:
    """A KernelSet field: one op. device_arg: the argument the CUDA set refuses as a host array (the data; host
    metadata stays allowed there); None for an op with no such argument."""
    return field(metadata={"device_arg": device_arg})


@dataclass(frozen=True)
class KernelSet:
    """One callable per op, in the order of a forward pass; each op is declared here once (OP_NAMES and the CUDA
    set's host-array check are read from these fields)."""

    name: str  # "numpy", "numba" or "cuda"
    embedding: Callable[..., Any] = _op(0)
    linear: Callable[..., Any] = _op(0)
    pack_weight: Callable[..., Any] = _op()
    rms_norm: Callable[..., Any] = _op(0)
    add_rms_norm: Callable[..., Any] = _op(0)
    rope_cos_sin: Callable[..., Any] = _op(1)
    apply_rotary: Callable[..., Any] = _op(0)
    silu_and_mul: Callable[..., Any] = _op(0)
    linear_silu_and_mul: Callable[..., Any] = _op(0)  # silu_and_mul(linear(...)) on a gated gate_up weight
    reshape_and_cache: Callable[..., Any] = _op(0)
    rotary_and_cache: Callable[..., Any] = _op(0)  # apply_rotary on q and k + reshape_and_cache: one call a layer
    copy_blocks: Callable[..., Any] = _op(0)
    plan_attention: Callable[..., Any] = _op()  # a step's metadata checked once for every layer's paged_attention
    paged_attention: Callable[..., Any] = _op(0)
    logsumexp_rows: Callable[..., Any] = _op(0)  # the sampler's (runtime/sample/sampler.py)
    # What one FLOP of paged attention costs in time against one FLOP of the weight matmuls with this set
    # (cost-aware chunking weighs a chunk's keys by it: runtime/core/scheduler.py). 1.0: by FLOPs alone.
    attention_cost: float = 1.0
    # np.argmax(logits, axis=1) for the sampler's greedy rows, where this set has a faster one (numba: the rows
    # over the threads, in vector lanes); None: the sampler's array module's argmax.
    argmax_rows: Callable[..., Any] | None = None
    # residual += linear(x, weight_t) in place, where this set adds in its GEMM's tiles (numba: no [T, hidden]
    # output written and read back by add_rms_norm); None: the model adds in add_rms_norm (ops.linear_add is the
    # reference).
    linear_add: Callable[..., Any] | None = None
    # rotary_and_cache(linear(x, qkv_weight), ...) where this set rotates and writes the cache in its GEMM's tiles
    # (numba: no [T, (H + 2 KV) D] output written and read back); None: the model calls linear, then
    # rotary_and_cache (paged_attention.linear_rotary_cache is the reference).
    linear_rotary_cache: Callable[..., Any] | None = None
    # Batched LoRA (reference/lora.py: Punica's shrink and expand over per-row adapter slots); None: this set
    # serves no adapters (enable_lora refuses it).
    lora_shrink: Callable[..., Any] | None = None
    lora_expand: Callable[..., Any] | None = None
    # The kv_cache_dtypes (cupy_kernels/kv_layout.py) this set's cache writes and attention read and write; the
    # first is what "auto" means for its backend. Any other is refused at start (kv_layout.check_kv_cache_dtype).
    kv_cache_dtypes: tuple[str, ...] = ("float32",)


# The CPU sets store every kv_cache_dtype: the numpy reference (reference/kv_convert.py) and the numba set, which
# reads 16-bit caches in its attention loop nest (numba_cpu/attention16.py) and 8-bit ones, each row's scale
# included (attention8.py), converting in registers, and rounds as it writes them (cache_write16.py,
# cache_write8.py); a long prefill's attention over them takes the reference.
CPU_KV_CACHE_DTYPES = ("float32", "bfloat16", "float16", "int8", "fp8_e4m3", "fp8_e5m2")
NUMPY_KV_CACHE_DTYPES = CPU_KV_CACHE_DTYPES
# The CUDA set's: the backend's float16, and bfloat16 pools (uint16 arrays) that its cache write and attention read
# from the caches' dtype (kv_types.cuh, converted in registers). Its kernels also read and write fp8 rows with their
# scales (cuda/attention.py, ops.py: kv_cache_dtype), but an engine's fp8 pool is not wired (CuPy has no fp8 dtype:
# the pool would be uint8 and the model would pass the dtype to the ops), so an engine refuses fp8 at start.
CUDA_KV_CACHE_DTYPES = ("float16", "bfloat16")
# The op names every kernel set provides, in the order of a forward pass.
OP_NAMES = tuple(f.name for f in fields(KernelSet) if "device_arg" in f.metadata)  # the _op fields
# numba's attention runs at ~0.44x its matmuls' FLOP rate deep in a prompt (SmolLM2, 2 threads, AVX-512: 88
# against 200 GFLOP/s at 1,000-3,600 keys; docs/benchmarks.md "jitter").
NUMBA_ATTENTION_COST = 2.3
# Which argument must be a device array for each CUDA op (the data, not the host metadata).
_DEVICE_ARG = {f.name: f.metadata["device_arg"] for f in fields(KernelSet)
               if f.metadata.get("device_arg") is not None}


def _from_modules(name: str, *modules: Any, attention_cost: float = 1.0, argmax_rows: Any = None,
                  linear_add: Any = None, linear_rotary_cache: Any = None,
                  kv_cache_dtypes: tuple[str, ...] = CPU_KV_CACHE_DTYPES) -> KernelSet:
    """Each op from the first module that defines it."""
    def pick(op: str) -> Callable[..., Any]:
        for m in modules:
            fn = getattr(m, op, None)
            if fn is not None:
                return fn
        raise AssertionError(f"kernel set {name}: no module defines {op}")

    return KernelSet(name, **{op: pick(op) for op in OP_NAMES}, attention_cost=attention_cost, argmax_rows=argmax_rows,
                     linear_add=linear_add, linear_rotary_cache=linear_rotary_cache, kv_cache_dtypes=kv_cache_dtypes)


@functools.lru_cache(maxsize=None)
def numpy_kernels() -> KernelSet:
    return replace(_from_modules("numpy", ops, paged_attention, kv_cache_dtypes=NUMPY_KV_CACHE_DTYPES),
                   lora_shrink=reference_lora.lora_shrink, lora_expand=reference_lora.lora_expand)


_finish_lock = threading.Lock()
_compile_child: list = []  # the child compiling the attention and rotary-GEMM kernels, while it runs
_compile_thread: list = []  # the thread compiling the other kernels, while it runs
_finished = threading.Event()


class _CompileThread(threading.Thread):
    """Runs `target` once; join() re-raises what it raised (a compile error is the caller's, as before). Not a
    daemon: a process that fails before it waits for the kernels (a bad model path) exits after the compile,
    never with LLVM torn down under it."""

    def __init__(self, target: Callable[[], None]) -> None:
        super().__init__(name="pagedserve-numba-warm-up", daemon=False)
        self._work, self._error = target, None

    def run(self) -> None:
        try:
            self._work()
        except BaseException as e:  # noqa: BLE001  (handed to the joining thread)
            self._error = e

    def join(self, timeout: float | None = None) -> None:
        super().join(timeout)
        if self._error is not None:
            error, self._error = self._error, None
            raise error


@functools.lru_cache(maxsize=None)
def _numba_started() -> KernelSet:
    """The first half of numba_kernels(): the compiles started, none waited for. The attention and rotary-GEMM
    kernels go to a child process when the cache is empty (numba_setup.compile_aside), the GEMM, GGUF-block,
    elementwise and long-prefill ones to a thread of this process, so that the caller loads the model meanwhile:
    numba holds the GIL for its typing passes but not in LLVM (ctypes calls), ~half of a compile, and a model's
    load is numpy and file reads. The set is whole, but none of its kernels is ready until
    finish_numba_warm_up()."""
    # Imports (and configures) numba: only when asked for. Every kernel module is imported here, before the
    # thread starts, so that no import in one thread waits on numba's compiler lock held by the other.
    from .numba_cpu import (attention as numba_attention, gemm as numba_gemm, gemm_rotary as numba_gemm_rotary,
                            ops as numba_ops, prefill as numba_prefill, quant as numba_quant)
    from .numba_cpu.setup import compile_aside

    # The child first (a process to start). Since the GEMM, GGUF-block and elementwise kernels run as launch.py
    # items (no prange of their own to compile), the thread's share is the smaller one unless it takes the
    # prefill kernels too. With empty caches (2026-12-06, the Zen 4 VM, three starts each): the prefill kernels
    # here, the child ends 1.0-1.3 s before the thread and the engine is ready at 6.9-7.7 s; in the child, it
    # ended 2 s after the thread; the GGUF-block kernels moved to the child as well, 0.7-1.1 s after (6.5-7.2 s).
    child = compile_aside(numba_attention._ATTENTION, numba_gemm_rotary._PAIRS)
    _compile_child.append(child)

    def compile_first_half() -> None:
        numba_gemm.warm_up()
        numba_quant.warm_up()
        numba_ops.warm_up()
        numba_prefill.warm_up()

    thread = _CompileThread(compile_first_half)
    thread.start()
    _compile_thread.append(thread)
    kernels = _from_modules("numba", numba_ops, numba_attention, ops, paged_attention,
                            attention_cost=NUMBA_ATTENTION_COST, argmax_rows=numba_ops.argmax_rows,
                            linear_add=numba_ops.linear_add, linear_rotary_cache=numba_ops.linear_rotary_cache)
    from .numba_cpu import lora as numba_lora  # compiled at its first call (an engine with enable_lora warms it)

    return replace(kernels, lora_shrink=numba_lora.lora_shrink, lora_expand=numba_lora.lora_expand)


def finish_numba_warm_up() -> None:
    """The second half: wait for the compile thread and child, then load (or compile) the attention and
    long-prefill kernels, so that no request pays for a compile. Idempotent. A caller with work that needs no
    kernel (the worker: loading the model and packing its weights) does it between the halves, while the
    compiles run: with empty caches the load then uses the core the compiles leave idle."""
    from .numba_cpu import attention as numba_attention, gemm_rotary as numba_gemm_rotary, prefill as numba_prefill
    from .numba_cpu.setup import finish_aside

    if _finished.is_set():
        return
    _numba_started()
    with _finish_lock:
        if _finished.is_set():
            return
        while _compile_thread:  # a compile error is raised here, to the caller that waits for the kernels
            _compile_thread.pop().join()
        while _compile_child:  # one child, or (first halves raced in two threads) one each
            finish_aside(_compile_child.pop())
        numba_prefill.warm_up()
        numba_attention.warm_up()
        numba_gemm_rotary.warm_up()
        _finished.set()


@functools.lru_cache(maxsize=None)
def numba_kernels() -> KernelSet:
    """The numba kernels where there is one, the numpy reference elsewhere (embedding, rope_cos_sin); every
    kernel compiled now (or loaded from the on-disk cache), never during a request."""
    kernels = _numba_started()
    finish_numba_warm_up()
    return kernels


def _device_only(fn: Callable[..., Any], arg: int, op: str) -> Callable[..., Any]:
    from .cuda.ops import is_cupy_array

    @functools.wraps(fn)
    def checked(*args: Any, **kwargs: Any) -> Any:
        a = args[arg]
        if op == "copy_blocks":  # a list of (k, v) layers; an empty list has nothing to copy
            a = a[0][0] if a else None
            if a is None:
                return fn(*args, **kwargs)
        if not is_cupy_array(a):
            raise TypeError(f"{op}: the CUDA backend got a host array ({type(a).__module__}."
                            f"{type(a).__name__}); upload it first (backend.asarray)")
        return fn(*args, **kwargs)

    return checked


@functools.lru_cache(maxsize=None)
def cuda_kernels() -> KernelSet:
    from .cuda import lora as cuda_lora, ops as cuda_ops

    return KernelSet("cuda", **{op: getattr(cuda_ops, op) if op not in _DEVICE_ARG
                                else _device_only(getattr(cuda_ops, op), _DEVICE_ARG[op], op) for op in OP_NAMES},
                     lora_shrink=cuda_lora.lora_shrink, lora_expand=cuda_lora.lora_expand,
                     kv_cache_dtypes=CUDA_KV_CACHE_DTYPES)


def cpu_kernels(choice: str = "auto", finish_warm_up: bool = True) -> KernelSet:
    """The CPU kernel set: "numba" (compiled) or "numpy" (the reference); "auto" is numba when it imports.
    `finish_warm_up=False`: the numba set's attention kernels may still be compiling (finish_numba_warm_up).

    numba is the faster set on the 2-core test host: 400 against 335 output tok/s at 256 requests
    (docs/benchmarks.md; the history: docs/notes/kernels.md).
    """
    if choice not in CPU_KERNEL_SETS:
        raise ValueError(f"cpu_kernels must be one of {CPU_KERNEL_SETS}, got {choice!r}")
    if choice == "numpy":
        return numpy_kernels()
    if importlib.util.find_spec("numba") is None:
        if choice == "auto":
            return numpy_kernels()
        raise ValueError("cpu_kernels='numba' was asked for, but numba is not installed")
    if choice == "auto" and numba_code_path() == "baseline":
        import structlog

        # Correct there (CI runs the kernel tests on forced baseline code), but every vector FMA becomes a
        # libm call: numpy's OpenBLAS is faster. cpu_kernels="numba" still takes the set.
        structlog.get_logger("pagedserve.engine").warning(
            "kernel_set.numba_refused", code_path="baseline", using="numpy",
            reason="numba compiles for baseline x86-64 here (no AVX2 and FMA; NUMBA_CPU_NAME/NUMBA_CPU_FEATURES "
                   "or the CPU): its kernels would run their fused multiply-adds as libm calls")
        return numpy_kernels()
    return numba_kernels() if finish_warm_up else _numba_started()


def numba_code_path() -> str | None:
    """The code path numba compiles for here: "avx512", "avx2" or "baseline" on x86-64 (numba_setup.CODE_PATH;
    imports numba, ~0.3 s the first time); None without numba."""
    if importlib.util.find_spec("numba") is None:
        return None
    from .numba_cpu.setup import CODE_PATH

    return CODE_PATH
