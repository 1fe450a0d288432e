"""GGUF metadata that is malformed, or contradicted by the file's own tensor table (the oracle:
``gguf.GGUFReader``'s shapes of the tiny synthetic files of test_gguf_loader.py), is one
``ValueError`` naming the file and the key, from the config and the weight loader alike.

Before: a string or zero head count raised a bare ``ValueError``/``ZeroDivisionError`` with
neither file nor key, a wrong ``embedding_length`` / ``feed_forward_length`` /
``block_count`` a torch error from inside a layer, and a wrong ``vocab_size``,
``rope.dimension_count`` (partial rotary) or ``attention.value_length`` loaded silently."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from kvflow.models.gguf_config import load_gguf_config
from kvflow.models.gguf_loader import iter_gguf_weights

gguf = pytest.importorskip("gguf")

from tests.models.test_gguf_loader import _synthetic

U32, F32, STR, ARR = (gguf.GGUFValueType.UINT32, gguf.GGUFValueType.FLOAT32,
                      gguf.GGUFValueType.STRING, gguf.GGUFValueType.ARRAY)


def _rewritten(tmp_path, overrides: dict, drop: tuple[str, ...] = (), extra_tensors=None,
               untied: bool = False):
    """The tiny synthetic llama GGUF written again with metadata ``overrides`` ({key: (value,
    GGUFValueType[, item type])}), keys ``drop`` left out and ``extra_tensors`` added (or
    replacing a tensor of the same name)."""
    path, _ = _synthetic(tmp_path, "llama", permute=True, untied=untied)
    reader = gguf.GGUFReader(path)
    out = str(tmp_path / "edited.gguf")
    w = gguf.GGUFWriter(out, "llama")
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name in ("general.architecture", *drop):
            continue
        if field.name not in overrides:
            w.add_key_value(field.name, field.contents(), field.types[0],
                            sub_type=field.types[1] if len(field.types) > 1 else None)
    for key, (value, vtype, *sub) in overrides.items():
        w.add_key_value(key, value, vtype, sub_type=sub[0] if sub else None)
    tensors = {t.name: np.array(t.data) for t in reader.tensors}
    for name, array in {**tensors, **(extra_tensors or {})}.items():
        w.add_tensor(name, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _assert_refused(path: str, pattern: str) -> None:
    """load_gguf_config and iter_gguf_weights (or its first item) raise ValueError matching
    ``pattern`` and naming the file."""
    for load in (lambda: load_gguf_config(path),
                 lambda: next(iter(iter_gguf_weights(path, torch.float32)))):
        with pytest.raises(ValueError, match=pattern) as info:
            load()
        assert "edited.gguf" in str(info.value)


@pytest.mark.parametrize("key,value,pattern", [
    ("llama.attention.head_count", ("abc", STR), r"head_count' is 'abc', not an integer"),
    ("llama.attention.head_count", (0, U32), r"head_count' is 0, below 1"),
    ("llama.attention.head_count_kv", (0, U32), r"head_count_kv' is 0, below 1"),
    ("llama.attention.head_count_kv", ([2, 1], ARR, U32), r"differing per-layer values"),
])
def test_bad_head_counts_are_named(tmp_path, key, value, pattern):
    _assert_refused(_rewritten(tmp_path, {key: value}), pattern)


@pytest.mark.parametrize("key,value,pattern", [
    ("llama.embedding_length", (32, U32), r"embedding_length' is 32 but token_embd.weight has 16"),
    ("llama.vocab_size", (50, U32), r"vocab_size' is 50 but token_embd.weight has 40 rows"),
    ("llama.block_count", (1, U32), r"block_count' is 1 but the file has tensors for blocks"),
    ("llama.block_count", (3, U32), r"block_count' is 3"),
    # a corrupt count: before, range(2**40) was built as a set (the process was OOM-killed)
    ("llama.block_count", (2**40, gguf.GGUFValueType.UINT64),
     r"block_count' is 1099511627776 but the file has tensors for blocks 0..1 \(2 blocks\)"),
    ("llama.feed_forward_length", (48, U32), r"feed_forward_length' disagrees with blk.0.ffn_up"),
    ("llama.rope.dimension_count", (4, U32), r"dimension_count' is 4.*partial rotary"),
    ("llama.attention.value_length", (4, U32), r"value_length' is 4.*v head sizes"),
    ("llama.attention.layer_norm_rms_epsilon", ("x", STR), r"epsilon' is 'x', not a number"),
    ("llama.rope.freq_base", (-1.0, F32), r"freq_base' is -1.0, not a positive number"),
    # Mixtral's key on a file without experts (test_moe_gguf.py: the MoE files)
    ("llama.expert_count", (8, U32), r"expert_count' is 8, but the file has no ffn_gate_inp"),
])
def test_metadata_contradicting_tensors_is_refused(tmp_path, key, value, pattern):
    """The tensor table (GGUFReader's shapes: token_embd [40, 16], ffn_up [24, 16], two
    blocks, head size 6) is the oracle the metadata is held to."""
    path = _rewritten(tmp_path, {key: value})
    shapes = {t.name: tuple(int(d) for d in reversed(t.shape))
              for t in gguf.GGUFReader(path).tensors}
    assert shapes["token_embd.weight"] == (40, 16) and shapes["blk.0.ffn_up.weight"] == (24, 16)
    _assert_refused(path, pattern)


def test_missing_key_is_named(tmp_path):
    _assert_refused(_rewritten(tmp_path, {}, drop=("llama.attention.head_count",)),
                    r"'llama.attention.head_count' is missing")


def test_uniform_per_layer_head_counts_load(tmp_path):
    """llama.cpp allows a per-layer list; one repeated value is that value."""
    path = _rewritten(tmp_path, {"llama.attention.head_count": ([4, 4], ARR, U32),
                                 "llama.attention.head_count_kv": ([2, 2], ARR, U32)})
    config = load_gguf_config(path)
    assert (config.num_attention_heads, config.num_key_value_heads) == (4, 2)
    assert len(dict(iter_gguf_weights(path, torch.float32))) == 20


def test_expert_tensor_in_a_dense_file_is_refused(tmp_path):
    """A router in a llama file without llama.expert_count (Mixtral's key): refused before
    any weight is read, naming the key and the tensor."""
    path = _rewritten(tmp_path, {}, extra_tensors={"blk.0.ffn_gate_inp.weight":
                                                   np.zeros((4, 16), np.float32)})
    _assert_refused(path, r"'llama.expert_count' is missing, but the file has the "
                          r"mixture-of-experts tensor 'blk.0.ffn_gate_inp.weight'")


def test_unknown_tensor_names_the_file(tmp_path):
    path = _rewritten(tmp_path, {}, extra_tensors={"blk.0.ffn_frob.weight":
                                                   np.zeros((4, 16), np.float32)})
    with pytest.raises(ValueError, match=r"edited\.gguf.*Unrecognized GGUF tensor "
                                         r"'blk.0.ffn_frob.weight'"):
        iter_gguf_weights(path, torch.float32)


@pytest.mark.parametrize("name,shape", [
    ("output.weight", (30, 16)),  # a short LM head loaded silently (logits of 30 of 40 ids)
    ("blk.1.attn_output.weight", (16, 12)),
    ("blk.0.ffn_down.weight", (16, 20)),
    ("blk.1.attn_v.weight", (6, 16)),
    ("blk.0.attn_q.weight", (24, 8)),
    ("blk.0.attn_norm.weight", (8,)),
])
def test_tensor_shape_contradicting_metadata_is_refused(tmp_path, name, shape):
    """Any block's tensor, not only block 0's: before, a torch error inside a layer (at load,
    or at the first forward pass with --quantization gguf), or a silent load."""
    path = _rewritten(tmp_path, {}, untied=True,
                      extra_tensors={name: np.zeros(shape, np.float32)})
    assert {t.name: tuple(int(d) for d in reversed(t.shape))
            for t in gguf.GGUFReader(path).tensors}[name] == shape
    _assert_refused(path, rf"tensor '{name}' has shape \({shape[0]},")


_STR, _U32 = gguf.GGUFValueType.STRING, gguf.GGUFValueType.UINT32
_VOCAB = {"tokenizer.ggml.model": ("gpt2", _STR),
          "tokenizer.ggml.tokens": (["a", "b", "ab"], ARR, _STR),
          "tokenizer.ggml.merges": (["a b"], ARR, _STR)}


@pytest.mark.parametrize("overrides,pattern", [
    ({}, r"'tokenizer.ggml.model' is missing \(the file carries no tokenizer\)"),
    ({"tokenizer.ggml.model": ("gpt2", _STR)}, r"'tokenizer.ggml.tokens' is missing"),
    ({**_VOCAB, "tokenizer.ggml.merges": (["a b c"], ARR, _STR)},
     r"'tokenizer.ggml.merges' has an entry .*'a b c'"),
    ({**_VOCAB, "tokenizer.ggml.bos_token_id": (99, _U32)},
     r"'tokenizer.ggml.bos_token_id' is 99, not a token id below the 3 tokens"),
    ({**_VOCAB, "tokenizer.ggml.token_type": ([1, 1], ARR, gguf.GGUFValueType.INT32)},
     r"'tokenizer.ggml.token_type' does not hold one value per token"),
    # mistyped values: before, a TypeError from inside kvflow's own checks
    ({**_VOCAB, "tokenizer.ggml.merges": (5, _U32)},
     r"'tokenizer.ggml.merges' is 5, not a list of merges"),
    ({**_VOCAB, "tokenizer.ggml.pre": (["qwen2"], ARR, _STR)},
     r"'tokenizer.ggml.pre' is \['qwen2'\], not a string"),
])
def test_bad_tokenizer_metadata_is_named(tmp_path, overrides, pattern):
    """Before: transformers' GGUF conversion raised a bare KeyError ('tokens'), IndexError or
    TypeError (a 3-part merge) with neither file nor key."""
    from kvflow.models.gguf_tokenizer import load_gguf_tokenizer

    path = _rewritten(tmp_path, overrides)
    with pytest.raises(ValueError, match=pattern) as info:
        load_gguf_tokenizer(path)
    assert "edited.gguf" in str(info.value) and "--tokenizer" in str(info.value)


def test_unbuildable_tokenizer_names_the_file(tmp_path):
    """A tokenizer model transformers cannot build (here 'rwkv'): its error, with the file."""
    from kvflow.models.gguf_tokenizer import load_gguf_tokenizer

    path = _rewritten(tmp_path, {**_VOCAB, "tokenizer.ggml.model": ("rwkv", _STR)})
    with pytest.raises(ValueError, match=r"edited\.gguf': cannot build a tokenizer .*rwkv"):
        load_gguf_tokenizer(path)


def test_tokenizer_cache_is_rebuilt_for_another_transformers(tmp_path, monkeypatch):
    """A cached conversion is reused only by the transformers version that made it: after an
    upgrade (whose GGUF conversion may tokenize differently) the tokenizer is converted again.
    The stale entry is marked by a chat template the file does not have."""
    import json

    import transformers

    from kvflow.models.gguf_tokenizer import load_gguf_tokenizer

    monkeypatch.setenv("KVFLOW_CACHE_DIR", str(tmp_path / "cache"))
    path = _rewritten(tmp_path, {**_VOCAB, "tokenizer.chat_template": ("{{ 'new' }}", _STR)})
    assert load_gguf_tokenizer(path).chat_template == "{{ 'new' }}"
    (entry,) = (tmp_path / "cache" / "tokenizers").iterdir()
    config_file = entry / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["chat_template"] = "{{ 'stale' }}"
    config_file.write_text(json.dumps(config))
    for name in ("chat_template.jinja", "chat_template.json"):
        if (entry / name).exists():
            (entry / name).write_text("{{ 'stale' }}" if name.endswith("jinja") else
                                      json.dumps({"chat_template": "{{ 'stale' }}"}))
    assert load_gguf_tokenizer(path).chat_template == "{{ 'stale' }}"  # same version: reused
    monkeypatch.setattr(transformers, "__version__", "0.0.0.other")
    assert load_gguf_tokenizer(path).chat_template == "{{ 'new' }}"


_YARN = {"llama.context_length": (4096, U32), "llama.rope.scaling.type": ("yarn", STR),
         "llama.rope.scaling.factor": (4.0, F32),
         "llama.rope.scaling.original_context_length": (1024, U32)}


def test_yarn_keys_give_the_rope_table_transformers_computes(tmp_path):
    """``rope.scaling.yarn_beta_fast`` / ``yarn_beta_slow`` / ``yarn_attn_factor`` are the
    checkpoint's ``beta_fast`` / ``beta_slow`` / ``attention_factor`` (llama.cpp's converter
    copies them). Oracle: transformers' own YaRN frequencies and attention factor for the
    config.json they came from. Before: ignored (betas 32 / 1, factor 0.1 ln 4 + 1)."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from kvflow.layers.rope_parameters import get_rope_parameters
    from kvflow.layers.rotary import compute_cos_sin_cache

    path = _rewritten(tmp_path, {**_YARN, "llama.rope.scaling.yarn_beta_fast": (4.0, F32),
                                 "llama.rope.scaling.yarn_beta_slow": (0.5, F32),
                                 "llama.rope.scaling.yarn_attn_factor": (1.3, F32),
                                 "llama.rope.scaling.yarn_ext_factor": (1.0, F32)})
    theta, scaling = get_rope_parameters(load_gguf_config(path))
    ours = compute_cos_sin_cache(4096, 6, theta, scaling)
    reference = LlamaConfig(hidden_size=16, num_attention_heads=4, head_dim=6,
                            max_position_embeddings=4096, rope_theta=12345.0,
                            rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                          "original_max_position_embeddings": 1024,
                                          "beta_fast": 4.0, "beta_slow": 0.5,
                                          "attention_factor": 1.3})
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](reference, "cpu")
    freqs = torch.outer(torch.arange(4096, dtype=torch.float32), inv_freq)
    expected = torch.cat([freqs.cos(), freqs.sin()], dim=-1) * attention_factor
    assert attention_factor == 1.3
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("key,value,pattern", [
    ("llama.rope.scaling.yarn_ext_factor", (0.5, F32), r"yarn_ext_factor' is 0.5"),
    ("llama.rope.scaling.yarn_log_multiplier", (0.1, F32), r"yarn_log_multiplier' is 0.1"),
    ("llama.rope.scaling.type", ("longrope", STR), r"scaling.type' is 'longrope'"),
    ("llama.rope.scaling.attn_factor", (2.0, F32), r"scaling.attn_factor' is 2.0"),
])
def test_rope_scaling_keys_kvflow_cannot_apply_are_refused(tmp_path, key, value, pattern):
    """Before: loaded and computed plain YaRN (or, for longrope, failed deep in the model)."""
    _assert_refused(_rewritten(tmp_path, {**_YARN, key: value}), pattern)


