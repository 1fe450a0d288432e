"""``--lora-path FOLDER``: the one PEFT adapter an offline command (``kvflow generate``,
``kvflow bench throughput|latency|perplexity``) applies to every request, as vLLM's
``vllm bench throughput --lora-path`` does."""

from __future__ import annotations

import argparse
import os

from kvflow.lora.request import LoRARequest


def add_lora_path_arg(parser: argparse.ArgumentParser, applies_to: str) -> None:
    """Add ``--lora-path FOLDER`` to ``parser``; ``applies_to`` says what it adapts
    ("every prompt", "every request")."""
    parser.add_argument("--lora-path", metavar="FOLDER",
                        help=f"a PEFT LoRA adapter folder applied to {applies_to} (needs "
                        "--enable-lora)")


def lora_request_from_flags(path: str | None, enable_lora: bool,
                            command: str) -> LoRARequest | None:
    """The ``--lora-path`` adapter as a ``LoRARequest`` (id 1) for every request, or None.

    Args:
        path: the ``--lora-path`` value (None: not given).
        enable_lora: the ``--enable-lora`` value.
        command: the command for the error text (``"kvflow generate"``).

    Raises:
        ValueError: ``--lora-path`` without ``--enable-lora``; ``--enable-lora`` without
            ``--lora-path`` (no adapter would be applied); a folder without a readable
            ``adapter_config.json`` (checked before the model loads).
    """
    if path is None:
        if enable_lora:
            raise ValueError(f"--enable-lora without --lora-path: {command} applies the "
                             "adapter --lora-path names (kvflow serve takes --lora-modules)")
        return None
    if not enable_lora:
        raise ValueError(f"--lora-path {path} needs --enable-lora")
    from kvflow.lora.adapter_config import read_adapter_config

    read_adapter_config(path)
    return LoRARequest(os.path.basename(os.path.normpath(path)) or "adapter", 1, path)
