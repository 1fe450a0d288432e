"""Kernels: Triton GPU kernels (paged attention, KV-cache store, RMSNorm, SiLU-and-mul, rotary,
MoE grouped GEMM), the CPU GEMM paths (``gemm``) and native CPU kernels (``cpu_native``: C
sources in ``csrc/`` built with the system compiler at first use, called through ctypes).

Each Triton module imports ``triton`` at its top, so import them only when the Triton backend
is requested; this package ``__init__`` deliberately imports nothing.  Every kernel has a
plain-torch twin (``*_ref``, ``attention_ref``, or the layer's torch code) used by the tests in
``tests/kernels``.
"""
