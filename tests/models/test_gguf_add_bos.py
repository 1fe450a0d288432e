"""A byte-level GGUF vocabulary without ``tokenizer.ggml.add_bos_token`` gets a BOS where llama.cpp
gives one by default: ``tokenizer.ggml.pre`` ``llama-bpe`` / ``llama3`` / ``tekken`` ...
(``llama_vocab::impl::load`` in llama-vocab.cpp sets ``add_bos = true`` for them; the key, when
present, decides). Oracle: a ``tokenizers`` BPE of the same vocabulary with the post-processor
of Llama 3's own ``tokenizer.json`` (``TemplateProcessing`` prepending ``<|begin_of_text|>``).
Before: transformers' GGUF conversion added no BOS when the key was absent, so a Llama 3 GGUF
converted without it (before gguf-py read the BOS from the post-processor) ran every prompt
without the BOS the model was trained with."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from kvflow.models.gguf_tokenizer import load_gguf_tokenizer

gguf = pytest.importorskip("gguf")
tokenizers = pytest.importorskip("tokenizers")

G = "\u0120"  # byte-level space
VOCAB = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", G, "a", "b", "h", "i", G + "a",
         "ab", "hi", G + "ab"]
MERGES = [f"{G} a", "a b", "h i", f"{G}a b"]
TEXTS = ["hi ab", " ab", "a", ""]


def _write(path, pre: str, add_bos: bool | None) -> str:
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(VOCAB)
    w.add_token_types([3, 3, 3] + [1] * (len(VOCAB) - 3))
    w.add_token_merges(MERGES)
    w.add_bos_token_id(0)
    w.add_eos_token_id(2)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def _oracle(with_bos: bool):
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(VOCAB)},
                               [tuple(m.split(" ")) for m in MERGES]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if with_bos:  # Llama 3's tokenizer.json post-processor
        tok.post_processor = processors.TemplateProcessing(
            single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B",
            special_tokens=[("<|begin_of_text|>", 0)])
    return tok


@pytest.mark.parametrize("pre,add_bos,with_bos", [
    ("llama-bpe", None, True),  # llama.cpp's default for the Llama 3 pre-tokenizer
    ("tekken", None, True),
    ("llama-bpe", False, False),  # the key decides
    ("llama-bpe", True, True),
    ("qwen2", None, False),  # llama.cpp adds none by default here
])
def test_bos_as_llama_cpp_adds_it(tmp_path, monkeypatch, pre, add_bos, with_bos):
    monkeypatch.setenv("KVFLOW_CACHE_DIR", str(tmp_path / "cache"))
    path = _write(tmp_path / "v.gguf", pre, add_bos)
    oracle = _oracle(with_bos)
    for attempt in ("converted", "from the cache"):
        tokenizer = load_gguf_tokenizer(path)
        for text in TEXTS:
            ids = tokenizer.encode(text)
            assert ids == oracle.encode(text).ids, (attempt, text)
            assert (ids[:1] == [0]) == with_bos, (attempt, text)
            assert tokenizer.encode(text, add_special_tokens=False) == \
                oracle.encode(text, add_special_tokens=False).ids, (attempt, text)
            assert tokenizer.decode(ids, skip_special_tokens=True) == text, (attempt, text)
