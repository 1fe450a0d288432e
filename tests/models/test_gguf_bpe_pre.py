"""Byte-level GGUF vocabularies whose llama.cpp pre-tokenizer transformers does not convert:
digits split one by one (``tokenizer.ggml.pre`` ``smollm``, ``starcoder``, ...), DeepSeek below. Oracle: a ``tokenizers`` BPE built
directly with the same vocabulary and merges and the pre-tokenizer of those models' HF
``tokenizer.json`` (``Digits(individual_digits=True)`` + ``ByteLevel``). Before: GPT-2's regex
alone, so a vocabulary with a ``\\u0120`` + digit merge encoded " 12" as two tokens, not three."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from kvflow.models.gguf_tokenizer import load_gguf_tokenizer

gguf = pytest.importorskip("gguf")
tokenizers = pytest.importorskip("tokenizers")

G = "\u0120"  # byte-level space
VOCAB = ["<|endoftext|>", G, "1", "2", "3", "a", "b", G + "1", "12", G + "a", "ab", G + "ab"]
MERGES = [f"{G} 1", "1 2", f"{G} a", "a b", f"{G}a b"]
TEXTS = [" 12", "a 123 ab", "ab12 b", " 1 2 3", "3a"]


def _write(path, pre: str) -> str:
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(VOCAB)
    w.add_token_types([3] + [1] * (len(VOCAB) - 1))
    w.add_token_merges(MERGES)
    w.add_bos_token_id(0)
    w.add_eos_token_id(0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def _oracle(split_digits: bool):
    from tokenizers import Tokenizer, models, pre_tokenizers

    bpe = models.BPE({t: i for i, t in enumerate(VOCAB)},
                     [tuple(m.split(" ")) for m in MERGES])
    tok = Tokenizer(bpe)
    steps = [pre_tokenizers.Digits(individual_digits=True)] if split_digits else []
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [*steps, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    return tok


@pytest.mark.parametrize("pre,split_digits", [("smollm", True), ("starcoder", True),
                                              ("gpt2", False)])
def test_digit_splitting_pre_tokenizers(tmp_path, monkeypatch, pre, split_digits):
    monkeypatch.setenv("KVFLOW_CACHE_DIR", str(tmp_path / "cache"))
    tokenizer = load_gguf_tokenizer(_write(tmp_path / f"{pre}.gguf", pre))
    oracle = _oracle(split_digits)
    for text in TEXTS:
        assert tokenizer.encode(text, add_special_tokens=False) == oracle.encode(text).ids, text
        assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text
    assert len(oracle.encode(" 12").ids) == (3 if split_digits else 2)


# DeepSeek LLM / Coder (tokenizer.ggml.pre "deepseek-llm" / "deepseek-coder"): a byte-level
# alphabet plus merges that join what GPT-2's regex keeps together (" 12", "):") and what it
# cuts apart. Oracle: tokenizers configured as those models' HF tokenizer.json (the Split
# regexes written out here, Digits for \p{N}); the pieces of two texts are hand-counted.
ALPHABET = sorted(tokenizers.pre_tokenizers.ByteLevel.alphabet())
DS_MERGES = [f"{G} 1", "1 2", f"{G}1 2", ") :", "d e", "de f", f"{G} r", f"{G}r e", "2 0",
             "20 2", "202 4", f"{G} {G}", "H e", "He l", "Hel l", "Hell o"]
DS_VOCAB = ALPHABET + [a + b for a, b in (m.split(" ") for m in DS_MERGES)]
DS_TEXTS = ["def f(x):\n  return 12", "Hello, w\u00f6rld 2024!\n", "a+=1 2024 ", "x  \n\ny",
            "\u03a9mega \u03a9\u03bc\u03ad\u03b3\u03b1 12", "\u05e9\u05dc\u05d5\u05dd 12",
            "\u4f60\u597d \uc138\uacc4123", "it's  (ok)...", "na\u00efve caf\u00e9\t12"]
CJK = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
DS_SPLITS = {
    "deepseek-coder": (["[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", CJK], True),
    "deepseek-llm": (["[\r\n]", r"\s?[\p{Lu}\p{Ll}\p{Lt}]+",
                      "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
                      r"\s+$", CJK], False),
}


def _deepseek_oracle(pre: str):
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    regexes, individual_digits = DS_SPLITS[pre]
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(DS_VOCAB)},
                               [tuple(m.split(" ")) for m in DS_MERGES]))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [*(pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes),
         pre_tokenizers.Digits(individual_digits=individual_digits),
         pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    return tok


def _write_deepseek(path, pre: str | None) -> str:
    """A vocabulary-only GGUF with the test BPE vocabulary; ``pre=None`` writes no
    ``tokenizer.ggml.pre`` key."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("gpt2")
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list(DS_VOCAB)
    w.add_token_types([1] * len(DS_VOCAB))
    w.add_token_merges(DS_MERGES)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


