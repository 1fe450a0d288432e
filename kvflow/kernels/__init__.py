"""Triton GPU kernels (paged attention, KV-cache store, RMSNorm, SiLU-and-mul, rotary, MoE
grouped GEMM).

Each kernel module imports ``triton`` at its top, so import them only when the Triton backend
is requested; this package ``__init__`` deliberately imports nothing.  Every kernel ships with a
plain-torch ``*_ref`` twin used by the tests in ``tests/kernels``.
"""
