"""What the incremental detokenizer (:mod:`kvflow.engine.detokenizer`) reads from a tokenizer: its
added tokens' ids, the prompt tail the first generated token is decoded after (vLLM 0.32's
``FastIncrementalDetokenizer`` rule), and the ids -> text call it makes on every step."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["added_token_ids", "id_decoder", "prompt_context"]

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


def id_decoder(tokenizer: Any, skip_special_tokens: bool) -> Callable[[list[int]], str]:
    """``ids -> tokenizer.decode(ids, skip_special_tokens=...)``, by the shortest route that
    gives the same text.

    A transformers 5 fast tokenizer (``TokenizersBackend``) whose ``decode`` / ``_decode``
    no subclass overrides and that does no ``clean_up_tokenization_spaces`` decodes a list
    of ids with its ``tokenizers`` backend's ``decode`` and nothing else; the wrapper around
    it (argument conversion, batch detection, keyword handling) cost about as much again as
    the decode itself (6 us a call), and the detokenizer decodes once or twice per request
    per step. Any other tokenizer (slow, transformers 4, GGUF or a subclass) keeps its own
    ``decode``.

    Args:
        tokenizer: the request's tokenizer.
        skip_special_tokens: passed to every decode.

    Returns:
        A function of a list of ids (Python or numpy integers) returning their text.
    """
    if _plain_fast_decode(tokenizer):
        backend_decode = tokenizer._tokenizer.decode
        return lambda ids: backend_decode(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def _plain_fast_decode(tokenizer: Any) -> bool:
    """Whether ``tokenizer.decode(ids, skip_special_tokens=s)`` is exactly its ``tokenizers``
    backend's ``decode(ids, skip_special_tokens=s)`` (see :func:`id_decoder`)."""
    try:
        from tokenizers import Tokenizer
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # transformers 4 (PreTrainedTokenizerFast): its own decode
        return False
    cls = type(tokenizer)
    return isinstance(tokenizer, TokenizersBackend) and \
        isinstance(getattr(tokenizer, "_tokenizer", None), Tokenizer) and \
        cls.decode is PreTrainedTokenizerBase.decode and \
        cls._decode is TokenizersBackend._decode and \
        not getattr(tokenizer, "clean_up_tokenization_spaces", False)


def prompt_context(tokenizer: Any, prompt_token_ids: Sequence[int]) -> list[int]:
    """The prompt ids that the first generated token is decoded after (vLLM 0.32's
    ``FastIncrementalDetokenizer`` rule): the whole prompt when it has at most 4 ids, else its
    last ``i`` ids for the smallest ``i`` in 4..23 whose decode (special tokens skipped) has
    no U+FFFD, else the whole prompt. Empty for an empty prompt and for a tokenizer with a
    WordPiece decoder (see :mod:`kvflow.engine.detokenizer`'s docstring).

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
