"""The reasoning markers a ``thinking_token_budget`` is counted and ended with, and a grammar
starts after, as token ids: vLLM 0.32's ``ReasoningConfig.initialize_token_ids``.

The strings are a reasoning parser's or vLLM's ``reasoning_config``'s
(:func:`kvflow.config.reasoning.marker_strings`), tokenized once, without special tokens, as
vLLM tokenizes them: a marker may be several tokens (the budget forces them one by one); one
that tokenizes to nothing is refused.
"""

from __future__ import annotations

from typing import Any

from kvflow.config.reasoning import REASONING_CONFIG_KEYS
from kvflow.thinking_budget import ReasoningTokenIds


def marker_token_ids(strings: tuple[str, str] | None, tokenizer: Any
                     ) -> ReasoningTokenIds | None:
    """``strings`` (start, end) tokenized without special tokens (vLLM's
    ``tokenizer.encode(s, add_special_tokens=False)``), the end marker also the natural end;
    None without strings.

    Raises:
        ValueError: without a tokenizer (``skip_tokenizer_init``), or for a marker that
            tokenizes to no token, naming it (vLLM's "failed to tokenize reasoning strings").
    """
    if strings is None:
        return None
    if tokenizer is None:
        raise ValueError(f"the reasoning markers {strings[0]!r} / {strings[1]!r} need a "
                         "tokenizer (skip_tokenizer_init is set)")
    ids = []
    for key, text in zip(REASONING_CONFIG_KEYS, strings):
        tokens = list(tokenizer.encode(text, add_special_tokens=False))
        if not tokens:
            raise ValueError(f"the reasoning marker {key}={text!r} tokenizes to no token of "
                             "this model's vocabulary")
        ids.append(tokens)
    return ReasoningTokenIds(ids[0], ids[1])
