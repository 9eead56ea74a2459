"""The numba CPU kernel set: Python source compiled for the host's code path (AVX-512, AVX2 or baseline)."""
