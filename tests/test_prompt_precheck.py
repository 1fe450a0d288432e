"""The prompt-length pre-check (kvflow/entrypoints/preprocess.py) is sound: whenever a
tokenized prefix refuses a text, the tokenizer's own count of the whole text is over the
limit too, and the count it reports is the tokenizer's count of the prefix it names. Oracle:
the tokenizer itself, on texts built to stress the cut (runs of spaces and newlines, digits,
punctuation, combining marks, added tokens, one giant word)."""

from __future__ import annotations

import random

import pytest

from kvflow.entrypoints.preprocess import (
    PREFIX_MIN_CHARS,
    PromptTooLong,
    encode_checked,
    prefix_tokens_over,
)

LIMIT = 200


def _texts(seed: int) -> list[str]:
    rng = random.Random(seed)
    pieces = ["the", "quick", "fox", "kvflow", " ", "  ", "\n", "\n\n", " \n ", "123", "4567",
              ",", "!?", "e\u0301", "\u00e9", "<eos>", "<bos>", "\t", "x" * 50]
    mixed = "".join(rng.choice(pieces) for _ in range(20000))
    return [mixed, "the quick brown fox " * 5000, "a" * 100 + " " + "b" * 90000,
            "<eos>" * 30000]


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("special", [False, True])
def test_refusal_is_sound(tiny_tokenizer, seed, special):
    decided = 0
    for text in _texts(seed):
        found = prefix_tokens_over(tiny_tokenizer, text, LIMIT, special)
        if found is None:
            continue
        decided += 1
        num_tokens, chars = found
        assert num_tokens == len(tiny_tokenizer.encode(text[:chars], add_special_tokens=special))
        assert len(tiny_tokenizer.encode(text, add_special_tokens=special)) > LIMIT
        with pytest.raises(PromptTooLong, match=f"first {chars} of {len(text)} characters"):
            encode_checked(tiny_tokenizer, text, LIMIT, special)
    assert decided >= 3  # the giant word alone is undecided


def test_short_text_and_giant_word_are_tokenized_whole(tiny_tokenizer):
    """Up to PREFIX_MIN_CHARS characters the pre-check stays out of it; a text whose prefix
    is one piece proves nothing; both get the tokenizer's own ids."""
    short = "the quick fox " * (PREFIX_MIN_CHARS // 14)
    word = "x" * (PREFIX_MIN_CHARS + 10)
    for text in (short, word):
        assert prefix_tokens_over(tiny_tokenizer, text, LIMIT, True) is None
        assert encode_checked(tiny_tokenizer, text, LIMIT, True) == tiny_tokenizer.encode(text)


def test_without_a_pre_tokenizer_nothing_is_decided(tiny_tokenizer):
    """Llama 2's legacy tokenizers have no pre-tokenizer (the whole text is one piece): no
    cut is sound, so the text is tokenized whole."""
    class NoPreTokenizer:
        backend_tokenizer = type("Backend", (), {"pre_tokenizer": None})()
        encode = staticmethod(tiny_tokenizer.encode)

    text = "the quick brown fox " * 10000
    assert prefix_tokens_over(NoPreTokenizer(), text, LIMIT, True) is None
    assert prefix_tokens_over(tiny_tokenizer, text, LIMIT, True) is not None
