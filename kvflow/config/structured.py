"""Structured output: how grammars are compiled (``StructuredOutputConfig``)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvflow.config.options import check_choices, opt


@dataclass
class StructuredOutputConfig:
    """Grammar compiles of constrained requests (``kvflow/structured/manager.py``).

    Raises:
        ValueError: from the constructor for a timeout that is not a positive number of
            seconds, or fewer than one compile thread.
    """

    structured_output_compile_timeout: float = opt(
        30.0, "seconds a structured-output grammar (JSON schema, regex, choice, GBNF) may take "
        "to compile for the model's vocabulary; a request whose grammar is not compiled by "
        "then ends with an error (HTTP 400), and identical grammars are refused at once while "
        "that grammar stays in the compile cache")
    structured_output_compile_threads: int = opt(
        2, "grammars compiled at the same time; a compile past its time limit stops counting "
        "(its thread runs on in the background), so slow grammars never hold the others back")

    def __post_init__(self) -> None:
        check_choices(self)
        timeout = self.structured_output_compile_timeout
        if not (0 < timeout and math.isfinite(timeout)):
            raise ValueError(f"structured_output_compile_timeout={timeout} must be a finite "
                             "number of seconds > 0")
        if self.structured_output_compile_threads < 1:
            raise ValueError(f"structured_output_compile_threads="
                             f"{self.structured_output_compile_threads} must be >= 1")
