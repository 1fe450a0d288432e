"""Config numbers kvflow derives from GGUF metadata where the file does not state them, against
the config.json of the same model on the Hub (recorded here; no Hub access in tests)."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from kvflow.models.gguf_config import load_gguf_config

gguf = pytest.importorskip("gguf")


def _gemma3_header(path, *, blocks: int, hidden: int, heads: int, kv_heads: int,
                   head_dim: int, extra: dict[str, float] | None = None) -> str:
    """A gemma3 GGUF holding only the metadata of a model of these sizes (no tensors), plus
    the float keys ``extra``."""
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_block_count(blocks)
    w.add_context_length(131072)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(4 * hidden)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(1e6)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_sliding_window(1024)
    w.add_vocab_size(262208)
    for key, value in (extra or {}).items():
        w.add_float32(key, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


@pytest.mark.parametrize("sizes,scalar", [
    # google/gemma-3-27b-it config.json: query_pre_attn_scalar 168 (= 5376 / 32), head_dim 128
    ({"blocks": 62, "hidden": 5376, "heads": 32, "kv_heads": 16, "head_dim": 128}, 168),
    # google/gemma-3-12b-it: 256 = head_dim
    ({"blocks": 48, "hidden": 3840, "heads": 16, "kv_heads": 8, "head_dim": 256}, 256),
    # google/gemma-3-4b-it: 256 = head_dim
    ({"blocks": 34, "hidden": 2560, "heads": 8, "kv_heads": 4, "head_dim": 256}, 256),
])
def test_gemma3_query_pre_attn_scalar(tmp_path, sizes, scalar):
    """Before: head_dim for every size, so Gemma 3 27B scaled its attention scores by
    1/sqrt(128) instead of 1/sqrt(168) (llama.cpp and transformers: 168)."""
    config = load_gguf_config(_gemma3_header(tmp_path / "g.gguf", **sizes))
    assert config.head_dim == sizes["head_dim"]
    assert config.query_pre_attn_scalar == scalar


_GEMMA3_4B = {"blocks": 34, "hidden": 2560, "heads": 8, "kv_heads": 4, "head_dim": 256}


def test_gemma3_local_rope_base_and_final_softcapping_are_read(tmp_path):
    """``gemma3.rope.freq_base_swa`` is the local layers' RoPE base and
    ``gemma3.final_logit_softcapping`` the cap on the logits (config.json's
    ``rope_local_base_freq``, ``final_logit_softcapping``); before, 10000 and no cap."""
    path = _gemma3_header(tmp_path / "g.gguf", **_GEMMA3_4B,
                          extra={"gemma3.rope.freq_base_swa": 50000.0,
                                 "gemma3.final_logit_softcapping": 30.0})
    config = load_gguf_config(path)
    assert config.rope_parameters["sliding_attention"]["rope_theta"] == 50000.0
    assert config.rope_parameters["full_attention"]["rope_theta"] == 1e6
    assert config.final_logit_softcapping == 30.0


def test_gemma3_attention_softcapping_is_refused(tmp_path):
    path = _gemma3_header(tmp_path / "g.gguf", **_GEMMA3_4B,
                          extra={"gemma3.attn_logit_softcapping": 50.0})
    with pytest.raises(ValueError, match=r"'gemma3.attn_logit_softcapping' is 50.0"):
        load_gguf_config(path)
