"""Which LoRA adapter a request runs with (pure data: it crosses from the API to the runner)."""

from __future__ import annotations

import unicodedata
from collections.abc import Mapping
from dataclasses import dataclass


class LoRANameError(ValueError):
    """A name no adapter can have (see :func:`check_lora_name`)."""


def lora_name_problem(name: str) -> str | None:
    """Why no model or adapter can be called ``name`` (``is empty``, ``is whitespace only``,
    ``holds the control character U+0000``), or None for a usable name."""
    if not name:
        return "is empty"
    if not name.strip():
        return "is whitespace only"
    bad = next((c for c in name if unicodedata.category(c) == "Cc"), None)
    return None if bad is None else f"holds the control character U+{ord(bad):04X}"


def check_lora_name(name: str, what: str = "lora_name") -> None:
    """Refuse a name that clients could not reliably send or read back as ``model``: empty,
    whitespace only, or holding a control character (Unicode category Cc: U+0000-U+001F,
    U+007F-U+009F, NUL included).

    Raises:
        LoRANameError: (a ValueError) naming ``what``, the name and why.
    """
    why = lora_name_problem(name)
    if why is not None:
        raise LoRANameError(f"{what} {name!r} {why}: a LoRA adapter's name must hold "
                            "visible characters and no control characters")


@dataclass(frozen=True)
class LoRARequest:
    """A LoRA adapter, as vLLM names it.

    Attributes:
        lora_name: the name clients use (the OpenAI ``model`` field picks it).
        lora_int_id: a positive id unique to this adapter for the engine's lifetime (prefix-cache
            keys and device slots are keyed by it; a reloaded adapter gets a new id).
        lora_path: the PEFT folder (``adapter_config.json`` + ``adapter_model.safetensors``).

    Raises:
        ValueError: from the constructor for an empty path, an id < 1, or a name that is
            empty, whitespace only or holds a control character (``LoRANameError``).
    """

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        check_lora_name(self.lora_name)
        if not self.lora_path:
            raise ValueError("LoRARequest needs a lora_name and a lora_path")
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"LoRARequest.lora_int_id={self.lora_int_id!r} must be an "
                             "integer >= 1")


def already_loaded(loras: Mapping[int, LoRARequest], lora_request: LoRARequest,
                   enable_lora: bool) -> bool:
    """Whether ``lora_request`` is loaded already (``loras``: the loaded adapters by id), so
    loading it again is a no-op; False when it may be loaded.

    Raises:
        ValueError: for an id used by another adapter, or an engine without ``enable_lora``.
    """
    known = loras.get(lora_request.lora_int_id)
    if known is not None:
        if known != lora_request:
            raise ValueError(f"lora_int_id {lora_request.lora_int_id} is already used by "
                             f"{known}; give each adapter its own id")
        return True
    if not enable_lora:
        raise ValueError("LoRA adapters need an engine started with enable_lora "
                         "(--enable-lora)")
    return False
