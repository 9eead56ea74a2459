"""Compiled CUDA modules cached on disk, keyed by source, options, architecture and compiler.

CuPy caches RawModule binaries on disk, except when `name_expressions` are given (it then compiles in
memory in every process; cupy/cuda/compiler.py), which is how cuda_ops asks for its template
instantiations. Without this cache every process recompiles every module: ~5 s of NVRTC for paged
attention alone, on each start of the sidecar and each test process.

    key   = sha256(format, source, options, arch, compiler version)
    files = <cache dir>/kernels/<key>.cubin   the binary NVRTC produced
            <key>.json    {name expression: lowered (mangled) name, ..., "sha256": of the cubin}

The cache directory is pagedserve's ($PAGEDSERVE_CACHE_DIR, else $XDG_CACHE_HOME/pagedserve, else
~/.cache/pagedserve; the rule of models/loading/weight_cache.py, repeated here because cupy_kernels imports
nothing above it). PAGEDSERVE_KERNEL_CACHE=0 turns it off. Entries are written to a temporary name
and renamed, so concurrent processes never read half a file; an entry whose binary does not match
its recorded hash is compiled again and overwritten.

The compiler is a function, so the logic here is tested with a fake one on machines without CUDA;
`nvrtc_compile` is the real one (CuPy's NVRTC bindings: the same compiler CuPy itself uses).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

CACHE_FORMAT = 1


@dataclass(frozen=True)
class CompiledModule:
    image: bytes  # cubin
    lowered_names: dict[str, str]  # name expression -> symbol in the image


# (source, options, arch, name_expressions) -> CompiledModule
Compiler = Callable[[str, tuple[str, ...], str, tuple[str, ...]], CompiledModule]


def default_cache_dir() -> Path:
    """$PAGEDSERVE_CACHE_DIR, else $XDG_CACHE_HOME/pagedserve, else ~/.cache/pagedserve; + /kernels."""
    if env := os.environ.get("PAGEDSERVE_CACHE_DIR"):
        return Path(env) / "kernels"
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "pagedserve" / "kernels"


def cache_enabled() -> bool:
    return os.environ.get("PAGEDSERVE_KERNEL_CACHE", "1") not in ("0", "false", "no", "off")


def cache_key(source: str, options: Sequence[str], arch: str, compiler_version: str) -> str:
    h = hashlib.sha256()
    for part in (f"v{CACHE_FORMAT}", source, "\0".join(options), arch, compiler_version):
        h.update(part.encode())
        h.update(b"\0\1\0")  # a separator no part contains, so ("ab", "c") != ("a", "bc")
    return h.hexdigest()


class KernelCache:
    """get() returns a module from disk, or compiles it (once) and stores it."""

    def __init__(self, directory: Path, compiler: Compiler, compiler_version: str) -> None:
        self.directory = Path(directory)
        self.compiler = compiler
        self.compiler_version = compiler_version
        self.hits = 0
        self.misses = 0

    def get(self, source: str, options: Sequence[str], arch: str, name_expressions: Sequence[str]) -> CompiledModule:
        options, names = tuple(options), tuple(name_expressions)
        key = cache_key(source, options, arch, self.compiler_version)
        found = self._read(key, names)
        if found is not None:
            self.hits += 1
            return found
        self.misses += 1
        compiled = self.compiler(source, options, arch, names)
        missing = [n for n in names if n not in compiled.lowered_names]
        if missing:
            raise RuntimeError(f"the compiler returned no symbol for {missing}")
        self._write(key, compiled)
        return compiled

    def paths(self, key: str) -> tuple[Path, Path]:
        return self.directory / f"{key}.cubin", self.directory / f"{key}.json"

    def _read(self, key: str, names: tuple[str, ...]) -> CompiledModule | None:
        image_path, meta_path = self.paths(key)
        try:
            meta = json.loads(meta_path.read_text())
            image = image_path.read_bytes()
        except (OSError, ValueError):
            return None
        lowered = meta.get("lowered_names") if isinstance(meta, dict) else None
        if (meta.get("sha256") != hashlib.sha256(image).hexdigest() or not isinstance(lowered, dict)
                or any(n not in lowered for n in names)):
            return None  # torn, corrupted or from another table: compile again
        return CompiledModule(image, {str(k): str(v) for k, v in lowered.items()})

    def _write(self, key: str, compiled: CompiledModule) -> None:
        image_path, meta_path = self.paths(key)
        meta = {"sha256": hashlib.sha256(compiled.image).hexdigest(), "lowered_names": compiled.lowered_names}
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            # The binary first: a reader that finds the metadata also finds the binary it describes.
            _atomic_write(image_path, compiled.image)
            _atomic_write(meta_path, json.dumps(meta, indent=1).encode())
        except OSError:
            pass  # a read-only or full disk costs a recompile next time, nothing else


def _atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


# ---------------------------------------------------------------------------------------------
# The real compiler: NVRTC through CuPy's bindings
# ---------------------------------------------------------------------------------------------


def nvrtc_version() -> str:
    from cupy_backends.cuda.libs import nvrtc

    return "nvrtc-" + ".".join(str(v) for v in nvrtc.getVersion())


def device_arch() -> str:
    """sm_XY of the current device (NVRTC then emits a cubin for exactly that architecture)."""
    import cupy

    return f"sm_{cupy.cuda.Device().compute_capability}"


def nvrtc_compile(source: str, options: tuple[str, ...], arch: str, names: tuple[str, ...]) -> CompiledModule:
    from cupy_backends.cuda.libs import nvrtc

    prog = nvrtc.createProgram(source, "pagedserve.cu", (), ())
    try:
        for name in names:
            nvrtc.addNameExpression(prog, name)
        try:
            nvrtc.compileProgram(prog, list(options) + [f"-arch={arch}"])
        except nvrtc.NVRTCError as e:
            raise RuntimeError(f"NVRTC failed ({arch}): {e}\n{nvrtc.getProgramLog(prog)}") from e
        image = nvrtc.getCUBIN(prog)
        lowered = {name: nvrtc.getLoweredName(prog, name) for name in names}
    finally:
        nvrtc.destroyProgram(prog)
    return CompiledModule(bytes(image), lowered)
