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
            seconds, fewer than one compile thread, or a cap on live compile threads below
            the compile threads.
    """

    structured_output_compile_timeout: float = opt(
        30.0, "seconds a structured-output grammar (JSON schema, regex, choice, GBNF) may take "
        "to compile for the model's vocabulary; a request whose grammar is not compiled by "
        "then ends with an error (HTTP 400), and identical grammars are refused at once while "
        "that grammar stays in the compile cache")
    structured_output_compile_threads: int = opt(
        2, "grammars compiled at the same time; a compile past its time limit stops counting "
        "(its thread runs on in the background), so slow grammars never hold the others back")
    structured_output_max_compile_threads: int | None = opt(
        None, "grammar compile threads alive at once, those past their time limit included "
        "(default: twice --structured-output-compile-threads); once timed-out compiles alone "
        "fill it, kvflow serve answers constrained requests that need a new compile with "
        "429 (code grammar_compiles_busy, Retry-After) until one of them ends, so slow "
        "grammars cannot occupy every core")

    def __post_init__(self) -> None:
        check_choices(self)
        timeout = self.structured_output_compile_timeout
        if not (0 < timeout and math.isfinite(timeout)):
            raise ValueError(f"structured_output_compile_timeout={timeout} must be a finite "
                             "number of seconds > 0")
        if self.structured_output_compile_threads < 1:
            raise ValueError(f"structured_output_compile_threads="
                             f"{self.structured_output_compile_threads} must be >= 1")
        most = self.structured_output_max_compile_threads
        if most is not None and most < self.structured_output_compile_threads:
            raise ValueError(f"structured_output_max_compile_threads={most} must be >= "
                             "structured_output_compile_threads="
                             f"{self.structured_output_compile_threads}")
