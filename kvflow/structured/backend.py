"""The grammar-backend interface: compile a constraint once, then one matcher per request.

A backend turns a ``StructuredOutputsParams`` into a compiled grammar (tokenizer-specific,
shareable, cached by ``params.key``) and a compiled grammar into a ``StructuredOutputGrammar``:
the per-request matcher that accepts sampled tokens, rolls them back, and fills its row of the
token bitmask. Bitmask layout (xgrammar's): int32 ``[rows, ceil(vocab_size / 32)]``, bit ``j``
of word ``w`` set means token ``32 * w + j`` is allowed.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch

from kvflow.structured.params import StructuredOutputsParams


class StructuredOutputGrammar(ABC):
    """One request's matcher state. Not thread-safe: the engine core's thread owns it."""

    @abstractmethod
    def accept_tokens(self, token_ids: list[int]) -> bool:
        """Advance over ``token_ids``; returns False (state unchanged from the first rejected
        token on) when a token is not allowed here."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (speculative decoding)."""

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (int32 [rows, words], CPU)."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """True once the grammar is complete and its stop token was accepted."""

    @property
    @abstractmethod
    def num_accepted_tokens(self) -> int:
        """Tokens accepted so far (minus rolled back ones)."""


class StructuredOutputBackend(ABC):
    """Compiles constraints for one tokenizer. ``compile`` may run on a worker thread."""

    vocab_size: int

    @abstractmethod
    def compile(self, params: StructuredOutputsParams) -> Any:
        """The compiled grammar (opaque, shareable between requests).

        Raises:
            ValueError: for a malformed schema, regex or grammar.
        """

    @abstractmethod
    def new_matcher(self, compiled: Any) -> StructuredOutputGrammar:
        """A fresh matcher at the start of the grammar."""
