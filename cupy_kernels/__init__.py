"""pagedserve.cupy_kernels."""
