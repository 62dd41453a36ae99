"""Backends: `ref` (NumPy, the executable spec), `cpu` (C kernels through cffi), `cuda` (CuPy)."""
