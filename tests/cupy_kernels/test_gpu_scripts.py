"""scripts/gpu_check.sh and the GPU benchmarks, checked on a machine without a GPU."""

from __future__ import annotations

import importlib.util
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


@pytest.mark.parametrize("bench", ["gpu_attention.py", "gpu_decode.py"])
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