@pytest.mark.parametrize("scaling_type", ["linear", "yarn"])
def test_rope_scaling_without_a_factor_is_named(tmp_path, scaling_type):
    """Before: transformers' bare KeyError ('Missing required keys in rope_parameters')."""
    path = _rewritten(tmp_path, {"llama.rope.scaling.type": (scaling_type, STR)})
    _assert_refused(path, rf"'llama.rope.scaling.factor' is missing \(rope.scaling.type is "
                          rf"'{scaling_type}'\)")


@pytest.mark.parametrize("scaling_type", ["linear", "yarn"])
@pytest.mark.parametrize("factor", [1e30, float("inf"), float("nan"), 0.0, -2.0, 0.5])
def test_rope_scaling_factor_out_of_range_is_refused(tmp_path, scaling_type, factor):
    """transformers' RoPE validation accepts factor >= 1; context 1024 (original) x factor may
    cover at most 2**24 positions, so factor <= 16384. Before: 1e30 and 0.5 loaded (YaRN sized
    its rotary table from 1024 x 1e30), NaN / 0 / -2 were refused without the range."""
    path = _rewritten(tmp_path, {**_YARN, "llama.rope.scaling.type": (scaling_type, STR),
                                 "llama.rope.scaling.factor": (factor, F32)})
    _assert_refused(path, r"'llama.rope.scaling.factor' is .*; accepted: 1 <= factor <= 16384 ")


