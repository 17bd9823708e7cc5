"""tierserve: kernels."""
