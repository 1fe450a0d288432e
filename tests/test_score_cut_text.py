"""``kvflow.inputs.score.cut_text``: /v1/score's and /v1/rerank's ``max_tokens_per_query`` /
``max_tokens_per_doc`` cut (vLLM 0.32's ``truncate_text_to_tokens``): a text cut to its first
N tokens at a character boundary. Oracles: the tokenizer's own ids of the whole text (the cut
text tokenizes to their first N) and its character offsets; a slow tokenizer's decode of the
first N ids."""

from __future__ import annotations

import pytest

from kvflow.inputs.score import cut_text
from tests.models.cross_encoder_models import bert_tokenizer

TEXT = "the quick brown fox jumps over a lazy dog"


@pytest.mark.parametrize("which", ["bpe", "wordpiece"])
def test_cut_text_keeps_the_first_tokens(which, tiny_tokenizer):
    tok = tiny_tokenizer if which == "bpe" else bert_tokenizer()
    ids = tok(TEXT, add_special_tokens=False)["input_ids"]
    offsets = tok(TEXT, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    assert len(ids) > 4
    for n in (1, 2, 4, len(ids) - 1):
        cut = cut_text(TEXT, tok, n)
        assert TEXT.startswith(cut) and len(cut) <= offsets[n - 1][1]
        assert tok(cut, add_special_tokens=False)["input_ids"] == ids[:n], (n, cut)
    assert cut_text(TEXT, tok, len(ids)) == TEXT  # fits: as sent
    assert cut_text(TEXT, tok, 10 * len(ids)) == TEXT


def test_cut_text_with_a_slow_tokenizer_decodes_the_first_ids(tiny_tokenizer):
    class Slow:  # no offsets: encode / decode only
        is_fast = False

        def encode(self, text, add_special_tokens=True):
            return tiny_tokenizer.encode(text, add_special_tokens=add_special_tokens)

        def decode(self, ids):
            return tiny_tokenizer.decode(ids)

    ids = tiny_tokenizer.encode(TEXT, add_special_tokens=False)
    assert cut_text(TEXT, Slow(), 3) == tiny_tokenizer.decode(ids[:3])
    assert cut_text(TEXT, Slow(), len(ids)) == TEXT
    with pytest.raises(ValueError, match="max_tokens=0"):
        cut_text(TEXT, Slow(), 0)