def test_rope_scaling_factor_at_the_limit_loads(tmp_path):
    """The boundaries themselves are accepted (1 and 2**24 / 1024)."""
    for factor in (1.0, 16384.0):
        path = _rewritten(tmp_path, {**_YARN, "llama.rope.scaling.factor": (factor, F32)})
        assert load_gguf_config(path).rope_scaling["factor"] == factor


@pytest.mark.parametrize("key,value,pattern", [
    ("llama.attn_logit_softcapping", (50.0, F32), r"attn_logit_softcapping' is 50.0"),
    ("llama.final_logit_softcapping", (30.0, F32), r"final_logit_softcapping' is 30.0"),
    ("llama.logit_scale", (0.5, F32), r"logit_scale' is 0.5"),
    ("llama.embedding_scale", (12.0, F32), r"embedding_scale' is 12.0"),
    ("llama.residual_scale", (0.25, F32), r"residual_scale' is 0.25"),
    ("llama.attention.causal", (False, gguf.GGUFValueType.BOOL), r"causal' is False"),
    ("llama.attention.clamp_kqv", (8.0, F32), r"clamp_kqv' is 8.0"),
    ("llama.attention.max_alibi_bias", (8.0, F32), r"max_alibi_bias' is 8.0"),
    ("llama.attention.key_length_swa", (4, U32), r"key_length_swa' is 4, but the head size"),
    ("llama.rope.dimension_count_swa", (4, U32), r"dimension_count_swa' is 4, but the head"),
    ("llama.attention.scale", (0.125, F32),
     r"attention.scale' is 0.125, but kvflow scales attention scores .* by 0.408248"),
])
def test_numerics_keys_kvflow_does_not_apply_are_refused(tmp_path, key, value, pattern):
    """Before: each loaded and ran as plain Llama (uncapped, unscaled, causal, no ALiBi)."""
    _assert_refused(_rewritten(tmp_path, {key: value}), pattern)


