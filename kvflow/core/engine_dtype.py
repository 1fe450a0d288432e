"""The engine's compute dtype: ``--dtype`` resolved against the checkpoint and the platform
(on CPU, ``auto`` may time the model's GEMMs to choose between a 16-bit dtype and fp32)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from kvflow.config import DeviceConfig, cpu_gemm_choice
from kvflow.kernels.cpu_native import native_cpu_kernels
from kvflow.kernels.cpu_threads import cpu_thread_count
from kvflow.kernels.gemm_select import measure_cpu_dtype, transformer_gemm_shapes
from kvflow.kernels.gemm_timing import row_classes
from kvflow.platforms import Platform

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# 16-bit dtypes kvflow's C GEMM runs on a CPU without matmul units for them (weights kept 16-bit
# and widened in registers): bf16 (a shift). CPU-W1 on an Ice Lake Xeon without AVX512-BF16 ran
# 1.30x faster in bf16 than in fp32 (docs/benchmarks.md, session 51); fp16 was not measured.
WIDENED_HALF = frozenset({torch.bfloat16})

logger = logging.getLogger(__name__)


def resolve_dtype(requested: str, hf_config, platform,
                  measure: Callable[[torch.dtype], torch.dtype | None] | None = None
                  ) -> torch.dtype:
    """``auto``: the checkpoint's dtype when it is a float type, else the platform default; on
    a CPU without native bf16/fp16 matmuls, half types fall back to float32. Where that gives a
    16-bit dtype and ``measure`` is given, ``measure(dtype)`` has the last word (on CPU: that
    dtype or float32, whichever the timed GEMMs favour). A 16-bit checkpoint dtype without
    native matmuls is offered to ``measure`` as well (on CPU: timed where kvflow's own GEMM
    runs it, :func:`cpu_dtype_measure`); float32 where it returns None (nothing timed) or
    none is given. A checkpoint dtype the platform cannot compute in (bf16 on a GPU older
    than Ampere) gives the platform default instead. A 16-bit checkpoint run in float32
    without timing is logged at INFO, ``--dtype auto: torch.float32 (...)``, as a timed
    choice is.

    Raises:
        ValueError: for an explicit ``requested`` dtype the platform cannot compute in.
    """
    if requested != "auto":
        platform.check_dtype(_DTYPES[requested], f"dtype={requested!r}")
        return _DTYPES[requested]
    native = platform.default_dtype()
    cfg = getattr(hf_config, "dtype", None)  # transformers >= 4.56 (``torch_dtype`` is deprecated)
    if isinstance(cfg, str):
        cfg = _DTYPES.get(cfg)
    dtype = native
    if cfg in (torch.float32, torch.bfloat16, torch.float16) and platform.supports_dtype(cfg):
        dtype = torch.float32 if native == torch.float32 else cfg
    if dtype == torch.float32 and cfg in (torch.bfloat16, torch.float16):
        chosen = measure(cfg) if measure is not None and platform.supports_dtype(cfg) else None
        if chosen is not None:
            return chosen
        # Said here, as the timed choice is (gemm_select.measure_cpu_dtype): otherwise the
        # fallback from a 16-bit checkpoint is silent.
        logger.info("--dtype auto: torch.float32 (the checkpoint's %s has no native matmul "
                    "on this %s, nor kvflow's own GEMM for it; nothing timed)", cfg,
                    platform.name)
        return torch.float32
    return measure(dtype) if measure is not None and dtype != torch.float32 else dtype


def cpu_dtype_measure(platform: Platform, device_config: DeviceConfig, hf_config: Any,
                      max_num_batched_tokens: int | None = None,
                      max_num_seqs: int | None = None, graphs: bool = False
                      ) -> Callable[[torch.dtype], torch.dtype | None] | None:
    """On CPU, ``--dtype auto`` picks between the 16-bit dtype and fp32 by timing the
    model's GEMMs at the engine's thread count and row classes (the prefill class from
    ``max_num_batched_tokens``, the LM head's up to ``max_num_seqs`` rows, as ``--cpu-gemm
    auto`` times them, so both read one timings file; kernels/gemm_select.py); None
    elsewhere. ``graphs``: the engine's decode steps would replay as CPU step graphs
    (``worker/step_graphs.py: cpu_step_graphs_expected``), so a oneDNN GEMM at decode rows
    counts ``gemm_select.graph_weighted``'s handicap, as ``--cpu-gemm auto`` will weigh it.

    A 16-bit dtype without native matmul units here (bf16 on a CPU without AVX512-BF16 or
    AMX, :meth:`CpuPlatform.has_native_matmul`) is timed with kvflow's own GEMM only (its
    weights widened in registers; oneDNN's bf16 is emulated there), where that GEMM runs it:
    a dtype of :data:`WIDENED_HALF`, kvflow's native kernels built (not ``KVFLOW_NATIVE_CPU=0``)
    and not ``--cpu-gemm onednn``, for a model whose GEMM shapes are known
    (``gemm_select.transformer_gemm_shapes``: a dense decoder). Elsewhere the measure returns
    None without timing anything (:func:`resolve_dtype` then runs float32)."""
    if platform.name != "cpu":
        return None
    choice = cpu_gemm_choice(device_config.cpu_gemm)

    def measure(half: torch.dtype) -> torch.dtype | None:
        kernels = native_cpu_kernels(device_config.native_kernel_flags())  # a failure names them
        if not platform.has_native_matmul(half) and (
                half not in WIDENED_HALF or kernels is None or choice == "onednn"
                or transformer_gemm_shapes(hf_config) is None):
            return None
        with cpu_thread_count(device_config.cpu_threads):
            return measure_cpu_dtype(hf_config, half, choice, platform.prepacks_gemm_weights,
                                     row_classes(max_num_batched_tokens), max_num_seqs, graphs)

    return measure
