"""Every CUDA kernel compiles with nvcc for sm_80 and sm_90, warnings as errors, no GPU needed.

The sources, template instantiations (NVRTC name expressions) and #defines come from the table in
cuda_ops.MODULES, the same one cuda_ops hands to cupy.RawModule; only the instantiation lines are
added, written the way NVRTC instantiates a name expression (taking the kernel's address). Compiling
to cubin (not only PTX) runs ptxas too, which reports register spills and shared-memory overflows.
Skipped only when nvcc is absent.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from pagedserve.cupy_kernels.cuda import modules as mods, ops as cuda_ops

ARCHS = ("sm_80", "sm_90")
# Static shared memory a CTA may use (more can only be dynamic, opted in: paged attention at head dim 256).
STATIC_SMEM_LIMIT = 48 * 1024
# The smallest shared memory a CTA may opt in to on the sm_80+ devices the kernels run on (sm_86 and sm_89; sm_80
# allows 166,912 bytes, sm_90 232,448).
OPTIN_SMEM_LIMIT = 101376
# The attention kernel is capped at 128 registers (__launch_bounds__(128, 4)); its largest tile
# (BLOCK_M = 32, only for > 16 query heads per kv head) spills 12-28 bytes under that cap at head dims
# 128 and 256 (CUDA 13.0), a few words reloaded once per key tile. A real register shortage spills far more.
MAX_SPILL_BYTES = 32


def _nvcc() -> str | None:
    found = shutil.which("nvcc")
    if found:
        return found
    for candidate in ("/usr/local/bin/nvcc", "/usr/local/cuda/bin/nvcc"):
        if os.access(candidate, os.X_OK):
            return candidate
    return None


NVCC = _nvcc()
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(NVCC is None, reason="nvcc not found (install the CUDA toolkit to compile-check)")]


def compile_source(module: cuda_ops.KernelModule) -> str:
    """The module's source plus one line per name expression that makes nvcc instantiate it."""
    lines = [module.source(), ""]
    for i, expr in enumerate(module.name_expressions):
        lines.append(f"auto pagedserve_instance_{i} = &{expr};")
    return "\n".join(lines) + "\n"


