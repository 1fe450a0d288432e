"""The runner's model set-up: the quantization config (checked against ``--deterministic``),
the attention backend, the weights loaded onto the device with their GEMM path chosen, and the
speculative-decoding draft model. ``ModelRunner`` keeps the running state."""

from __future__ import annotations

import logging
from typing import Any, NamedTuple

import torch
from torch import nn

from kvflow.attention.layer import AttentionContext
from kvflow.config import EngineConfig
from kvflow.config.speculative import HEAD_METHODS
from kvflow.distributed.comm import CommGroup
from kvflow.distributed.parallel_state import ParallelState
from kvflow.kernels.cpu_native import native_cpu_kernels
from kvflow.models.generation_config import load_eos_token_ids
from kvflow.models.loader import load_model
from kvflow.models.model_resolver import ModelSource
from kvflow.models.registry import attention_soft_cap, uses_mla
from kvflow.platforms import Platform
from kvflow.platforms.cpu_memory import HugePageArena
from kvflow.quant import get_quant_config
from kvflow.spec_decode.draft_model import DraftModel
from kvflow.spec_decode.eagle import EagleDrafter
from kvflow.worker.attention_backends import (
    make_attention_backend,
    make_context_parallel_backend,
    make_mla_backend,
    soft_cap_backend,
)
from kvflow.worker.cpu_setup import choose_gemm_path
from kvflow.worker.cpu_weight_pages import place_weights_on_huge_pages
from kvflow.worker.deterministic import check_supported as check_deterministic

logger = logging.getLogger(__name__)


class LoadedModel(NamedTuple):
    """:func:`load_runner_model`'s result: the model on its device (this rank's shard and
    pipeline stage), the attention context its layers share, and its quantization config
    (None: unquantized)."""

    model: nn.Module
    attn_ctx: AttentionContext
    quant_config: Any


def load_runner_model(config: EngineConfig, platform: Platform, source: ModelSource,
                      hf_config: Any, dtype: torch.dtype, parallel: ParallelState
                      ) -> LoadedModel:
    """Build the target model on ``platform.device``: quantization config, attention backend
    (:func:`choose_attention_backend`), weights (``loader.load_model``), GEMM path.

    Raises:
        ValueError: for a quantization, attention backend or checkpoint that cannot be used
            (see the functions named).
    """
    mc, device = config.model_config, platform.device
    quant_config = runner_quant_config(config, source, hf_config, device)
    attn_ctx = AttentionContext(choose_attention_backend(config, platform, parallel,
                                                         hf_config))
    model = load_model(source, hf_config, attn_ctx, dtype, device, mc.load_format, mc.seed,
                       quant_config, parallel)
    choose_gemm_path(model, config, platform, device, dtype)
    _streamed_weights_on_huge_pages(model, device)
    return LoadedModel(model, attn_ctx, quant_config)


def _streamed_weights_on_huge_pages(model: nn.Module, device: torch.device) -> None:
    """On CPU, the weights no packed GEMM copy replaced (quantized layers, MoE experts, torch's
    GEMMs) moved onto huge pages (:func:`place_weights_on_huge_pages`)."""
    if device.type == "cpu":
        moved = place_weights_on_huge_pages(model, HugePageArena())
        if moved:
            logger.info("%.1f MiB of further weights moved onto huge pages", moved / 2**20)


def choose_attention_backend(config: EngineConfig, platform: Platform,
                             parallel: ParallelState, hf_config: Any):
    """The target model's attention backend: context-parallel with CP ranks, the MLA one
    for an MLA model, else ``--attention-backend`` (or the platform's default) from the
    platform, then from kvflow's own (``make_attention_backend``, looked up on this module
    so a test can stand one in); under ``--deterministic`` always kvflow's batch-invariant
    one. For a model with soft-capped attention logits (Gemma 2) the chosen backend must
    compute the cap (``soft_cap_backend``: else torch, or refused when named).

    Raises:
        ValueError: see :func:`~kvflow.worker.attention_backends.make_attention_backend`,
            ``make_context_parallel_backend``, ``make_mla_backend`` and
            ``soft_cap_backend``.
    """
    dc = config.device_config
    if parallel.cp.world_size > 1:  # a KV cache split by token over the CP ranks
        return make_context_parallel_backend(
            parallel.cp, hf_config, config.cache_config.block_size,
            config.parallel_config.context_parallel_prefill == "ring")
    if uses_mla(hf_config):
        return make_mla_backend(dc.attention_backend)
    name = dc.attention_backend or platform.default_attention_backend
    backend = None if dc.deterministic else platform.get_attention_backend(name)
    backend = backend or make_attention_backend(name, dc.deterministic, platform.device,
                                                dc.cpu_attention)
    if attention_soft_cap(hf_config) is not None:
        return soft_cap_backend(backend, dc.attention_backend)
    return backend


def runner_quant_config(config: EngineConfig, source: ModelSource, hf_config: Any,
                        device: torch.device) -> Any:
    """The model's quantization config (None: unquantized) from ``--quantization`` or the
    checkpoint.

    Raises:
        ValueError: under ``--deterministic``, for a setup it cannot make batch-invariant
            (``worker/deterministic.py: check_supported``).
    """
    mc = config.model_config
    quant_config = get_quant_config(mc.quantization, hf_config, source.kind,
                                    mc.quantization_group_size)
    if config.device_config.deterministic:
        # a block-FP8 checkpoint's layers run the unquantized GEMMs (dequantized at load)
        check_deterministic(config, hf_config, device.type,
                            quant_config.name if quant_config and quant_config.quantizes_layers
                            else None,
                            device.type != "cpu" or native_cpu_kernels() is not None)
    return quant_config


def make_draft_model(config: EngineConfig, platform: Platform, source: ModelSource,
                     hf_config: Any, dtype: torch.dtype, device: torch.device,
                     tp_group: CommGroup | None = None, target: torch.nn.Module | None = None
                     ) -> DraftModel | None:
    """The speculative-decoding draft model (``method: draft_model``) or head fed the
    target's hidden states (``eagle``, ``deepseek_mtp``: ``target`` is the target model,
    whose embedding and LM head it may share),
    else None; it runs on
    the target's attention backend and GEMM path. ``source`` / ``hf_config``: the target's;
    its declared EOS ids (``load_eos_token_ids``, the ids the front end makes every request
    stop on) stay in a draft LM head cut to frequent tokens. ``tp_group``: the target's
    tensor-parallel group (each rank holds the whole draft or head; TP rank 0's proposal
    is used)."""
    spec = config.speculative_config
    if spec is None or spec.method not in ("draft_model", *HEAD_METHODS):
        return None
    if spec.method == "deepseek_mtp":  # the target's MLA layer: the MLA backend
        return EagleDrafter(config, make_mla_backend(config.device_config.attention_backend),
                            dtype, device, target, hf_config.vocab_size, tp_group)
    name = config.device_config.attention_backend or platform.default_attention_backend
    backend = platform.get_attention_backend(name) or \
        make_attention_backend(name, device=device,
                               cpu_attention=config.device_config.cpu_attention)
    if spec.method in ("eagle", "eagle3"):  # one layer: its GEMMs run as loaded
        return EagleDrafter(config, backend, dtype, device, target, hf_config.vocab_size,
                            tp_group)
    drafter = DraftModel(config, backend, dtype, device, hf_config.vocab_size,
                         load_eos_token_ids(source, hf_config), tp_group)
    # unpacked, a bf16 draft cost more than it saved
    choose_gemm_path(drafter.model, config, platform, device, dtype)
    _streamed_weights_on_huge_pages(drafter.model, device)
    return drafter
