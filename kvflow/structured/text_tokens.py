"""The vocabulary as a text grammar sees it: special tokens spell no text.

xgrammar (0.2.9) reads a Hugging Face vocabulary with every token's text, the special ones
included (``<|im_start|>``, ``<bos>``, ``<eos>``): a grammar that accepts the characters of
that text accepted the special token. The detokenizer then skips it (``skip_special_tokens``,
the default), so the output is not what the grammar matched: on the tiny test model the regex
``<[^>]{1,6}>`` took ``<bos>`` then the stop token and returned the empty text, and the stop
token itself was taken as the text ``<eos>``; SmolLM2's ``<|im_start|>`` fits any JSON string.
:func:`text_tokenizer_info` gives such tokens no text, so a grammar never allows one (the stop
token still ends a complete match); structural tags keep xgrammar's own reading, since their
``token`` formats name special tokens and their triggers may be one.
"""

from __future__ import annotations

from typing import Any

import xgrammar as xgr


def special_token_ids(tokenizer: Any) -> set[int]:
    """The ids the detokenizer skips: the tokenizer's special tokens (``all_special_ids``)
    and its added tokens marked special."""
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    return {i for i, token in added.items() if getattr(token, "special", False)} | set(
        getattr(tokenizer, "all_special_ids", ()))


def text_tokenizer_info(info: xgr.TokenizerInfo, special: set[int]) -> xgr.TokenizerInfo:
    """``info`` with the tokens of ``special`` spelling no text (xgrammar then never lets a
    grammar take one; a stop token among them still ends a complete match). ``info`` itself
    when ``special`` is empty."""
    if not special:
        return info
    vocab = [b"" if i in special else text for i, text in enumerate(info.decoded_vocab)]
    return xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=info.vocab_size,
                             stop_token_ids=info.stop_token_ids)