def test_neutral_values_of_those_keys_load(tmp_path):
    """The value kvflow computes with (head size 6: scale 6 ** -0.5) is not refused."""
    path = _rewritten(tmp_path, {"llama.attention.scale": (6 ** -0.5, F32),
                                 "llama.logit_scale": (1.0, F32),
                                 "llama.attention.causal": (True, gguf.GGUFValueType.BOOL)})
    assert load_gguf_config(path).head_dim == 6


def test_layer_norm_epsilon_without_the_rms_one_is_refused(tmp_path):
    """Before: the RMSNorm epsilon defaulted to 1e-6, whatever the file's epsilon was."""
    path = _rewritten(tmp_path, {"llama.attention.layer_norm_epsilon": (1e-5, F32)},
                      drop=("llama.attention.layer_norm_rms_epsilon",))
    _assert_refused(path, r"layer_norm_rms_epsilon' is missing \(the file gives a LayerNorm")


def test_part_of_a_split_gguf_is_refused_naming_split_count(tmp_path):
    """``llama-gguf-split``'s parts (gguf-py's ``split_max_tensors`` writes the same
    ``split.{no,count,tensors.count}`` keys): each part is refused naming ``split.count`` and
    the merge, not as a ``block_count`` its tensors contradict (part 1) or an architecture
    ``None`` (part 2, which holds no model metadata). A one-part "split" loads."""
    path, _ = _synthetic(tmp_path, "llama", permute=True)
    reader = gguf.GGUFReader(path)
    for parts, max_tensors in ((2, 12), (1, 0)):
        folder = tmp_path / f"split{parts}"
        folder.mkdir()
        w = gguf.GGUFWriter(str(folder / "m.gguf"), "llama", split_max_tensors=max_tensors)
        for field in reader.fields.values():
            if not field.name.startswith("GGUF.") and field.name != "general.architecture":
                w.add_key_value(field.name, field.contents(), field.types[0],
                                sub_type=field.types[1] if len(field.types) > 1 else None)
        for t in reader.tensors:
            w.add_tensor(t.name, np.array(t.data))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        files = sorted(folder.iterdir())
        if parts == 1:
            assert [f.name for f in files] == ["m.gguf"]
            assert load_gguf_config(str(files[0])).num_hidden_layers == 2
            continue
        assert [f.name for f in files] == ["m-00001-of-00002.gguf", "m-00002-of-00002.gguf"]
        for no, part in enumerate(files, start=1):
            for load in (lambda p=str(part): load_gguf_config(p),
                         lambda p=str(part): next(iter(iter_gguf_weights(p, torch.float32)))):
                with pytest.raises(ValueError, match=rf"{part.name}' is part {no} of 2 of a "
                                   r"split GGUF \(GGUF metadata key 'split.count' is 2\).*"
                                   r"llama-gguf-split --merge"):
                    load()


