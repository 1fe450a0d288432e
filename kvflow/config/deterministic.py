"""The settings ``--deterministic`` refuses that the configuration alone shows (checked when
the :class:`~kvflow.config.EngineConfig` is built, before any model loads); the reasons that
need the model or the device (quantization found in the checkpoint, MoE, MLA, native kernels,
Triton) are checked where the model loads (``kvflow.worker.deterministic``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvflow.config.engine import EngineConfig


def config_reasons(config: EngineConfig) -> list[str]:
    """Why ``--deterministic`` cannot promise batch invariance with these settings, whatever
    the model and device (empty: none of them stands in its way).

    Args:
        config: the engine config (``device_config.deterministic`` need not be set).
    """
    dc, pc, spec = config.device_config, config.parallel_config, config.speculative_config
    has_draft = spec is not None and spec.method == "draft_model"
    draft_quantization = spec.quantization if has_draft else None
    checks = [
        (dc.attention_backend not in (None, "cpu", "triton"),
         (f"attention_backend={dc.attention_backend!r} (only 'cpu' and 'triton' have a "
          "batch-invariant mode)")),
        (dc.cpu_gemm == "auto",  # given: left out, KVFLOW_CPU_GEMM's default goes unread
         ("cpu_gemm='auto' (a choice timed per CPU and shape class, which the mode cannot "
          "make: it runs kvflow's C GEMM; leave --cpu-gemm out or give native)")),
        (dc.cpu_gemm == "onednn", "cpu_gemm='onednn' (oneDNN's row sums depend on M)"),
        # a draft model's attention reads it, and any choice is fine there: a draft is only
        # proposed, and the target's tokens and logprobs come from its own batch-invariant
        # pass whatever the draft proposed (greedy: its argmax; see rejection_sampler.py)
        (dc.cpu_attention == "sdpa" and not has_draft,
         "cpu_attention='sdpa' (a prompt's SDPA attention depends on its batch and chunk)"),
        (dc.cpu_attention in ("auto", "native") and not has_draft,
         (f"cpu_attention={dc.cpu_attention!r} (the mode attends every token alone by the "
          "native kernel's decode path, neither prefill tiles nor SDPA, so only a draft "
          "model's attention reads it; leave --cpu-attention out)")),
        (draft_quantization in ("int8", "int4"),
         (f"speculative_config quantization={draft_quantization!r} (the draft's "
          "quantized GEMMs change kernel with the row count; 'auto' keeps the draft as loaded "
          "under --deterministic)")),
        (pc.context_parallel_size > 1, "context_parallel_size > 1"),
        (pc.tensor_parallel_size > 1,
         "tensor_parallel_size > 1 (the all-reduce's chunking is not checked)"),
        (config.lora_config.enable_lora, "enable_lora (LoRA's grouped matmuls)"),
    ]
    return [reason for failed, reason in checks if failed]


def check_config(config: EngineConfig) -> None:
    """Refuse ``deterministic=True`` with settings it cannot honour (:func:`config_reasons`);
    nothing when the mode is off.

    Raises:
        ValueError: naming every such setting.
    """
    reasons = config_reasons(config) if config.device_config.deterministic else []
    if reasons:
        raise ValueError("deterministic=True is not available with " + "; ".join(reasons))