@pytest.mark.parametrize("pre, pieces", [
    ("deepseek-coder", ("def f(x):\n  return 12",
                        ["def", " f", "(", "x", "):", "\n", " ", " return", " ", "1", "2"])),
    ("deepseek-llm", ("Hello, w\u00f6rld 2024!\n",
                      # ":-~" spans ASCII letters too: " w\u00f6rld" is cut again at "\u00f6"
                      ["Hello", ",", " w", "\u00f6", "rld", " ", "2024", "!", "\n"])),
])
def test_deepseek_pre_tokenizers_match_their_tokenizer_json(tmp_path, monkeypatch, pre, pieces):
    """Before: GPT-2's regex (" 12" one piece, so ``\\u0120`` + "12" one token)."""
    monkeypatch.setenv("KVFLOW_CACHE_DIR", str(tmp_path / "cache"))
    tokenizer = load_gguf_tokenizer(_write_deepseek(tmp_path / f"{pre}.gguf", pre))
    backend = tokenizer.backend_tokenizer
    byte_level = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    text, expected = pieces
    expected = [p for piece in expected for p, _ in byte_level.pre_tokenize_str(piece)]
    assert [p for p, _ in backend.pre_tokenizer.pre_tokenize_str(text)] == expected
    oracle = _deepseek_oracle(pre)
    for text in DS_TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert ids == oracle.encode(text).ids, text
        assert tokenizer.decode(ids) == text


@pytest.mark.parametrize("pre, text, pieces", [
    # Qwen2's regex (StableLM 2, Hunyuan, Grok 2): digits one by one, "'s" kept with no letter
    ("stablelm2", "it's 2024!", ["it", "'s", " ", "2", "0", "2", "4", "!"]),
    # BLOOM / Poro / GPT-3 Finnish: cut only at spaces and .,!?
    ("bloom", "x+=y, 12!", ["x+=y", ",", " 12", "!"]),
    ("viking", "x+=y, 12!", ["x+=y", ",", " ", "1", "2", "!"]),
    # DeepSeek V3: digits in threes first, CJK runs apart, punctuation+letters together
    ("deepseek-v3", "12345.ab \u4f60\u597d", ["123", "45", ".ab", " ", "\u4f60\u597d"]),
    ("minerva-7b", " 12", [" ", "1", "2"]),
])
def test_other_llama_cpp_pre_tokenizers(tmp_path, monkeypatch, pre, text, pieces):
    """Hand-counted pieces of llama.cpp's regexes for these values. Before: GPT-2's regex
    (" 12" one piece, "x+=y" three)."""
    monkeypatch.setenv("KVFLOW_CACHE_DIR", str(tmp_path / "cache"))
    tokenizer = load_gguf_tokenizer(_write_deepseek(tmp_path / "p.gguf", pre))
    byte_level = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    expected = [p for piece in pieces for p, _ in byte_level.pre_tokenize_str(piece)]
    got = tokenizer.backend_tokenizer.pre_tokenizer.pre_tokenize_str(text)
    assert [p for p, _ in got] == expected
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text


@pytest.mark.parametrize("pre", ["kimi-k2", "no-such-pre"])
def test_pre_tokenizer_kvflow_cannot_reproduce_is_refused(tmp_path, monkeypatch, pre):
    """llama.cpp splits kimi-k2 with custom code and refuses unknown values; before, kvflow
    used GPT-2's regex for both."""
    monkeypatch.setenv("KVFLOW_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(ValueError, match=rf"'tokenizer.ggml.pre' is '{pre}', a pre-tokenizer "
                                         r"kvflow does not reproduce.*--tokenizer"):
        load_gguf_tokenizer(_write_deepseek(tmp_path / "p.gguf", pre))


# llama.cpp's "default" list (LLAMA_VOCAB_PRE_TYPE_DEFAULT, what it uses when the key is
# absent): a punctuation run, GPT-2's word rule, digit runs, then digits in threes.
DEFAULT_SPLITS = [r"[\p{P}\$\+<=>\^~\|]+",
                  r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
                  r"\p{N}+", "[0-9][0-9][0-9]"]


def test_missing_pre_is_llama_cpp_default(tmp_path, monkeypatch, caplog):
    """No ``tokenizer.ggml.pre``: llama.cpp splits with its "default" regexes and warns.
    Before: GPT-2's regex (" 12345" one piece, "'s" kept together), no warning."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    monkeypatch.setenv("KVFLOW_CACHE_DIR", str(tmp_path / "cache"))
    path = _write_deepseek(tmp_path / "nopre.gguf", None)
    with caplog.at_level("WARNING", logger="kvflow.models.gguf_tokenizer"):
        tokenizer = load_gguf_tokenizer(str(path))
    warnings = [r for r in caplog.records if "tokenizer.ggml.pre" in r.getMessage()]
    assert len(warnings) == 1 and "'default'" in warnings[0].getMessage()
    byte_level = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    pieces = ["it", "'", "s", " x", "+=", "y", ",", " ", "123", "45", "!"]  # hand-counted
    expected = [p for piece in pieces for p, _ in byte_level.pre_tokenize_str(piece)]
    got = tokenizer.backend_tokenizer.pre_tokenizer.pre_tokenize_str("it's x+=y, 12345!")
    assert [p for p, _ in got] == expected
    oracle = Tokenizer(models.BPE({t: i for i, t in enumerate(DS_VOCAB)},
                                  [tuple(m.split(" ")) for m in DS_MERGES]))
    oracle.pre_tokenizer = pre_tokenizers.Sequence(
        [*(pre_tokenizers.Split(Regex(r), behavior="isolated") for r in DEFAULT_SPLITS),
         byte_level])
    for text in [*DS_TEXTS, "it's x+=y, 12345!"]:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert ids == oracle.encode(text).ids, text
        assert tokenizer.decode(ids) == text
