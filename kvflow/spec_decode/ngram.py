"""N-gram prompt-lookup proposals (no model).

Prompt lookup decoding (Saxena 2023, "Prompt Lookup Decoding"; vLLM's ``ngram`` method): when
a request's last ``n`` tokens occurred earlier in its prompt or output, the tokens that
followed that occurrence are a good guess for what follows now. Outputs that copy from their
input (editing, summarizing or refactoring a given text, code completion inside a file) accept
long runs of such guesses. Sizes are tried from ``max_n`` down to ``min_n``. Among the earlier
occurrences of the suffix, the latest one followed by ``num_tokens`` tokens wins (the nearest
context is the likeliest to repeat); when none is, the earliest (the longest continuation).
"""

from __future__ import annotations

import numpy as np


def propose_ngram(token_ids: np.ndarray, num_tokens: int, min_n: int, max_n: int) -> np.ndarray:
    """Up to ``num_tokens`` draft tokens continuing ``token_ids``.

    Args:
        token_ids: int64 [L], the request's prompt and output so far.
        num_tokens: most draft tokens wanted (>= 0).
        min_n / max_n: n-gram sizes tried, longest first (1 <= min_n <= max_n).

    Returns:
        int64 [<= num_tokens]: the tokens that followed an earlier occurrence of the longest
        recurring suffix (see the module docstring); empty when no suffix of ``min_n`` or more
        tokens recurs.
    """
    length = len(token_ids)
    if num_tokens <= 0:
        return token_ids[:0]
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        starts = _matches(token_ids, n)
        if len(starts):
            full = starts[starts + n + num_tokens <= length]
            start = int(full[-1]) if len(full) else int(starts[0])
            return token_ids[start + n:start + n + num_tokens]
    return token_ids[:0]


def _matches(token_ids: np.ndarray, n: int) -> np.ndarray:
    """Starts (increasing int64) of the earlier occurrences of the last ``n`` tokens that end
    before the last token (so at least one token follows each)."""
    length = len(token_ids)
    pattern = token_ids[length - n:]
    # candidates: windows [i, i + n) with i + n <= length - 1, first token matching
    starts = np.flatnonzero(token_ids[:length - n] == pattern[0])
    for k in range(1, n):
        if not len(starts):
            break
        starts = starts[token_ids[starts + k] == pattern[k]]
    return starts
