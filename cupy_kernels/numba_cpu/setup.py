"""numba, configured for pagedserve's kernels before any of them is compiled.

Compiled kernels are cached on disk (`cache=True`) under `<cache root>/numba/<digest of this folder's
sources>` (cache_dir.py, sources_digest), so only the first start on a machine compiles them (seconds); later
starts load machine code. numba keys each entry by the kernel's source file, its argument types and the CPU;
the digest adds the files it does not see (a kernel's intrinsics in another file), so an edited kernel or
another CPU model never loads a stale one. NUMBA_CACHE_DIR set by the user wins.

Import this module, not numba, in the numba_*.py kernel files.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from ..host.blas_threads import cpu_threads
from ..host.cache_dir import cache_root


def sources_digest(folder: Path | None = None) -> str:
    """A digest of the kernel sources in `folder` (default: this one). numba keys a cache entry by its own
    function's file alone, so a kernel whose intrinsics or helpers live in another file (numerics.py,
    vector_ir.py, gemm.py's tiles) would load its old machine code after only that file changed; under a folder
    per digest, an edit anywhere here compiles everything once again instead (~1 ms to read and hash ~140 KB)."""
    digest = hashlib.sha256()
    for path in sorted((folder or Path(__file__).parent).glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


os.environ.setdefault("NUMBA_CACHE_DIR", str(cache_root() / "numba" / sources_digest()))
# numba's parallel loops run on GNU OpenMP threads, which by default spin after each loop waiting for
# the next one. Between two kernels come numpy's matmuls, whose OpenBLAS threads then find their cores
# taken: on 2 cores every matmul after the first numba loop ran several times slower (bench/throughput.py,
# 16 requests: 12.2 s against 3.6 s with the numpy kernels). PASSIVE makes idle OpenMP threads sleep at
# once; waking them costs microseconds per kernel. Read by libgomp when numba first starts its threads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# ...but not quite at once: a decode step with few sequences runs ~120 short parallel matmuls over GGUF
# blocks (numba_quant.py), ~20 us each, and waking sleeping threads for each took longer than the work
# (one request: 12.9 ms per step against 6.8 ms). libgomp's GOMP_SPINCOUNT overrides the policy's spin
# count (0 for PASSIVE, 300,000 by default), counted in PAUSE instructions, whose length differs by CPU: ~33
# ns on the first test VM's Xeon (3,000 bridged a step's gaps there, 300 did not), 9.7 ns on the Intel VM of
# 2026-12-05, where 3,000 (~30 us) let the threads fall asleep in the gaps of a one-request step around its
# single-threaded attention and norms: one request 32 -> 128 11.0-11.6 ms a token at 3,000, 8.2-8.8 at
# 10,000 and 8.2-9.1 at 20,000; 64 requests 432.7, 432.7 -> 468.0, 458.7 tok/s; 256 requests and the numpy
# set (OpenBLAS) within their noise. 10,000 spins for ~0.1-0.4 ms after a parallel loop, then sleeps. A user's
# GOMP_SPINCOUNT wins.
os.environ.setdefault("GOMP_SPINCOUNT", "10000")

import numba  # noqa: E402  (after NUMBA_CACHE_DIR: numba reads its config at import)
from numba.core import cgutils, types  # noqa: E402
from numba.extending import intrinsic  # noqa: E402

if not numba.config.CACHE_DIR:  # numba was imported before us without a cache dir: point it there now
    numba.config.CACHE_DIR = os.environ["NUMBA_CACHE_DIR"]

# Options of the kernels. error_model="numpy": a division by zero gives inf/NaN as in numpy instead of a
# Python exception, and without that check per division the loops vectorise.
# JIT_EXACT (elementwise kernels): every operation rounded as written, so a value is the same whichever
# code a loop compiled to (vectorised or not, C-contiguous or strided input).
# JIT (kernels that reduce: norms, attention): fastmath lets LLVM reassociate and contract (FMA) float
# arithmetic so dot products and row sums vectorise; it keeps inf/NaN semantics (masked scores are -inf)
# and exact division. The order it picks is fixed at compile time for a given input layout, and these
# kernels only ever see C-contiguous inputs: a row's result depends only on that row, never on the batch.
JIT_EXACT = dict(cache=True, nogil=True, error_model="numpy")
# PAGEDSERVE_BATCH_INVARIANT=1 (as vLLM's VLLM_BATCH_INVARIANT): a row's result never depends on the batch
# it ran in, at some cost. numba_attention keeps every prefill chunk in its loop nest; numba_ops.linear
# keeps every matmul on the packed GEMM (numba_gemm.py), never the GGUF-block kernel for a few rows.
BATCH_INVARIANT = os.environ.get("PAGEDSERVE_BATCH_INVARIANT", "") not in ("", "0")
JIT = dict(JIT_EXACT, fastmath={"reassoc", "contract"})


# --- The code path numba compiles for -----------------------------------------------------------------------
# The kernels come in variants by vector width (numba_gemm.PANEL, numba_attention_ir.LANES, ...), chosen from
# what numba's own target machine emits, not from the CPU's name: NUMBA_CPU_NAME and NUMBA_CPU_FEATURES decide
# the code (NUMBA_CPU_NAME alone keeps the host's features, which numba passes along, so forcing older code
# takes NUMBA_CPU_FEATURES too: CI forces AVX2 and baseline this way, tests/code_paths.py).
CODE_PATHS = ("avx512", "avx2", "baseline")  # x86-64; another machine reports its own name (aarch64: untested)


def _probe_code_path() -> str:
    """"avx512" when a 16-float fused multiply-add compiles to zmm registers, "avx2" for ymm registers and
    vfmadd, "baseline" for anything less on x86-64 (SSE, and the FMA through a libm call); elsewhere the
    machine's name."""
    from llvmlite import binding, ir
    from numba.core.registry import cpu_target

    codegen = cpu_target.target_context.codegen()
    if not codegen._tm.triple.startswith("x86_64"):  # numba's target machine (not public)
        return codegen._tm.triple.split("-")[0]
    module = ir.Module("code_path_probe")
    vf = ir.VectorType(ir.FloatType(), 16)
    fn = ir.Function(module, ir.FunctionType(ir.VoidType(), [vf.as_pointer()]), "probe")
    fma = ir.Function(module, ir.FunctionType(vf, [vf, vf, vf]), "llvm.fma.v16f32")
    builder = ir.IRBuilder(fn.append_basic_block())
    a = builder.load(fn.args[0])
    builder.store(builder.call(fma, [a, a, a]), fn.args[0])
    builder.ret_void()
    asm = codegen._tm.emit_assembly(binding.parse_assembly(str(module)))
    if "zmm" in asm:
        return "avx512"
    return "avx2" if "ymm" in asm and "vfmadd" in asm else "baseline"


