"""What the incremental detokenizer (:mod:`kvflow.detokenizer`) reads from a tokenizer: its
added tokens' ids, and the prompt tail the first generated token is decoded after (vLLM 0.32's
``FastIncrementalDetokenizer`` rule)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["added_token_ids", "prompt_context"]

# vLLM's FastIncrementalDetokenizer prompt tail: between 4 and 23 of the prompt's last ids.
_MIN_PROMPT_CONTEXT = 4
_MAX_PROMPT_CONTEXT = 23
_REPLACEMENT_CHAR = "\ufffd"


def added_token_ids(tokenizer: Any) -> frozenset[int]:
    """The ids of ``tokenizer``'s added tokens, special or not (the ``tokenizers`` backend's
    ``get_added_tokens_decoder``, as vLLM reads them; else transformers'
    ``added_tokens_decoder``)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and hasattr(backend, "get_added_tokens_decoder"):
        return frozenset(backend.get_added_tokens_decoder())
    return frozenset(getattr(tokenizer, "added_tokens_decoder", None) or ())


def prompt_context(tokenizer: Any, prompt_token_ids: Sequence[int]) -> list[int]:
    """The prompt ids that the first generated token is decoded after (vLLM 0.32's
    ``FastIncrementalDetokenizer`` rule): the whole prompt when it has at most 4 ids, else its
    last ``i`` ids for the smallest ``i`` in 4..23 whose decode (special tokens skipped) has
    no U+FFFD, else the whole prompt. Empty for an empty prompt and for a tokenizer with a
    WordPiece decoder (see :mod:`kvflow.detokenizer`'s docstring).

    Args:
        tokenizer: A ``transformers`` tokenizer; ``decode`` is called at most 20 times.
        prompt_token_ids: The request's prompt ids (may be empty).

    Returns:
        A new list of ids (a suffix of ``prompt_token_ids``).
    """
    ids = list(prompt_token_ids)
    if not ids or _has_wordpiece_decoder(tokenizer):
        return []
    if len(ids) <= _MIN_PROMPT_CONTEXT:
        return ids
    for i in range(_MIN_PROMPT_CONTEXT, min(len(ids), _MAX_PROMPT_CONTEXT) + 1):
        if _REPLACEMENT_CHAR not in tokenizer.decode(ids[-i:], skip_special_tokens=True):
            return ids[-i:]
    return ids


def _has_wordpiece_decoder(tokenizer: Any) -> bool:
    """Whether ``tokenizer`` decodes WordPiece-style (a fast tokenizer's ``WordPiece``
    decoder, or a slow BERT-style tokenizer's ``wordpiece_tokenizer``)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    if decoder is not None:
        return type(decoder).__name__ == "WordPiece"
    return hasattr(tokenizer, "wordpiece_tokenizer")
