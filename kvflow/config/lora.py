"""Multi-LoRA serving (``LoRAConfig``)."""

from __future__ import annotations

from dataclasses import dataclass, fields

from kvflow.config.options import check_choices, opt


@dataclass
class LoRAConfig:
    """Multi-LoRA serving (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language
    Models"): PEFT adapters applied per request on top of the base weights.

    Raises:
        ValueError: from the constructor for a count or rank < 1, ``max_cpu_loras`` below
            ``max_loras``, or any of them set without ``enable_lora``.
    """

    enable_lora: bool = opt(False, "serve LoRA adapters (PEFT folders) on top of the model")
    max_loras: int = opt(1, "distinct LoRA adapters one engine step may use (each holds a "
                          "slot of device memory)")
    max_lora_rank: int = opt(16, "largest adapter rank accepted (slots are sized for it)")
    max_cpu_loras: int | None = opt(None, "LoRA adapters kept in host memory (default: "
                                    "max_loras; >= max_loras): the least recently used one no "
                                    "request holds is dropped and read again from its folder "
                                    "when asked for")

    def __post_init__(self) -> None:
        check_choices(self)
        for name in ("max_loras", "max_lora_rank"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
            if not self.enable_lora and getattr(self, name) != _DEFAULTS[name]:
                raise ValueError(f"{name}={getattr(self, name)} needs enable_lora "
                                 "(--enable-lora); without it no adapter is served")
        if self.max_cpu_loras is not None:
            if not self.enable_lora:
                raise ValueError(f"max_cpu_loras={self.max_cpu_loras} needs enable_lora "
                                 "(--enable-lora); without it no adapter is served")
            if self.max_cpu_loras < self.max_loras:
                raise ValueError(f"max_cpu_loras={self.max_cpu_loras} must be >= max_loras="
                                 f"{self.max_loras} (a step's adapters are all in host "
                                 "memory)")

    @property
    def cpu_loras(self) -> int:
        """Adapters kept in host memory: ``max_cpu_loras``, or ``max_loras`` when unset."""
        return self.max_loras if self.max_cpu_loras is None else self.max_cpu_loras


_DEFAULTS = {f.name: f.default for f in fields(LoRAConfig)}
