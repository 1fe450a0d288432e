"""The runner's model set-up beside loading: the quantization config (checked against
``--deterministic``) and the speculative-decoding draft model."""

from __future__ import annotations

from typing import Any

import torch

from kvflow.config import EngineConfig
from kvflow.kernels.cpu_native import native_cpu_kernels
from kvflow.models.model_resolver import ModelSource
from kvflow.platforms import Platform
from kvflow.quant import get_quant_config
from kvflow.spec_decode.draft_model import DraftModel
from kvflow.worker.attention_backends import make_attention_backend
from kvflow.worker.cpu_setup import choose_gemm_path
from kvflow.worker.deterministic import check_supported as check_deterministic


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
        check_deterministic(config, hf_config, device.type,
                            quant_config and quant_config.name,
                            device.type != "cpu" or native_cpu_kernels() is not None)
    return quant_config


def make_draft_model(config: EngineConfig, platform: Platform, hf_config: Any,
                     dtype: torch.dtype, device: torch.device) -> DraftModel | None:
    """The speculative-decoding draft model (``method: draft_model``), else None; it runs on
    the target's attention backend and GEMM path."""
    spec = config.speculative_config
    if spec is None or spec.method != "draft_model":
        return None
    name = config.device_config.attention_backend or platform.default_attention_backend
    backend = platform.get_attention_backend(name) or \
        make_attention_backend(name, device=device,
                               cpu_attention=config.device_config.cpu_attention)
    drafter = DraftModel(config, backend, dtype, device, hf_config.vocab_size)
    # unpacked, a bf16 draft cost more than it saved
    choose_gemm_path(drafter.model, config, platform, device, dtype)
    return drafter
