"""The text of one token in a logprobs entry (``Logprob.decoded_token``), as vLLM 0.32 writes
it (``convert_ids_list_to_tokens`` and ``LogprobsProcessor._verify_tokens``).

Each id is decoded alone, then two corrections apply:

* Leading spaces: a SentencePiece-style tokenizer (a ``Metaspace`` pre-tokenizer) strips the
  leading space of the first token of a decode, so ``"▁Paris"`` alone decodes to ``"Paris"``;
  the spaces the raw piece starts with (its leading ``▁`` markers) are put back: ``" Paris"``.
* Split characters: a token holding part of a multi-byte UTF-8 character decodes to text
  ending in U+FFFD. It is decoded again after the 1..4 tokens sampled before it (the
  *context*); the first such decode not ending in U+FFFD gives the token's text (what it adds
  to the context's complete text); when none does (the character is still incomplete), the
  text is ``""``. So a 4-byte emoji split over 4 tokens reads ``"", "", "", "🙂"``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

__all__ = ["LogprobTokenTexts", "leading_space_marker"]

_REPLACEMENT_CHAR = "\ufffd"
# Tokens sampled before a position that may complete its character (UTF-8: at most 4 bytes).
MAX_CONTEXT_TOKENS = 4


def leading_space_marker(tokenizer: Any) -> str | None:
    """The space marker of ``tokenizer``'s ``Metaspace`` pre-tokenizer (``"▁"`` unless its
    ``replacement`` says otherwise), also inside a ``Sequence``; None for any other
    pre-tokenizer or a tokenizer without a ``tokenizers`` backend (its single-token decode
    keeps leading spaces)."""
    pre_tokenizer = getattr(getattr(tokenizer, "backend_tokenizer", None), "pre_tokenizer", None)
    if pre_tokenizer is None:
        return None
    try:  # the pre-tokenizer's own JSON (the whole tokenizer's is megabytes)
        pre = json.loads(pre_tokenizer.__getstate__())
    except (ValueError, TypeError, AttributeError):
        return None
    candidates = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    for sub in candidates:
        if isinstance(sub, dict) and sub.get("type") == "Metaspace":
            return sub.get("replacement", "▁")
    return None


class LogprobTokenTexts:
    """Writes the ``decoded_token`` of logprob entries for one tokenizer.

    Args:
        tokenizer: a ``transformers`` tokenizer (``decode`` and ``convert_ids_to_tokens``
            are used; the backend's pre-tokenizer is read once, on first use).
    """

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._marker: str | None = None
        self._marker_read = False

    def texts(self, token_ids: Sequence[int], context: Sequence[int]) -> list[str]:
        """The text of each of ``token_ids`` (alternatives at one position).

        Args:
            token_ids: ids at one position (the sampled or prompt token, then the top-k).
            context: the ids sampled (or prompted) at the positions before, oldest first;
                only the last :data:`MAX_CONTEXT_TOKENS` are read.

        Returns:
            One ``str`` per id (``""`` for an id the tokenizer does not know).
        """
        decode = self._tokenizer.decode
        texts = [decode([tid]) or "" for tid in token_ids]
        marker = self._leading_space_marker()
        if marker is not None:
            raws = self._tokenizer.convert_ids_to_tokens(list(token_ids))
            texts = [_restore_leading_spaces(raw or "", text, marker)
                     for raw, text in zip(raws, texts)]
        context = list(context[-MAX_CONTEXT_TOKENS:])
        return [self._complete(tid, context) if text.endswith(_REPLACEMENT_CHAR) else text
                for tid, text in zip(token_ids, texts)]

    def _leading_space_marker(self) -> str | None:
        if not self._marker_read:
            self._marker, self._marker_read = leading_space_marker(self._tokenizer), True
        return self._marker

    def _complete(self, token_id: int, context: list[int]) -> str:
        """The text ``token_id`` adds after the shortest tail of ``context`` that completes
        its character; ``""`` when no tail does."""
        decode = self._tokenizer.decode
        for size in range(1, len(context) + 1):
            window = context[-size:]
            full = decode([*window, token_id])
            if full.endswith(_REPLACEMENT_CHAR):
                continue
            # Context tokens that are themselves partial characters belong to this one.
            clean_end = len(window)
            while clean_end > 0 and decode([window[clean_end - 1]]).endswith(_REPLACEMENT_CHAR):
                clean_end -= 1
            prefix = decode(window[:clean_end]) if clean_end else ""
            if full.startswith(prefix):
                return full[len(prefix):]
            common = 0
            for a, b in zip(prefix, full):
                if a != b:
                    break
                common += 1
            return full[common:]
        return ""


def _restore_leading_spaces(raw_token: str, text: str, marker: str) -> str:
    """``text`` with a space in front for each leading ``marker`` of ``raw_token`` that the
    decode dropped."""
    markers = len(raw_token) - len(raw_token.lstrip(marker))
    missing = markers - (len(text) - len(text.lstrip(" ")))
    return " " * missing + text if missing > 0 else text
