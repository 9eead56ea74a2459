"""The CUDA kernel set: CuPy launchers and the .cu sources they compile, and the on-disk kernel cache."""