CODE_PATH = _probe_code_path()


def apply_threads(parallel: bool = True) -> int:
    """Set this thread's count for numba's parallel loops before a kernel call, and return it: `cpu_threads`
    (at most the pool numba started with; all of it when unset), or 1 for work too small to share. Each
    kernel is compiled once, parallel, and runs on one thread this way: a serial compilation could vectorise
    its loops differently and round differently, and results would then depend on the batch's size.
    numba's count is per calling thread (the engine steps in a worker thread). Reading it costs ~1.4 us,
    and a one-request decode step makes ~330 kernel calls: the count this function last set in this thread
    is remembered instead (numba.set_num_threads called elsewhere goes unseen until the count changes)."""
    want = 1
    if parallel:
        want = min(cpu_threads() or numba.config.NUMBA_NUM_THREADS, numba.config.NUMBA_NUM_THREADS)
    if getattr(_applied, "count", None) != want:
        numba.set_num_threads(want)
        _applied.count = want
    return want


_applied = threading.local()  # .count: what apply_threads last set in this thread


def compile_aside(*dispatchers: Any) -> subprocess.Popen | None:
    """With an empty cache, start a child process compiling the kernels of the modules of `dispatchers` (each
    module's warm_up()) into the on-disk cache, so that this process can compile others meanwhile on the other
    core; the caller waits for it (finish_aside) and then loads them from the cache. A module is left out when
    its dispatcher (one its warm_up compiles) already has a cache index. None when no module is left, or
    when the cache cannot be inspected."""
    modules = []
    for dispatcher in dispatchers:
        try:
            if os.path.exists(dispatcher._cache._cache_file._index_path):  # numba's cache layout (not public)
                continue
            modules.append(dispatcher.py_func.__module__)
        except AttributeError:
            return None
    if not modules or not os.path.basename(sys.executable or "").startswith("python"):  # embedded: no interpreter
        return None
    code = "; ".join(f"import {m} as m; m.warm_up()" for m in dict.fromkeys(modules))
    try:
        return subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE)
    except OSError:
        return None


