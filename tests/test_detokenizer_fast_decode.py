"""The detokenizer's per-step decode goes straight to a fast tokenizer's ``tokenizers``
backend when that gives the same text as ``tokenizer.decode`` (kvflow.engine.detokenizer_tokens.
id_decoder), and keeps ``tokenizer.decode`` otherwise. Oracle: transformers' own
``tokenizer.decode`` of the same ids."""

from __future__ import annotations

import pytest

from kvflow import SamplingParams
from kvflow.engine.detokenizer import IncrementalDetokenizer
from kvflow.engine.detokenizer_tokens import id_decoder


@pytest.fixture
def tokenizer(smollm2_llm):
    return smollm2_llm.get_tokenizer()  # transformers 5 TokenizersBackend, byte-level BPE


class CountingDecode:
    """Wraps ``tokenizer.decode`` on the instance (its class's method stays the plain one),
    counting the calls."""

    def __init__(self, tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls, original = 0, tokenizer.decode

        def decode(*args, **kwargs):
            self.calls += 1
            return original(*args, **kwargs)
        monkeypatch.setattr(tokenizer, "decode", decode)


# ids of <|endoftext|>, <|im_start|>, <|im_end|> (special), words, and the byte-level pieces
# of an emoji split over two tokens (each alone decodes to U+FFFD)
IDS = [[1, 9690, 198, 19556, 2], [0, 504, 3575, 282, 4649, 314], [], [216], [47, 1, 48]]


@pytest.mark.parametrize("skip", [True, False])
def test_id_decoder_gives_decode_text(tokenizer, skip):
    emoji = tokenizer.encode("🙂 ok", add_special_tokens=False)
    decode = id_decoder(tokenizer, skip)
    for ids in [*IDS, emoji, emoji[:1]]:
        assert decode(ids) == tokenizer.decode(ids, skip_special_tokens=skip), ids


def test_detokenizer_steps_skip_the_transformers_wrapper(tokenizer, monkeypatch):
    prompt = tokenizer.encode("The capital of France is", add_special_tokens=False)
    generated = tokenizer.encode(" Paris. 🙂 It is big.", add_special_tokens=False)
    counting = CountingDecode(tokenizer, monkeypatch)
    detok = IncrementalDetokenizer(tokenizer, prompt)
    counting.calls = 0  # the prompt tail's choice may decode through it (once per request)
    text = "".join(detok.update([i], finished=n == len(generated) - 1).text
                   for n, i in enumerate(generated))
    assert text == " Paris. 🙂 It is big."
    assert counting.calls == 0


def test_cleanup_tokenizer_keeps_its_decode(tokenizer, monkeypatch):
    monkeypatch.setattr(tokenizer, "clean_up_tokenization_spaces", True)
    counting = CountingDecode(tokenizer, monkeypatch)
    assert id_decoder(tokenizer, True)([19556, 30]) == tokenizer.decode([19556, 30])
    assert counting.calls == 2


def test_subclass_decode_is_kept(tokenizer):
    class Shouting(type(tokenizer)):
        def decode(self, ids, **kwargs):
            return super().decode(ids, **kwargs).upper()
    shouting = Shouting.__new__(Shouting)
    shouting.__dict__.update(tokenizer.__dict__)
    assert id_decoder(shouting, True)([19556]) == tokenizer.decode([19556]).upper()


def test_engine_text_is_the_ids_decode(smollm2_llm, tokenizer):
    prompts = ["The capital of France is", "Write a haiku about the sea:", "1, 2, 3,",
               "Emoji of a smiling face:"]
    outputs = smollm2_llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0))
    for out in outputs:
        ids = out.outputs[0].token_ids
        assert len(ids) > 0
        assert out.outputs[0].text == tokenizer.decode(ids, skip_special_tokens=True)
