"""Triton kernels for CUDA (and for CPU tests under `TRITON_INTERPRET=1`).

Importing `tandem.moe_determinism.kernels.triton_kernels` decorates the kernels, so the
interpreter flag must be in the environment before that import; nothing here imports it
eagerly.
"""
