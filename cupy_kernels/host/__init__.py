"""Host settings the kernels depend on: BLAS threads, malloc tuning, the cache directory."""
