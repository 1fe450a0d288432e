"""Multi-LoRA serving (``LoRAConfig``)."""

from __future__ import annotations

from dataclasses import dataclass, fields

from kvflow.config.options import check_choices, opt
from kvflow.config.parallel import ParallelConfig


@dataclass
class LoRAConfig:
    """Multi-LoRA serving (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language
    Models"): PEFT adapters applied per request on top of the base weights.

    Raises:
        ValueError: from the constructor for a count or rank < 1, or either set without
            ``enable_lora``.
    """

    enable_lora: bool = opt(False, "serve LoRA adapters (PEFT folders) on top of the model")
    max_loras: int = opt(1, "distinct LoRA adapters one engine step may use (each holds a "
                          "slot of device memory)")
    max_lora_rank: int = opt(16, "largest adapter rank accepted (slots are sized for it)")

    def __post_init__(self) -> None:
        check_choices(self)
        for name in ("max_loras", "max_lora_rank"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
            if not self.enable_lora and getattr(self, name) != _DEFAULTS[name]:
                raise ValueError(f"{name}={getattr(self, name)} needs enable_lora "
                                 "(--enable-lora); without it no adapter is served")

    def verify_with_parallel(self, parallel: ParallelConfig) -> None:
        """LoRA runs over any number of tensor-parallel ranks (each holds its shard of every
        adapter: ``kvflow/lora/sharding.py``), pipeline stages (each adapts its own layers)
        and data-parallel replicas (each loads every adapter); not over context-parallel
        ranks yet.

        Raises:
            ValueError: with LoRA enabled and more than one context-parallel rank.
        """
        if self.enable_lora and parallel.context_parallel_size > 1:
            raise ValueError("enable_lora needs context_parallel_size=1: LoRA is not run over "
                             "context-parallel ranks yet (tensor_parallel_size, "
                             "pipeline_parallel_size and data_parallel_size > 1 work)")

_DEFAULTS = {f.name: f.default for f in fields(LoRAConfig)}
