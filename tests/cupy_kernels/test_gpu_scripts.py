"""scripts/gpu_check.sh and the GPU benchmarks, checked on a machine without a GPU."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


@pytest.mark.skipif(shutil.which("bash") is None, reason="bash not found")
def test_gpu_check_script_parses():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True, timeout=30)


@pytest.mark.skipif(shutil.which("bash") is None, reason="bash not found")
@pytest.mark.skipif(importlib.util.find_spec("cupy") is not None, reason="CuPy is installed: the script would run")
def test_gpu_check_exits_2_with_the_reason_without_cupy(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path)}
    proc = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "no usable GPU" in proc.stderr and "cupy" in proc.stderr.lower()
    assert not (tmp_path / "gpu_results.json").exists()


@pytest.mark.parametrize("bench", ["gpu_attention.py", "gpu_decode.py", "gpu_sampler.py"])
def test_gpu_benchmarks_import_without_cupy(bench):
    """--help runs before CuPy is imported: the import chain needs only numpy and pagedserve."""
    code = ("import runpy, sys\n"
            f"sys.argv = ['{bench}', '--help']\n"
            "sys.modules['tokenizers'] = sys.modules['safetensors'] = sys.modules['gguf'] = None\n"
            "sys.modules['grpc'] = sys.modules['structlog'] = sys.modules['jinja2'] = None\n"
            f"runpy.run_path({str(ROOT / 'bench' / bench)!r}, run_name='__main__')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "usage" in proc.stdout


def _script_copy(tmp_path: Path) -> Path:
    """The script in an empty tree (its ROOT): no .gpu_check folder there."""
    (tmp_path / "scripts").mkdir()
    copy = tmp_path / "scripts" / "gpu_check.sh"
    shutil.copy(SCRIPT, copy)
    return copy


@pytest.mark.skipif(shutil.which("bash") is None, reason="bash not found")
def test_unknown_arguments_and_an_unprepared_dry_run_exit_5(tmp_path):
    proc = subprocess.run(["bash", str(SCRIPT), "--bogus"], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 5 and "unknown argument --bogus" in proc.stderr
    proc = subprocess.run(["bash", str(_script_copy(tmp_path)), "--dry-run"], capture_output=True, text=True,
                          timeout=30)
    assert proc.returncode == 5 and "run scripts/gpu_check.sh --prepare first" in proc.stderr


FAKE_CUPY = '''
"""A stand-in CuPy for the script's preflight: numpy arrays, one device for the first process only
(the marker file), so the preflight passes and every later process - the GPU tests - sees none."""
import os, numpy as np
MARKER = os.environ["FAKE_CUPY_MARKER"]
__version__ = "14.2.0-fake"
float16, float32 = np.float16, np.float32

class _A(np.ndarray):
    def get(self):
        return np.asarray(self)

def arange(n, dtype=None): return np.arange(n, dtype=dtype).view(_A)
def asarray(a, dtype=None): return np.asarray(a, dtype=dtype).view(_A)

class RawKernel:
    def __init__(self, code, name):
        if os.environ.get("FAKE_NVRTC_BROKEN"):
            raise RuntimeError("libnvrtc.so.13: cannot open shared object file")
    def __call__(self, grid, block, args):
        x = args[0]
        x *= 2

class _Runtime:
    @staticmethod
    def getDeviceCount():
        if os.path.exists(MARKER):
            return 0
        open(MARKER, "w").close()
        return 1
    getDeviceProperties = staticmethod(lambda i: {"name": b"Fake H200"})
    runtimeGetVersion = staticmethod(lambda: 13000)
    driverGetVersion = staticmethod(lambda: 13000)

class _Device:
    compute_capability = "90"

class cuda:
    runtime = _Runtime
    Device = _Device

class random:
    @staticmethod
    def rand(n, dtype=None):
        return np.random.default_rng(0).random(n).astype(dtype).view(_A)
'''

FAKE_NVRTC = "def getVersion():\n    return (13, 0)\n"


def _fake_cupy_env(tmp_path: Path, **extra) -> dict:
    site = tmp_path / "site"
    (site / "cupy_backends" / "cuda" / "libs").mkdir(parents=True)
    (site / "cupy.py").write_text(FAKE_CUPY)
    for d in ("cupy_backends", "cupy_backends/cuda", "cupy_backends/cuda/libs"):
        (site / d / "__init__.py").write_text("")
    (site / "cupy_backends" / "cuda" / "libs" / "nvrtc.py").write_text(FAKE_NVRTC)
    return {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path / "out"), "PYTHONPATH": str(site),
            "FAKE_CUPY_MARKER": str(tmp_path / "marker"), **extra}


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("bash") is None, reason="bash not found")
@pytest.mark.skipif(importlib.util.find_spec("cupy") is not None, reason="a real CuPy is installed")
def test_gpu_tests_that_skip_on_the_gpu_machine_fail_the_run(tmp_path):
    proc = subprocess.run(["bash", str(SCRIPT)], env=_fake_cupy_env(tmp_path), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "GPU tests SKIPPED" in proc.stderr
    result = json.loads((tmp_path / "out" / "gpu_results.json").read_text())
    assert result["preflight"]["nvrtc"].startswith("ok") and result["preflight"]["cublas"] == "ok"
    assert result["tests"]["skipped"] > 0 and result["tests"]["skipped_tests"]


@pytest.mark.skipif(shutil.which("bash") is None, reason="bash not found")
@pytest.mark.skipif(importlib.util.find_spec("cupy") is not None, reason="a real CuPy is installed")
def test_a_cuda_library_that_does_not_load_fails_the_preflight(tmp_path):
    env = _fake_cupy_env(tmp_path, FAKE_NVRTC_BROKEN="1")
    proc = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 4, proc.stderr[-3000:]
    assert "CUDA libraries did not all load" in proc.stderr and "libnvrtc" in proc.stderr
    result = json.loads((tmp_path / "out" / "gpu_results.json").read_text())
    assert result["nvrtc"].startswith("FAILED") and result["curand"] == "ok"
