"""Where pagedserve keeps what it can rebuild: converted GGUF weights (models/loading/weight_cache.py) and
numba's compiled kernels (numba_setup.py). It lives here, at the bottom of the layers, so both can ask."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """$PAGEDSERVE_CACHE_DIR, else $XDG_CACHE_HOME/pagedserve, else ~/.cache/pagedserve."""
    if env := os.environ.get("PAGEDSERVE_CACHE_DIR"):
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "pagedserve"
