"""Deterministic (batch-invariant) inference: ``--deterministic`` / ``LLM(deterministic=True)``.

Goal: a request's logits, and so its temperature-0 tokens, are bitwise the same whether it runs
alone or beside any other requests, and however its prompt is chunked. The usual reason they
are not is not run-to-run randomness but *batch variance*: a kernel whose reduction order for
one row depends on how many rows (or which rows) it is given (Horace He and Thinking Machines
Lab, "Defeating Nondeterminism in LLM Inference", 2025; vLLM's ``VLLM_BATCH_INVARIANT`` and
SGLang's deterministic inference apply the same cure on GPUs). The cure is one kernel per op
whose per-row reduction order is fixed whatever the batch.

What kvflow does on CPU (each source measured, see docs/architecture.md "Deterministic mode"):

- **GEMMs**: every projection and the LM head run kvflow's C GEMM
  (``kernels/csrc/cpu_gemm.c``): each output element is one thread's sum over k in one fixed
  order, whatever M and the thread count. ``--cpu-gemm auto`` is off (it may give a shape class
  to oneDNN, whose fp32 GEMM sums a row of K=1536 differently at M=1 than at M>1) and so is
  torch's ``F.linear`` (MKL: differs for every M > 1 in fp32).
- **Attention**: every query token is attended alone by the native kernel's decode path
  (``batch_invariant`` in :class:`~kvflow.attention.cpu_paged.CpuPagedAttentionBackend`): no
  SDPA shortcut for a batch of equal whole prompts, no prefill tiles (whose key grouping
  depends on the tile's last position), so a token's result does not depend on its chunk.
- RMSNorm, SiLU-and-mul and RoPE already run per row / per element in kvflow's C kernels; the
  sampler's greedy choice is a per-row argmax.

On CUDA (checked only in Triton's interpreter; no GPU has run it): every GEMM module runs
one fixed-configuration Triton GEMM (:mod:`kvflow.kernels.batch_invariant_gemm`, no split-K,
instead of cuBLAS), and the Triton paged attention keeps one launch configuration for every
batch (decode-sized row tiles, no split-KV; ``batch_invariant`` in
:func:`kvflow.kernels.paged_attention.plan_paged_attention`). The Triton RMSNorm is one
program per row already; the sampler's argmax is exact in any order.

What it refuses (ValueError at start-up; what the settings alone show, when the EngineConfig
is built: ``kvflow.config.deterministic``), because those paths are not batch-invariant or not
verified: a device other than CPU and CUDA, a CPU build without kvflow's native kernels, an
attention backend other than cpu/triton, weight quantization (int8/int4/fp8 and kept GGUF blocks switch kernels by row
count; a .gguf file dequantized at load is fine), MoE layers (torch GEMMs per expert),
multi-head latent attention, context or tensor parallelism (all-reduce chunking) and LoRA,
and kernel choices the mode does not read: ``--cpu-gemm auto|onednn`` and, without a draft
model (whose attention takes it), any ``--cpu-attention``.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from kvflow.config import EngineConfig
from kvflow.config.deterministic import config_reasons
from kvflow.kernels.gemm import GemmPathMixin

CHANGES = (
    ("GEMMs: kvflow's C GEMM for every projection and the LM head (fixed k order per output; "
     "--cpu-gemm auto/oneDNN off)"),
    ("attention: every query token alone through the decode path (no SDPA prompt shortcut, "
     "no prefill tiles)"),
)

CHANGES_CUDA = (
    ("GEMMs: one fixed-configuration Triton GEMM for every projection and the LM head (no "
     "cuBLAS, no split-K; not verified on a GPU)"),
    "attention: one Triton launch configuration for every batch (no split-KV)",
)


def unsupported_reasons(config: EngineConfig, hf_config: Any, device_type: str,
                        quantization: str | None, has_native_kernels: bool) -> list[str]:
    """Why ``--deterministic`` cannot promise batch invariance for this engine (empty: it can).

    Args:
        config: the engine config.
        hf_config: the model's HF config.
        device_type: the platform's device type ("cpu", "cuda", ...).
        quantization: the weight quantization in force (None: unquantized).
        has_native_kernels: whether kvflow's native CPU kernels are built.
    """
    from kvflow.models.registry import uses_mla
    from kvflow.platforms.cuda import triton_available

    checks = [
        (device_type not in ("cpu", "cuda"),
         f"device {device_type!r}: batch-invariant kernels exist for CPU and CUDA only"),
        (device_type == "cuda" and not triton_available(),
         ("CUDA without the triton package: the mode's batch-invariant GEMM and attention are "
          "Triton kernels")),
        (not has_native_kernels,
         ("kvflow's native CPU kernels off (KVFLOW_NATIVE_CPU=0) or not built (no C "
          "compiler): the mode's batch-invariant CPU GEMM is one of them")),
        (device_type == "cuda" and config.device_config.attention_backend == "cpu",
         "attention_backend='cpu' on CUDA (the Triton backend has the batch-invariant mode)"),
        (quantization is not None,
         f"quantization={quantization!r} (its GEMMs change kernel with the row count)"),
        (_is_moe(hf_config),
         ("a mixture-of-experts model (its expert GEMMs run torch's GEMM on the tokens routed "
          "to each expert)")),
        (uses_mla(hf_config), "multi-head latent attention (the torch MLA backend)"),
    ]
    return config_reasons(config) + [reason for failed, reason in checks if failed]


def check_supported(config: EngineConfig, hf_config: Any, device_type: str,
                    quantization: str | None, has_native_kernels: bool) -> None:
    """Raise unless ``--deterministic`` can hold for this engine (see
    :func:`unsupported_reasons` for the arguments).

    Raises:
        ValueError: naming every reason it cannot.
    """
    reasons = unsupported_reasons(config, hf_config, device_type, quantization,
                                  has_native_kernels)
    if reasons:
        raise ValueError("deterministic=True is not available with " + "; ".join(reasons))


def unread_environment(config: EngineConfig, device_type: str) -> list[str]:
    """Warnings naming the CPU kernel variables set that ``--deterministic`` does not read on
    a CPU (empty elsewhere, or with the matching flag given, which overrides a variable in
    silence as everywhere in kvflow): ``KVFLOW_CPU_GEMM`` other than ``native`` (the mode
    runs kvflow's C GEMM) and, without a draft model (whose attention reads it),
    ``KVFLOW_CPU_ATTENTION``. Variables are defaults, so they are warned about (as
    ``KVFLOW_CPU_ADAPTIVE_THREADS=1`` is), not refused, once per engine by its engine core
    (``kvflow.core.unread_options.warn_unread_settings``)."""
    dc, spec = config.device_config, config.speculative_config
    if device_type != "cpu":
        return []
    gemm, attention = os.environ.get("KVFLOW_CPU_GEMM"), os.environ.get("KVFLOW_CPU_ATTENTION")
    warnings = []
    if dc.cpu_gemm is None and gemm is not None and gemm != "native":
        warnings.append(f"KVFLOW_CPU_GEMM={gemm!r} is not read under --deterministic, which "
                        "runs kvflow's C GEMM (native) for every projection and the LM head; "
                        "unset it")
    if dc.cpu_attention is None and attention is not None and \
            (spec is None or spec.method != "draft_model"):
        warnings.append(f"KVFLOW_CPU_ATTENTION={attention!r} is not read under "
                        "--deterministic, which attends every token alone by the native "
                        "kernel's decode path (only a draft model's attention reads it); "
                        "unset it")
    return warnings


def _is_moe(hf_config: Any) -> bool:
    return any(getattr(hf_config, name, None) for name in
               ("num_local_experts", "num_experts", "n_routed_experts"))


def use_batch_invariant_gemms(model: nn.Module) -> int:
    """Give every GEMM module of ``model`` with a 2-D float weight a
    :class:`~kvflow.kernels.batch_invariant_gemm.BatchInvariantWeight` as its packed weight
    (CUDA under ``--deterministic``). Returns the number of modules switched."""
    from kvflow.kernels.batch_invariant_gemm import BatchInvariantWeight

    switched = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if isinstance(module, GemmPathMixin) and isinstance(weight, torch.Tensor) \
                and weight.dim() == 2 and weight.is_floating_point():
            module.packed_weight = BatchInvariantWeight(weight)
            switched += 1
    return switched


def unpacked_gemm_modules(model: nn.Module) -> list[str]:
    """Names of GEMM modules of ``model`` whose weight is not packed for a fixed kernel (they
    would run torch's GEMM): what :func:`check_all_packed` refuses."""
    return [name for name, m in model.named_modules()
            if isinstance(m, GemmPathMixin) and m.packed_weight is None
            and getattr(getattr(m, "weight", None), "numel", lambda: 0)() > 0]


def check_all_packed(model: nn.Module) -> None:
    """After the GEMM paths are chosen: every GEMM module runs the packed C GEMM.

    Raises:
        ValueError: naming the modules that would run another GEMM.
    """
    left = unpacked_gemm_modules(model)
    if left:
        raise ValueError(f"deterministic=True: {len(left)} GEMM module(s) have no batch-invariant "
                         f"kernel (e.g. {left[:3]})")
