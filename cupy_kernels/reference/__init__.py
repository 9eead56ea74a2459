"""The numpy reference kernels: every other kernel set is tested against these."""