def _compile(module: cuda_ops.KernelModule, arch: str, workdir: Path) -> tuple[str, str, int, str]:
    src = workdir / f"{module.name}_{arch}.cu"
    src.write_text(compile_source(module))
    cmd = [NVCC, f"-arch={arch}", "-cubin", "-o", str(workdir / f"{module.name}_{arch}.cubin"),
           *cuda_ops.NVRTC_OPTIONS, *cuda_ops.CUPY_IMPLICIT_OPTIONS,
           "-Werror", "all-warnings", "-Xptxas", "--warning-as-error",
           "--resource-usage", str(src)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    return module.name, arch, proc.returncode, proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> dict[tuple[str, str], tuple[int, str]]:
    workdir = tmp_path_factory.mktemp("nvcc")
    jobs = [(m, a) for m in cuda_ops.MODULES.values() for a in ARCHS]
    with ThreadPoolExecutor(max_workers=max(2, min(8, os.cpu_count() or 2))) as pool:
        results = list(pool.map(lambda job: _compile(job[0], job[1], workdir), jobs))
    return {(name, arch): (rc, log) for name, arch, rc, log in results}


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("module", sorted(cuda_ops.MODULES))
def test_module_compiles_without_warnings(compiled, module, arch):
    rc, log = compiled[(module, arch)]
    assert rc == 0, f"nvcc failed for {module} ({arch}):\n{log}"
    assert "warning" not in log.lower(), f"nvcc warned for {module} ({arch}):\n{log}"


@pytest.mark.parametrize("arch", ARCHS)
def test_no_real_spills_and_static_shared_memory_fits(compiled, arch):
    for module in cuda_ops.MODULES:
        rc, log = compiled[(module, arch)]
        assert rc == 0
        for spill in re.findall(r"(\d+) bytes spill stores", log):
            assert int(spill) <= MAX_SPILL_BYTES, f"{module} ({arch}) spills {spill} bytes:\n{log}"
        for smem in re.findall(r"(\d+) bytes smem", log):
            assert int(smem) <= STATIC_SMEM_LIMIT, f"{module} ({arch}) uses {smem} bytes of shared memory"


def _paged_attention_smem(log: str) -> dict[tuple[int, int], int]:
    """(head dim, BLOCK_M) -> the static shared memory ptxas reports for paged_attention_kernel (one storage type)."""
    found, entry = {}, None
    for line in log.splitlines():
        m = re.search(r"Compiling entry function '_Z22paged_attention_kernelILi(\d+)ELi\d+ELi(\d+)E", line)
        if "Compiling entry function" in line:
            entry = (int(m.group(1)), int(m.group(2))) if m else None
        elif entry and "Used" in line:
            smem = re.search(r"(\d+) bytes smem", line)
            found[entry] = int(smem.group(1)) if smem else 0
    return found


@pytest.mark.parametrize("arch", ARCHS)
def test_paged_attention_shared_memory_is_what_the_host_launches(compiled, arch):
    """Static shared memory: attention_static_shared_bytes (the per-row arrays); with the dynamic part the host
    launches (attention_shared_bytes) within what every sm_80+ device lets a CTA opt in to, and the instantiations
    past 48 KB are those the loader opts in (KernelModule.large_shared)."""
    found, large = {}, set()
    for module in mods.FAMILIES["paged_attention"]:  # one module per (storage type, head dim)
        rc, log = compiled[(module, arch)]
        assert rc == 0
        found.update(_paged_attention_smem(log))
        large |= {name for name, _ in mods.MODULES[module].large_shared}
    assert {d for d, _ in found} == set(mods.ATTN_HEAD_DIMS) and {m for _, m in found} == set(mods.ATTN_BLOCK_MS)
    for (dim, block_m), static in found.items():
        assert static == mods.attention_static_shared_bytes(block_m), (dim, block_m, static)
        total = static + mods.attention_shared_bytes(dim, block_m)
        assert total <= OPTIN_SMEM_LIMIT, (dim, block_m, total)
        names = {mods.attention_kernel_name(dim, bs, block_m, t) for bs in mods.ATTN_BLOCK_SIZES
                 for t in mods.ATTN_TYPES}
        assert (names <= large) == (total > STATIC_SMEM_LIMIT) and (names & large in (set(), names)), (dim, block_m)


# ---------------------------------------------------------------------------------------------
# Registers, shared memory and occupancy against the launches (issue 59: what only a device showed until now)
# ---------------------------------------------------------------------------------------------

REGS_PER_SM = 65536
THREADS_PER_SM = 2048
SMEM_PER_SM = {"sm_80": 167936, "sm_90": 233472}  # the shared memory an SM gives its CTAs (164 KB / 228 KB)
PAGED_MIN_BLOCKS = 4  # PS_ATTN_MIN_BLOCKS in paged_attention.cu


def _launch_of(name: str) -> tuple[int, int, int]:
    """(threads a launch uses at most, CTAs per SM __launch_bounds__ promises, dynamic shared bytes) of one entry,
    by its demangled name (the launches in cupy_kernels/cuda/ops.py and attention.py)."""
    base = name.split("<")[0].split("(")[0]
    args = [a.strip() for a in name[name.index("<") + 1:name.index(">")].split(",")] if "<" in name else []
    if base == "paged_attention_kernel":
        dim, block_m = int(args[0]), int(args[2])
        return mods.ATTN_THREADS, PAGED_MIN_BLOCKS, mods.attention_shared_bytes(dim, block_m)
    if base == "paged_attention_reduce_kernel":
        return int(args[0]), 1, 0
    if base == "prefill_attention_kernel":
        return mods.PREFILL_THREADS, 3 if int(args[0]) <= 64 else 1, 0
    if base == "sample_rows_kernel":
        return cuda_ops.SAMPLE_THREADS, 1, 0
    if base in ("argmax_rows_kernel", "add_rms_norm_kernel"):
        return 1024, 1, 0
    return 256, 1, 0  # rotary, silu_and_mul, reshape_and_cache, copy_blocks: at most 256 threads


def ptxas_entries(log: str) -> dict[str, dict]:
    """{demangled entry: {"registers", "spill_stores", "spill_loads", "smem"}} from nvcc --resource-usage."""
    entries, current = {}, None
    for line in log.splitlines():
        m = re.search(r"Compiling entry function '(\w+)'", line)
        if m:
            current = m.group(1)
            entries[current] = {"registers": 0, "spill_stores": 0, "spill_loads": 0, "smem": 0}
            continue
        if current is None:
            continue
        if (m := re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)):
            entries[current]["spill_stores"], entries[current]["spill_loads"] = int(m.group(1)), int(m.group(2))
        if (m := re.search(r"Used (\d+) registers", line)):
            entries[current]["registers"] = int(m.group(1))
            smem = re.search(r"(\d+) bytes smem", line)
            entries[current]["smem"] = int(smem.group(1)) if smem else 0
    if entries and shutil.which("c++filt"):
        names = subprocess.run(["c++filt"], input="\n".join(entries), capture_output=True, text=True).stdout.split("\n")
        entries = {demangled.removeprefix("void "): v for demangled, v in zip(names, entries.values())}
    return entries