def finish_aside(child: subprocess.Popen | None, timeout: float = 300.0) -> None:
    """Wait for compile_aside's child. Whatever became of it, the caller's warm_up() then loads the kernels
    from the cache or compiles them itself: a failed or hung child costs time, never correctness."""
    if child is None:
        return
    try:
        _, err = child.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        child.kill()
        child.communicate()
        return
    if child.returncode != 0:
        import structlog

        structlog.get_logger("pagedserve.engine").warning(
            "numba.compile_aside_failed", returncode=child.returncode, stderr=err.decode(errors="replace")[-2000:])


# --- Calling a compiled kernel by its address -------------------------------------------------------------
# A numba function that calls another links the callee's machine-independent module into its own and
# optimises and emits the whole again; a parallel kernel does so twice more (the prange body is a function of
# its own). For the paged attention loop nest that was ~7 of the ~13 s its parallel kernel took to compile.
# A kernel called through `call_compiled` is compiled (and cached) once, as its own function; the caller
# holds only an indirect call, whose address it gets at run time (never baked into cached machine code).

@intrinsic
def call_compiled(typingctx, address, args):
    """Call the numba-compiled function at `address` (numba's calling convention, returning None) with the
    values of the tuple `args`, whose types must be those it was compiled for (native_address); an exception
    it raises propagates to the caller."""
    if not isinstance(address, types.Integer) or not isinstance(args, types.BaseTuple):
        return None
    arg_types = tuple(args.types)

    def codegen(context, builder, signature, llargs):
        fnty = context.call_conv.get_function_type(types.none, arg_types)
        fn = builder.inttoptr(llargs[0], fnty.as_pointer())
        values = [builder.extract_value(llargs[1], i) for i in range(len(arg_types))]
        status, _ = context.call_conv.call_function(builder, fn, types.none, arg_types, values)
        with cgutils.if_unlikely(builder, status.is_error):
            context.call_conv.return_status_propagate(builder, status)
        return context.get_dummy_value()

    return types.none(address, args), codegen


def native_address(dispatcher: Any, args: tuple) -> int:
    """The address of `dispatcher`'s machine code for the types of `args` (compiled, or loaded from the
    cache, first), for call_compiled."""
    arg_types = tuple(numba.typeof(a) for a in args)
    dispatcher.compile(arg_types)
    result = dispatcher.overloads[arg_types]
    return result.library.get_pointer_to_function(result.fndesc.llvm_func_name)


# -- the host's caches (numba_gemm sizes its row blocks by the L2) ------------------------------------


def _size_bytes(text: str) -> int:
    """A sysfs cache size ("2048K", "1M", "512") in bytes."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip()
    return int(text[:-1]) * units[text[-1]] if text[-1:] in units else int(text)


def _cpu_count(cpu_list: str) -> int:
    """How many CPUs a sysfs CPU list ("0", "0-1", "0-3,8-11") names."""
    count = 0
    for part in cpu_list.strip().split(","):
        if part:
            first, _, last = part.partition("-")
            count += int(last or first) - int(first) + 1
    return count


def l2_bytes() -> int:
    """The L2 cache a core has to itself (Linux sysfs: cpu0's level-2 data or unified cache, divided among the
    CPUs that share it); 0 where it cannot be read."""
    import glob

    for index in sorted(glob.glob("/sys/devices/system/cpu/cpu0/cache/index*")):
        try:
            with open(f"{index}/level") as f:
                level = f.read().strip()
            with open(f"{index}/type") as f:
                kind = f.read().strip()
            if level != "2" or kind == "Instruction":
                continue
            with open(f"{index}/size") as f:
                size = _size_bytes(f.read())
            with open(f"{index}/shared_cpu_list") as f:
                sharing = _cpu_count(f.read())
        except (OSError, ValueError):
            return 0
        return size // max(1, sharing)
    return 0
