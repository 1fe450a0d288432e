"""N-gram prompt lookup against a plain-Python reference of the documented rule."""

from __future__ import annotations

import numpy as np
import pytest

from kvflow.spec_decode.ngram import propose_ngram


def reference(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Longest suffix first; among its earlier occurrences (ending before the last token) the
    latest one followed by k tokens, else the earliest; its continuation."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[-n:]
        starts = [i for i in range(len(tokens) - n) if tokens[i:i + n] == suffix]
        if starts:
            full = [i for i in starts if i + n + k <= len(tokens)]
            start = full[-1] if full else starts[0]
            return tokens[start + n:start + n + k]
    return []


@pytest.mark.parametrize("seed", range(40))
def test_matches_the_reference_on_random_histories(seed):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 4 + seed % 5, size=int(rng.integers(1, 60))).tolist()
    k, min_n = int(rng.integers(0, 6)), int(rng.integers(1, 3))
    max_n = min_n + int(rng.integers(0, 3))
    got = propose_ngram(np.array(tokens, np.int64), k, min_n, max_n).tolist()
    assert got == reference(tokens, k, min_n, max_n)


def test_hand_examples():
    t = np.array([1, 2, 3, 4, 5, 9, 1, 2, 3])
    assert propose_ngram(t, 3, 2, 4).tolist() == [4, 5, 9]  # "1 2 3" recurs: what followed
    assert propose_ngram(t, 3, 4, 4).tolist() == []  # no 4-gram recurs
    assert propose_ngram(np.array([1, 2, 3]), 3, 1, 4).tolist() == []  # nothing recurs
    # "3" occurs twice before; the latest followed by 2 tokens wins
    assert propose_ngram(np.array([3, 7, 8, 3, 5, 6, 3]), 2, 1, 1).tolist() == [5, 6]