def resource_problems(log: str, arch: str) -> list[str]:
    """What the device would refuse or run slowly: a launch of more threads than the registers allow, fewer CTAs per
    SM than __launch_bounds__ promises (registers or shared memory), a CTA's shared memory past the SM's, spills in
    a hot kernel (every entry but paged attention's BLOCK_M 32 tile, MAX_SPILL_BYTES)."""
    problems = []
    for name, e in ptxas_entries(log).items():
        if name.startswith("_Z"):
            problems.append(f"{name}: not demangled (c++filt missing?)")
            continue
        threads, min_blocks, dynamic = _launch_of(name)
        regs = -(-max(e["registers"], 1) // 8) * 8  # allocated per thread in units of 8
        by_regs = REGS_PER_SM // (regs * threads)
        smem = e["smem"] + dynamic
        by_smem = SMEM_PER_SM[arch] // smem if smem else THREADS_PER_SM
        blocks = min(by_regs, by_smem, THREADS_PER_SM // threads)
        if by_regs < 1:
            problems.append(f"{name}: {e['registers']} registers x {threads} threads pass the SM's {REGS_PER_SM}")
        elif by_regs < min_blocks:
            problems.append(f"{name}: {e['registers']} registers leave {by_regs} CTAs of {threads} threads per SM, "
                            f"__launch_bounds__ promises {min_blocks}")
        if smem > SMEM_PER_SM[arch]:
            problems.append(f"{name}: {smem} bytes of shared memory a CTA, the SM has {SMEM_PER_SM[arch]}")
        elif name.startswith("paged_attention_kernel<") and int(name.split("<")[1].split(",")[0]) <= 128 \
                and blocks < min_blocks:
            problems.append(f"{name}: {blocks} CTAs per SM ({smem} bytes of shared memory each), the decode path "
                            f"wants {min_blocks}")
        hot = not (name.startswith("paged_attention_kernel<") and name.split(",")[2].strip() == "32")
        spill = e["spill_stores"] + e["spill_loads"]
        if (hot and spill) or spill > 2 * MAX_SPILL_BYTES:
            problems.append(f"{name}: spills {e['spill_stores']} bytes (stores) / {e['spill_loads']} (loads)")
    return problems


@pytest.mark.parametrize("arch", ARCHS)
def test_registers_shared_memory_and_occupancy_fit_the_launches(compiled, arch):
    """ptxas's figures for every entry against its launch: __launch_bounds__' CTAs per SM reachable by registers,
    shared memory per CTA within the SM's, the decode path's paged attention (head dim <= 128) at its 4 CTAs per SM,
    no spills in the hot kernels."""
    found = 0
    for module in cuda_ops.MODULES:
        rc, log = compiled[(module, arch)]
        assert rc == 0
        found += len(ptxas_entries(log))
        assert resource_problems(log, arch) == [], module
    assert found == sum(len(m.name_expressions) for m in cuda_ops.MODULES.values())


def test_the_resource_check_catches_spills_registers_and_shared_memory():
    """The checker's mutation test, on ptxas lines as nvcc prints them: a hot kernel that spills, a paged attention
    tile past its launch bound's registers, a CTA past the SM's shared memory - each is named."""
    def entry(mangled: str, regs: int, spill: int, smem: int) -> str:
        return (f"ptxas info    : Compiling entry function '{mangled}' for 'sm_90'\n"
                f"ptxas info    : Function properties for {mangled}\n"
                f"    0 bytes stack frame, {spill} bytes spill stores, {spill} bytes spill loads\n"
                f"ptxas info    : Used {regs} registers, used 1 barriers, {smem} bytes smem, 400 bytes cmem[0]\n")
    paged = "_Z22paged_attention_kernelILi128ELi16ELi8E3f16EvPT2_PfS3_PKS1_xxS5_S5_PKiS7_S7_xiiiiifiiii"
    norm = "_Z19add_rms_norm_kernelI3f16EvPT_S2_PKS1_xS4_xS4_ifi"
    good = entry(paged, 128, 0, 160) + entry(norm, 32, 0, 68) + entry("copy_blocks_kernel", 30, 0, 0)
    assert resource_problems(good, "sm_90") == []
    assert any("spills" in p for p in resource_problems(entry(paged, 128, 8, 160), "sm_90"))
    assert any("__launch_bounds__ promises 4" in p for p in resource_problems(entry(paged, 168, 0, 160), "sm_90"))
    assert any("pass the SM" in p for p in resource_problems(entry(norm, 72, 0, 68), "sm_90"))
    assert any("shared memory a CTA" in p for p in resource_problems(entry(norm, 32, 0, 240000), "sm_90"))


def test_every_cu_file_is_compiled():
    files = {p.name for p in cuda_ops.KERNEL_DIR.glob("*.cu")}
    used = {m.source_file for m in cuda_ops.MODULES.values()} | set(cuda_ops.SHARED_SOURCES)
    assert files == used, f"kernel files not in cuda_ops.MODULES: {sorted(files - used)}"


def test_every_instantiation_is_compiled(compiled):
    """Each name expression shows up as a compiled entry function in ptxas' report."""
    for module in cuda_ops.MODULES.values():
        rc, log = compiled[(module.name, "sm_90")]
        assert rc == 0
        entries = re.findall(r"Compiling entry function '(\w+)'", log)
        assert len(set(entries)) == len(module.name_expressions), (module.name, entries)


# ---------------------------------------------------------------------------------------------
# NVRTC itself: what CuPy compiles with (no host compiler, no implicit cuda_runtime.h)
# ---------------------------------------------------------------------------------------------


def _find_libnvrtc() -> str | None:
    """libnvrtc from $PAGEDSERVE_LIBNVRTC, the nvidia-cuda-nvrtc wheel, a CUDA toolkit, or the loader path."""
    import ctypes.util
    import glob
    import importlib.util

    candidates = [os.environ.get("PAGEDSERVE_LIBNVRTC", "")]
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        candidates += sorted(glob.glob(os.path.join(root, "*", "lib", "libnvrtc.so*")))
    for home in (os.environ.get("CUDA_PATH"), os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if home:
            candidates += sorted(glob.glob(os.path.join(home, "lib64", "libnvrtc.so*")))
    found = ctypes.util.find_library("nvrtc")
    if found:
        candidates.append(found)
    for c in candidates:
        if c and "builtins" not in c and "alt" not in os.path.basename(c) and (os.path.isfile(c) or "/" not in c):
            return c
    return None


LIBNVRTC = _find_libnvrtc()


@pytest.mark.skipif(LIBNVRTC is None, reason="libnvrtc not found (set PAGEDSERVE_LIBNVRTC to check with NVRTC)")
@pytest.mark.parametrize("arch", ARCHS)
def test_modules_compile_with_nvrtc(arch):
    """The exact RawModule inputs (source, options + CuPy's -ftz=true, name expressions) through NVRTC."""
    import ctypes
    import glob

    for builtins in sorted(glob.glob(os.path.join(os.path.dirname(LIBNVRTC), "libnvrtc-builtins.so*"))):
        if "alt" not in os.path.basename(builtins):
            ctypes.CDLL(builtins, mode=ctypes.RTLD_GLOBAL)  # NVRTC dlopens it by name
    lib = ctypes.CDLL(LIBNVRTC)
    for module in cuda_ops.MODULES.values():
        prog = ctypes.c_void_p()
        assert lib.nvrtcCreateProgram(ctypes.byref(prog), module.source().encode(), f"{module.name}.cu".encode(),
                                      0, None, None) == 0
        try:
            for expr in module.name_expressions:
                assert lib.nvrtcAddNameExpression(prog, expr.encode()) == 0
            opts = [o.encode() for o in (*cuda_ops.NVRTC_OPTIONS, *cuda_ops.CUPY_IMPLICIT_OPTIONS, f"-arch={arch}")]
            rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
            size = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetProgramLog(prog, log)
            text = log.value.decode(errors="replace")
            assert rc == 0, f"NVRTC failed for {module.name} ({arch}):\n{text}"
            assert "warning" not in text.lower(), f"NVRTC warned for {module.name} ({arch}):\n{text}"
            for expr in module.name_expressions:
                lowered = ctypes.c_char_p()
                assert lib.nvrtcGetLoweredName(prog, expr.encode(), ctypes.byref(lowered)) == 0 and lowered.value, expr
        finally:
            lib.nvrtcDestroyProgram(ctypes.byref(prog))
