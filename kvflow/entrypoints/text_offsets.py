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

import bisect
from collections.abc import Sequence
from typing import Any

from kvflow.engine.detokenizer import IncrementalDetokenizer


class TokenTextOffsets:
    """Character offsets of one token sequence's tokens, fed a piece at a time (streaming).

    Args:
        tokenizer: the tokenizer that decodes the text the offsets index (None: a server
            without a tokenizer, whose text is empty: every offset is ``start``).
        start: the offset of the sequence's first character in the returned text (0 for the
            echoed prompt; the echo's length for the completion).
        skip_special_tokens: as the text was decoded (the request's for a completion; False
            for an echoed prompt, which is ``tokenizer.decode(ids)``).
        spaces_between_special_tokens: as the text was decoded (the request's for a
            completion).
        prompt_token_ids: the ids the text was decoded after (a completion's prompt: its
            first token is decoded in the prompt's context; empty for an echoed prompt).
    """

    def __init__(self, tokenizer: Any, start: int, skip_special_tokens: bool,
                 spaces_between_special_tokens: bool = True,
                 prompt_token_ids: Sequence[int] = ()) -> None:
        self._detok = None if tokenizer is None else IncrementalDetokenizer(
            tokenizer, prompt_token_ids, skip_special_tokens=skip_special_tokens,
            spaces_between_special_tokens=spaces_between_special_tokens)
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


class StreamedTokenOffsets:
    """A streamed choice's tokens with their text offsets, sent only once the stream has sent
    the text they start in.

    A stream holds text back (a stop-string prefix) while its tokens arrive. A token that
    starts in held-back text has an offset past the text sent so far; should a stop string
    then cut that text, the whole response caps the token at the cut text's end, but a
    stream that had sent it could not take it back (its offsets went down and past the
    returned text). So such tokens (with their logprobs) wait; released, each has the offset
    the whole response gives it.

    Args:
        offsets: the choice's ``TokenTextOffsets``.
    """

    def __init__(self, offsets: TokenTextOffsets) -> None:
        self._offsets = offsets
        self._token_ids: list[int] = []
        self._logprobs: list[Any] = []
        self._starts: list[int] = []

    def release(self, token_ids: Sequence[int], logprobs: Sequence[Any], text_sent: int,
                final: bool) -> tuple[list[int], list[Any], list[int]]:
        """Add a delta's ``token_ids`` and their ``logprobs`` entries; returns the tokens to
        send now, their entries and their offsets: those starting within the ``text_sent``
        characters sent so far (this delta's text included), or all of them, capped at
        ``text_sent``, when the choice is ``final``."""
        self._token_ids += token_ids
        self._logprobs += logprobs
        self._starts += self._offsets.next_offsets(token_ids)
        num = len(self._starts) if final else bisect.bisect_right(self._starts, text_sent)
        out = (self._token_ids[:num], self._logprobs[:num],
               [min(start, text_sent) for start in self._starts[:num]])
        del self._token_ids[:num], self._logprobs[:num], self._starts[:num]
        return out
