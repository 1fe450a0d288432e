"""The runner's attention-backend factories: kvflow's own paged backends by name, the
context-parallel backend and the MLA backend (a platform's own backends come from
``Platform.get_attention_backend``)."""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from kvflow.attention.cp_paged import ContextParallelAttentionBackend
from kvflow.models.registry import attention_soft_cap, uses_mla

logger = logging.getLogger(__name__)


def make_attention_backend(name: str, batch_invariant: bool = False,
                           device: torch.device | None = None, cpu_attention: str | None = None):
    """The backend called ``name``: torch | cpu | triton | flashinfer. "cpu" falls back to
    "torch" (logged) where its native kernels cannot be built. ``batch_invariant``
    (``--deterministic``, checked beforehand to be on "cpu" with the kernels built): attend
    token by token. ``cpu_attention`` (``--cpu-attention``, see
    :func:`kvflow.config.cpu_attention_choice`): what "cpu" runs for a batch of whole prompts.
    "flashinfer" needs a CUDA ``device`` and the flashinfer package. Raises ValueError for an
    unknown name or ``cpu_attention``, for flashinfer off CUDA or not installed, or for triton
    not installed or off CUDA without its interpreter (``TRITON_INTERPRET=1``)."""
    if name == "cpu":
        backend = _native_cpu_backend(batch_invariant, cpu_attention)
        if backend is not None:
            return backend
        name = "torch"
    if name == "torch":
        from kvflow.attention.torch_paged import TorchPagedAttentionBackend

        return TorchPagedAttentionBackend()
    if name == "triton":
        return _triton_backend(batch_invariant, device)
    if name == "flashinfer":
        from kvflow.attention.flashinfer_paged import FlashInferPagedAttentionBackend

        return FlashInferPagedAttentionBackend(device or torch.device("cpu"))
    raise ValueError(f"unknown attention backend {name!r}; choose torch, cpu, triton or "
                     "flashinfer")


def _native_cpu_backend(batch_invariant: bool, cpu_attention: str | None):
    """The "cpu" backend on kvflow's native CPU kernels; None (the reason logged: a warning
    when they failed to build, info when ``KVFLOW_NATIVE_CPU=0`` turned them off) without
    them.

    Raises:
        ValueError: for an unknown ``cpu_attention``.
    """
    from kvflow.attention.cpu_paged import CpuPagedAttentionBackend
    from kvflow.attention.prefill_select import PrefillAttentionChoice
    from kvflow.config import cpu_attention_choice
    from kvflow.config.kernel_choices import native_cpu_choice
    from kvflow.kernels.cpu_native import native_cpu_kernels

    kernels = native_cpu_kernels()
    if kernels is not None:
        prefill = PrefillAttentionChoice(cpu_attention_choice(cpu_attention), kernels)
        return CpuPagedAttentionBackend(kernels, batch_invariant, prefill)
    if native_cpu_choice():  # the kernels failed to build (their warning says why)
        logger.warning("attention backend 'cpu' unavailable; using 'torch'")
    else:  # asked for: not worth a warning
        logger.info("attention backend 'torch' (KVFLOW_NATIVE_CPU=0 turns kvflow's native "
                    "CPU kernels off)")
    return None


def _triton_backend(batch_invariant: bool, device: torch.device | None):
    """The "triton" backend.

    Raises:
        ValueError: without the triton package, or off CUDA without Triton's interpreter
            (``TRITON_INTERPRET=1``).
    """
    from kvflow.platforms.cuda import triton_available

    if not triton_available():
        raise ValueError("attention_backend='triton' needs the triton package (pip install "
                         "triton); choose attention_backend='torch' without it")
    if device is not None and device.type != "cuda" \
            and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"attention_backend='triton' runs on CUDA; on {device.type} only in "
                         "Triton's interpreter (TRITON_INTERPRET=1, slow: for tests); "
                         "choose attention_backend='cpu' or 'torch' there")
    from kvflow.attention.triton_paged import TritonPagedAttentionBackend

    return TritonPagedAttentionBackend(batch_invariant=batch_invariant)


def make_context_parallel_backend(cp_group, hf_config: Any, block_size: int,
                                  split_prefill: bool = True):
    """The attention backend of a context-parallel rank (``kvflow.attention.cp_paged``),
    whatever ``--attention-backend`` says; ``split_prefill``: Ring Attention for prefill
    chunks (``--context-parallel-prefill ring``).

    Raises:
        ValueError: for an MLA model (its latent cache is not split by token yet), a model
            with soft-capped attention logits (``attn_logit_softcapping``, Gemma 2: the CP
            backend does not compute the cap) or a block size that the CP size does not
            divide.
    """
    if uses_mla(hf_config):
        raise ValueError("context_parallel_size > 1 is not available for multi-head latent "
                         "attention (MLA) models")
    if attention_soft_cap(hf_config) is not None:
        raise ValueError("context_parallel_size > 1 is not available for this model's "
                         "attn_logit_softcapping (attention logit soft-capping, Gemma 2): "
                         "the context-parallel attention backend does not compute it")
    backend = ContextParallelAttentionBackend(cp_group, split_prefill=split_prefill)
    backend.local_block_size(block_size)  # raises for a block size cp does not divide
    return backend


def make_mla_backend(name: str | None):
    """The multi-head latent attention backend for an MLA model (DeepSeek-V2/V3): the plain
    torch one on every device, chosen whatever the platform's default backend is.

    Raises:
        ValueError: when ``--attention-backend`` names a backend without an MLA path (cpu,
            triton) or an unknown one.
    """
    if name not in (None, "torch"):
        raise ValueError(f"--attention-backend {name} has no multi-head latent attention (MLA) "
                         "path for this model; leave --attention-backend unset or use torch")
    from kvflow.attention.torch_mla import TorchMLABackend

    return TorchMLABackend()

def soft_cap_backend(backend, named: str | None):
    """The attention backend of a model whose attention logits are soft-capped
    (``attn_logit_softcapping``, Gemma 2): ``backend`` (the one chosen as for any model) when it
    computes the cap (``supports_logits_soft_cap``: cpu, triton, torch), else the plain-torch
    one when no ``--attention-backend`` was named (a platform default without the cap, logged).

    Raises:
        ValueError: naming ``attn_logit_softcapping`` and the backend, when
            ``--attention-backend`` (``named``) names a backend without the cap.
    """
    if getattr(backend, "supports_logits_soft_cap", False):
        return backend
    if named:
        raise ValueError(f"--attention-backend {named}: the {backend.name!r} backend does not "
                         "compute this model's attn_logit_softcapping (attention logit "
                         "soft-capping, Gemma 2); choose cpu, triton or torch, or leave "
                         "--attention-backend unset")
    from kvflow.attention.torch_paged import TorchPagedAttentionBackend

    logger.info("attention backend %r does not soft-cap attention logits "
                "(attn_logit_softcapping); using 'torch'", backend.name)
    return TorchPagedAttentionBackend()
