"""``text_offset`` of legacy-completions logprobs: where each token's text starts in the
returned text, from the same incremental detokenization that produced that text.

Summing per-token decodes overshoots whenever a token holds part of a multi-byte character
(byte-level BPE, byte fallback): each piece decodes alone to U+FFFD, so the offsets ran past
the text and the completion's offsets, which start at the echoed prompt's length, went back
below the prompt's. Here a token's offset is the length of the stable text of the tokens
before it (``IncrementalDetokenizer.output_text``: a partial character is not counted until it
completes), so offsets never decrease and index the returned text (OpenAI's and vLLM's
meaning: the character position in prompt + completion text at which the token starts).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvflow.detokenizer import IncrementalDetokenizer


class TokenTextOffsets:
    """Character offsets of one token sequence's tokens, fed a piece at a time (streaming).

    Args:
        tokenizer: the tokenizer that decodes the text the offsets index (None: a server
            without a tokenizer, whose text is empty: every offset is ``start``).
        start: the offset of the sequence's first character in the returned text (0 for the
            echoed prompt; the echo's length for the completion).
        skip_special_tokens: as the text was decoded (the request's for a completion; False
            for an echoed prompt, which is ``tokenizer.decode(ids)``).
    """

    def __init__(self, tokenizer: Any, start: int, skip_special_tokens: bool) -> None:
        self._detok = None if tokenizer is None else IncrementalDetokenizer(
            tokenizer, [], skip_special_tokens=skip_special_tokens)
        self._start = start

    def next_offsets(self, token_ids: Sequence[int], text_end: int | None = None) -> list[int]:
        """The offsets of the next ``token_ids`` (units: ``str`` characters), each capped at
        ``text_end`` when given (the end of the returned text: a stop string cut the text
        short of the tokens that completed it)."""
        out = []
        for token_id in token_ids:
            here = self._start + (len(self._detok.output_text) if self._detok else 0)
            out.append(here if text_end is None else min(here, text_end))
            if self._detok is not None:
                self._detok.update([token_id], finished=False)
        return out
