"""CPU-heavy request preprocessing kept off the server's event loop, and the cheap refusal of a
text prompt that is certainly longer than the context before all of it is tokenized.

Tokenizing megabytes of text takes seconds (the tiny test tokenizer: ~1.7 s per MB); done on
the event loop, it stalls every other client and ``/health`` meanwhile. :func:`off_loop` runs
such work in a worker thread when its input is big (a fast tokenizer's Rust core releases
the GIL while it encodes), and inline when it is small (a thread hop costs more than
tokenizing a few kilobytes), so the per-request path of ordinary requests is unchanged.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

# Inputs up to this many characters (or token ids) are processed inline on the event loop.
INLINE_CHARS = 16384
# The pre-check tokenizes at most max(PREFIX_MIN_CHARS, PREFIX_CHARS_PER_TOKEN * limit)
# characters of a prompt (a prompt no longer than that is tokenized whole, as before).
PREFIX_CHARS_PER_TOKEN = 16
PREFIX_MIN_CHARS = 1 << 16
# Tokens the prefix must exceed the limit by: covers what a cut can change at its end (an
# added token such as "<|im_start|>" cut in two, a combining mark cut from its letter).
PREFIX_SLACK_TOKENS = 64


async def off_loop(size: int, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)``: in a worker thread (``asyncio.to_thread``) when ``size`` (characters or
    token ids of the input) is above ``INLINE_CHARS``, else inline. Exceptions propagate
    as raised. Cancelling the awaiting task leaves the thread to finish on its own (its
    result is dropped; the caller has queued nothing yet)."""
    if size <= INLINE_CHARS:
        return fn(*args)
    return await asyncio.to_thread(fn, *args)


class PromptTooLong(ValueError):
    """A text prompt whose first ``chars`` characters alone are ``num_tokens`` tokens, more
    than the ``limit`` the context (max_model_len) leaves a prompt; the rest was not
    tokenized."""

    def __init__(self, num_tokens: int, chars: int, total_chars: int, limit: int) -> None:
        super().__init__(f"the prompt is longer than the {limit} tokens this model's context "
                         f"(max_model_len) leaves it: its first {chars} of {total_chars} "
                         f"characters are already {num_tokens} tokens (the rest was not "
                         "tokenized)")
        self.num_tokens, self.chars = num_tokens, chars


def encode_checked(tokenizer: Any, text: str, limit: int, add_special_tokens: bool
                   ) -> list[int]:
    """``tokenizer.encode(text)``, unless the text certainly has more than ``limit`` tokens,
    which a tokenized prefix shows (see :func:`prefix_tokens_over`).

    Raises:
        PromptTooLong: when a prefix of the text alone has more than ``limit`` tokens.
    """
    found = prefix_tokens_over(tokenizer, text, limit, add_special_tokens)
    if found is not None:
        raise PromptTooLong(*found, len(text), limit)
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


def prefix_tokens_over(tokenizer: Any, text: str, limit: int, add_special_tokens: bool
                       ) -> tuple[int, int] | None:
    """``(n, c)`` when the first ``c`` characters of ``text`` tokenize to ``n`` tokens and
    that proves the whole text has more than ``limit`` tokens; None when the text is short
    enough to tokenize whole (at most ``max(PREFIX_MIN_CHARS, PREFIX_CHARS_PER_TOKEN *
    limit)`` characters) or the prefix proves nothing.

    Characters alone bound nothing (one token may cover hundreds of them; a normalizer may
    drop some), so the prefix is tokenized. A prefix's tokens are not always the first
    tokens of the whole text either: where it is cut, a word may split differently. The cut
    is made where the tokenizer's own pre-tokenizer (``backend_tokenizer.pre_tokenizer``)
    starts a piece, two pieces before the end of the prefix. HF tokenizers split text into
    such pieces left to right (a regex or whitespace match, decided by the characters up to
    its end and one after) and tokenize each piece on its own (BPE, WordPiece and Unigram
    alike), so the pieces before that cut, and their tokens, are the same in the whole
    text: it has at least as many tokens as the prefix, less ``PREFIX_SLACK_TOKENS`` for
    what the cut can change at its end (an added token cut in two). A tokenizer without a
    pre-tokenizer (Llama 2's legacy SentencePiece BPE: the whole text is one piece) or with
    fewer than three pieces in the prefix (one giant word) gets None: tokenize the whole.
    """
    prefix_chars = max(PREFIX_MIN_CHARS, PREFIX_CHARS_PER_TOKEN * limit)
    if len(text) <= prefix_chars:
        return None
    pre_tokenizer = getattr(getattr(tokenizer, "backend_tokenizer", None), "pre_tokenizer",
                            None)
    if pre_tokenizer is None:
        return None
    pieces = pre_tokenizer.pre_tokenize_str(text[:prefix_chars])
    if len(pieces) < 3:
        return None
    cut = pieces[-2][1][0]  # the start of the second-to-last piece
    num_tokens = len(tokenizer.encode(text[:cut], add_special_tokens=add_special_tokens))
    return (num_tokens, cut) if num_tokens > limit + PREFIX_SLACK_TOKENS else None
