"""Which LoRA adapter a request runs with (pure data: it crosses from the API to the runner)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """A LoRA adapter, as vLLM names it.

    Attributes:
        lora_name: the name clients use (the OpenAI ``model`` field picks it).
        lora_int_id: a positive id unique to this adapter for the engine's lifetime (prefix-cache
            keys and device slots are keyed by it; a reloaded adapter gets a new id).
        lora_path: the PEFT folder (``adapter_config.json`` + ``adapter_model.safetensors``).

    Raises:
        ValueError: from the constructor for an empty name or path or an id < 1.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not self.lora_name or not self.lora_path:
            raise ValueError("LoRARequest needs a lora_name and a lora_path")
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"LoRARequest.lora_int_id={self.lora_int_id!r} must be an "
                             "integer >= 1")
