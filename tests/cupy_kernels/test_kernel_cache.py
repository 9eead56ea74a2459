"""The on-disk cache of compiled CUDA modules, with a fake compiler (no CUDA needed)."""

from __future__ import annotations

import hashlib
import json
import sys
import types

import pytest

from pagedserve.cupy_kernels.cuda import modules as cuda_modules, ops as cuda_ops, kernel_cache
from pagedserve.cupy_kernels.cuda.kernel_cache import CompiledModule, KernelCache


class FakeCompiler:
    def __init__(self):
        self.calls = []

    def __call__(self, source, options, arch, names):
        self.calls.append((source, options, arch, names))
        image = hashlib.sha256(f"{source}|{options}|{arch}".encode()).digest() * 4
        return CompiledModule(image, {n: f"_Z{len(n)}{n.replace('<', '_').replace('>', '_')}" for n in names})


def test_a_second_process_loads_from_disk_without_compiling(tmp_path):
    compiler = FakeCompiler()
    first = KernelCache(tmp_path, compiler, "nvrtc-13.0").get("src", ("-std=c++17",), "sm_90", ("k<1>", "k<2>"))
    assert len(compiler.calls) == 1
    # A new cache object over the same directory stands for the next process.
    again = KernelCache(tmp_path, compiler, "nvrtc-13.0")
    second = again.get("src", ("-std=c++17",), "sm_90", ("k<1>", "k<2>"))
    assert len(compiler.calls) == 1 and (again.hits, again.misses) == (1, 0)
    assert second == first
    assert sorted(p.suffix for p in tmp_path.iterdir()) == [".cubin", ".json"]


@pytest.mark.parametrize("change", ["source", "options", "arch", "compiler"])
def test_source_options_arch_and_compiler_are_all_in_the_key(tmp_path, change):
    compiler = FakeCompiler()
    base = dict(source="src", options=("-std=c++17",), arch="sm_90", version="nvrtc-13.0")
    KernelCache(tmp_path, compiler, base["version"]).get(base["source"], base["options"], base["arch"], ("k",))
    other = dict(base, **{"source": dict(source="src "), "options": dict(options=("-std=c++17", "-ftz=true")),
                          "arch": dict(arch="sm_80"), "compiler": dict(version="nvrtc-12.9")}[change])
    KernelCache(tmp_path, compiler, other["version"]).get(other["source"], other["options"], other["arch"], ("k",))
    assert len(compiler.calls) == 2


def test_a_corrupted_or_incomplete_entry_is_compiled_again(tmp_path):
    compiler = FakeCompiler()
    cache = KernelCache(tmp_path, compiler, "v")
    good = cache.get("src", (), "sm_90", ("k",))
    image_path, meta_path = cache.paths(kernel_cache.cache_key("src", (), "sm_90", "v"))
    image_path.write_bytes(good.image[:-1])  # a torn write
    assert cache.get("src", (), "sm_90", ("k",)) == good and len(compiler.calls) == 2
    assert image_path.read_bytes() == good.image  # repaired
    # An entry without a symbol this table now asks for (same key cannot happen, but be strict).
    meta = json.loads(meta_path.read_text())
    meta["lowered_names"] = {}
    meta_path.write_text(json.dumps(meta))
    cache.get("src", (), "sm_90", ("k",))
    assert len(compiler.calls) == 3


def test_an_unwritable_directory_costs_a_compile_not_an_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    compiler = FakeCompiler()
    cache = KernelCache(blocker / "kernels", compiler, "v")
    assert cache.get("src", (), "sm_90", ("k",)).lowered_names == {"k": "_Z1k"}
    cache.get("src", (), "sm_90", ("k",))
    assert len(compiler.calls) == 2


def test_the_cache_lives_under_pagedserves_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path))
    assert kernel_cache.default_cache_dir() == tmp_path / "kernels"
    monkeypatch.delenv("PAGEDSERVE_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert kernel_cache.default_cache_dir() == tmp_path / "xdg" / "pagedserve" / "kernels"


class FakeLoadedModule:
    loads = []

    def load(self, image):
        self.loads.append(image)

    def get_function(self, symbol):
        return ("function", symbol)


def _fake_cupy(raw_modules):
    cp = types.ModuleType("cupy")
    cp.cuda = types.SimpleNamespace(runtime=types.SimpleNamespace(getDevice=lambda: 0),
                                    function=types.SimpleNamespace(Module=FakeLoadedModule))
    cp.RawModule = lambda code, options, name_expressions: raw_modules.append(code) or types.SimpleNamespace(
        get_function=lambda name: ("raw", name))
    return cp


def test_cuda_ops_loads_its_modules_through_the_cache(monkeypatch, tmp_path):
    """Two 'processes' (fresh in-memory tables) compile the paged attention module once, with the options
    CuPy would use, and launch the lowered symbol of the name expression asked for."""
    raw = []
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy(raw))
    monkeypatch.setattr(kernel_cache, "device_arch", lambda: "sm_90")
    compiler = FakeCompiler()
    monkeypatch.setattr(cuda_modules, "_make_kernel_cache", lambda: KernelCache(tmp_path, compiler, "nvrtc-13.0"))
    monkeypatch.setenv("PAGEDSERVE_KERNEL_CACHE", "1")
    name = cuda_ops.attention_kernel_name(128, 16, 8)
    for _ in range(2):
        monkeypatch.setattr(cuda_modules, "_modules", {})
        monkeypatch.setattr(cuda_modules, "_functions", {})
        fn = cuda_ops._kernel("paged_attention", name)
        assert fn == ("function", f"_Z{len(name)}" + name.replace("<", "_").replace(">", "_"))
    assert len(compiler.calls) == 1 and not raw
    source, options, arch, names = compiler.calls[0]
    module = cuda_ops.MODULES[cuda_ops.attention_module_name("paged_attention", "f16", 128)]
    assert source == module.source()
    assert options == cuda_ops.NVRTC_OPTIONS + cuda_ops.CUPY_IMPLICIT_OPTIONS and arch == "sm_90"
    assert names == module.name_expressions and name in names
    assert all("256" not in n and "bf16" not in n for n in names)  # only what a float16 head-dim-128 model needs


def test_cuda_ops_falls_back_to_rawmodule_when_the_cache_fails_or_is_off(monkeypatch):
    raw = []
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy(raw))

    def broken():
        raise ImportError("no NVRTC bindings")

    monkeypatch.setattr(cuda_modules, "_make_kernel_cache", broken)
    for setting in ("1", "0"):
        monkeypatch.setenv("PAGEDSERVE_KERNEL_CACHE", setting)
        monkeypatch.setattr(cuda_modules, "_modules", {})
        monkeypatch.setattr(cuda_modules, "_functions", {})
        assert cuda_ops._kernel("sampling", "argmax_rows_kernel<float>") == ("raw", "argmax_rows_kernel<float>")
    assert raw == [cuda_ops.MODULES["sampling"].source()] * 2