def test_mistyped_vocabulary_and_template_names_are_no_crash(tmp_path, monkeypatch):
    """The end-of-generation ids of a file whose ``tokenizer.ggml.tokens`` is not a list (read
    even with ``--tokenizer``, which skips the GGUF tokenizer): the eos id alone is out of
    range, so none, as for a file without a vocabulary; a ``tokenizer.chat_templates`` that is
    not a list of names: the default template only. Before: TypeErrors."""
    from kvflow.models.gguf_tokenizer import gguf_eos_token_ids, load_gguf_tokenizer

    monkeypatch.setenv("KVFLOW_CACHE_DIR", str(tmp_path / "cache"))
    path = _rewritten(tmp_path, {"tokenizer.ggml.tokens": (5, _U32),
                                 "tokenizer.ggml.eos_token_id": (0, _U32)})
    assert gguf_eos_token_ids(path) == []
    template = "{{ messages[0]['content'] }}"
    path = _rewritten(tmp_path, {**_VOCAB, "tokenizer.chat_template": (template, _STR),
                                 "tokenizer.chat_templates": (7, _U32)})
    assert load_gguf_tokenizer(path).chat_template == template


@pytest.mark.parametrize("key,value,pattern", [
    ("tokenizer.ggml.eos_token_id", ([1, 2], ARR, gguf.GGUFValueType.INT32),
     r"'tokenizer.ggml.eos_token_id' is \[1, 2\], not an integer token id"),
    ("tokenizer.ggml.bos_token_id", (float("inf"), F32),
     r"'tokenizer.ggml.bos_token_id' is inf, not an integer token id"),
    ("general.alignment", ([32], ARR, U32),
     r"not a valid GGUF file: invalid general.alignment \[32\]"),
    # before: loaded, then the engine asked for a 4 TB rotary table at start-up
    ("llama.context_length", (2**40, gguf.GGUFValueType.UINT64),
     r"'llama.context_length' is 1099511627776, above the 16777216 RoPE positions"),
])
def test_corrupt_values_are_named(tmp_path, key, value, pattern):
    """Before: a TypeError / OverflowError from ``int()`` with neither file nor key."""
    _assert_refused(_rewritten(tmp_path, {key: value}), pattern)
