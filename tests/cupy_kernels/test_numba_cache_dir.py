"""The numba cache sits under a folder named by a digest of the kernel sources: numba keys an entry by its own
function's file alone, so an edit of a file holding another kernel's intrinsics must not load stale code."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("numba")

from pagedserve.cupy_kernels.numba_cpu import setup  # noqa: E402

KERNELS = Path(setup.__file__).parent


def test_the_digest_changes_with_any_kernel_file_and_only_with_them(tmp_path):
    for path in KERNELS.glob("*.py"):
        shutil.copy(path, tmp_path / path.name)
    (tmp_path / "notes.txt").write_text("not a source")
    assert setup.sources_digest(tmp_path) == setup.sources_digest()
    helpers = tmp_path / "vector_ir.py"  # intrinsics other files' kernels inline
    helpers.write_text(helpers.read_text() + "\n# edited\n")
    assert setup.sources_digest(tmp_path) != setup.sources_digest()


def test_the_default_cache_dir_is_the_digests_folder_and_a_users_wins(tmp_path):
    code = "import numba; from pagedserve.cupy_kernels.numba_cpu import setup; print(numba.config.CACHE_DIR)"
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
    env["PAGEDSERVE_CACHE_DIR"] = str(tmp_path)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert Path(out.strip()) == tmp_path / "numba" / setup.sources_digest()
    env["NUMBA_CACHE_DIR"] = str(tmp_path / "mine")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert Path(out.strip()) == tmp_path / "mine"
