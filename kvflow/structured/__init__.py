"""Structured output: constrain sampling to a JSON schema, regex, choice list or grammar.

``params`` (StructuredOutputsParams, no heavy imports), ``backend`` (the interface),
``xgrammar_backend`` (the implementation), ``manager`` (the engine core's side: compile off
the step loop, per-step token bitmask).
"""

from __future__ import annotations

from kvflow.structured.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams", "validate"]


def validate(params: StructuredOutputsParams) -> None:
    """Check a constraint's schema / regex / grammar without a tokenizer.

    Raises:
        ValueError: naming the problem.
    """
    from kvflow.structured.xgrammar_backend import validate as _validate

    _validate(params)
