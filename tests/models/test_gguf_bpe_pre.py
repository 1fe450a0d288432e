"""Byte-level GGUF vocabularies whose llama.cpp pre-tokenizer splits digits one by one
(``tokenizer.ggml.pre`` ``smollm``, ``starcoder``, ...). Oracle: a ``tokenizers`` BPE built
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
