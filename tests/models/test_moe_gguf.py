"""Mixture-of-experts GGUF files (Mixtral as ``llama`` + ``expert_count``, ``qwen2moe``,
``qwen3moe``, ``granitemoe``), written here from the tiny transformers MoE models the way
llama.cpp's ``convert_hf_to_gguf.py`` writes them: each layer's experts stacked as
``ffn_{gate,up,down}_exps`` [E, ...] (transformers 5's fused ``gate_up_proj`` split into its
gate and up halves), the router as ``ffn_gate_inp``, Qwen2-MoE's shared expert as
``ffn_*_shexp`` with its gate ``ffn_gate_inp_shexp`` [H]; tensor names from gguf-py's own
tables; q/k rows permuted for the Llama-layout archs. kvflow reads back the config and
generates the transformers model's greedy tokens and logprobs."""

from __future__ import annotations

import dataclasses
import logging
import re

import numpy as np
import pytest
import torch

from kvflow import LLM
from kvflow.kernels.gguf_dequant import F32
from kvflow.kernels.gguf_dequant import SUPPORTED_TYPES as KEPT_TYPES
from kvflow.models.gguf_config import load_gguf_config
from kvflow.models.gguf_loader import iter_gguf_weights
from tests.models.test_gguf_loader import llama_cpp_permute
from tests.models.test_parity import _prompts, assert_matches_hf, greedy

gguf = pytest.importorskip("gguf")

# tiny model (tests/conftest.py) -> llama.cpp architecture
_ARCH = {"mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe",
         "qwen3_moe_256": "qwen3moe",
         "granite_moe": "granitemoe"}


def _model_arch(arch: str):
    """gguf-py's MODEL_ARCH of the ``general.architecture`` string ``arch``."""
    return {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[arch]


def _tensor_name(arch: str, kind, layer: int) -> str:
    """gguf-py's name of tensor ``kind`` (a MODEL_TENSOR) in block ``layer``, checked to be
    one the architecture has in gguf-py's table."""
    assert kind in gguf.MODEL_TENSORS[_model_arch(arch)], (arch, kind)
    return gguf.TENSOR_NAMES[kind].format(bid=layer) + ".weight"


def _moe_tensors(model, arch: str, legacy: bool = False) -> dict[str, np.ndarray]:
    """``legacy``: experts as one tensor each, ``blk.N.ffn_{gate,up,down}.E`` (early Mixtral
    GGUFs, before llama.cpp stacked them)."""
    cfg = model.config
    t = gguf.MODEL_TENSOR
    names = gguf.get_tensor_name_map(_model_arch(arch), cfg.num_hidden_layers)
    # the tiny Qwen2-MoE's dense layer 1 (mlp_only_layers): llama.cpp's qwen2moe table has no
    # dense FFN, so those tensors take the dense qwen2 names (what kvflow reads for them)
    dense = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN2, cfg.num_hidden_layers)
    out: dict[str, np.ndarray] = {}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        array = tensor.float().numpy()
        layer = int(name.split(".")[2]) if name.startswith("model.layers.") else -1
        if legacy and name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            half = array.shape[1] // 2
            for e in range(array.shape[0]):
                if name.endswith("down_proj"):
                    out[f"blk.{layer}.ffn_down.{e}.weight"] = array[e]
                else:
                    out[f"blk.{layer}.ffn_gate.{e}.weight"] = array[e, :half]
                    out[f"blk.{layer}.ffn_up.{e}.weight"] = array[e, half:]
            continue
        if name.endswith("experts.gate_up_proj"):  # [E, 2F, H]: gate rows, then up rows
            half = array.shape[1] // 2
            out[_tensor_name(arch, t.FFN_GATE_EXP, layer)] = array[:, :half]
            out[_tensor_name(arch, t.FFN_UP_EXP, layer)] = array[:, half:]
            continue
        if name.endswith("experts.down_proj"):
            out[_tensor_name(arch, t.FFN_DOWN_EXP, layer)] = array
            continue
        if name.endswith((".mlp.gate.weight", ".router.weight")):
            out[_tensor_name(arch, t.FFN_GATE_INP, layer)] = array
            continue
        if name.endswith("shared_expert_gate.weight"):  # llama.cpp's tensor is [H]
            out[_tensor_name(arch, t.FFN_GATE_INP_SHEXP, layer)] = array.reshape(-1)
            continue
        if arch in ("llama", "granitemoe") and ".self_attn.q_proj." in name:
            array = llama_cpp_permute(array, cfg.num_attention_heads)
        elif arch in ("llama", "granitemoe") and ".self_attn.k_proj." in name:
            array = llama_cpp_permute(array, cfg.num_key_value_heads)
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias")) or \
            dense.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, name
        out[gguf_name] = array
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


Q = gguf.GGMLQuantizationType
# a Q4_K_M-like mix with gate and up of different types: expert kind -> GGML type, "other":
# every other 2-D weight but the routers
K_MIX = {"gate": Q.Q4_K, "up": Q.Q5_K, "down": Q.Q6_K, "other": Q.Q8_0}
_EXPERT_KIND_RE = re.compile(r"ffn_(gate|up|down)(_exps|\.\d+)\.weight$")


def _types(quantize) -> dict:
    """``quantize`` (one GGMLQuantizationType, or a :data:`K_MIX`-style dict) as a dict."""
    return quantize if isinstance(quantize, dict) else \
        dict.fromkeys(("gate", "up", "down", "other"), quantize)


def _fits(array: np.ndarray, qtype) -> bool:
    """Whether rows of ``array`` are whole ``qtype`` blocks (else written as F32, as
    llama.cpp falls back for such tensors)."""
    return array.shape[-1] % gguf.GGML_QUANT_SIZES[qtype][0] == 0


# gguf-py writes K-quant blocks but cannot quantize to them: K-quant experts are random
# blocks instead (fp16 scale fields at these byte offsets, small enough for weights ~0.1),
# and the oracle runs their values (gguf-py's dequantize)
_K_SCALES = {Q.Q4_K: ((0, 2), 2e-3), Q.Q5_K: ((0, 2), 1e-3), Q.Q6_K: ((208,), 1e-4)}


def _blocks(array: np.ndarray, qtype, seed: int) -> np.ndarray:
    """uint8 blocks the file holds for ``array``: gguf-py's quantization, or for a K-quant
    random blocks of its shape (seeded by ``seed``; the values of ``array`` are dropped)."""
    if qtype not in _K_SCALES:
        return gguf.quants.quantize(array, qtype)
    block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(*array.shape[:-1], array.shape[-1] // block, nbytes),
                       dtype=np.uint8)
    offsets, scale = _K_SCALES[qtype]
    for off in offsets:
        raw[..., off:off + 2] = rng.uniform(-scale, scale, (*raw.shape[:-1], 1)) \
            .astype(np.float16).view(np.uint8)
    return raw.reshape(*array.shape[:-1], -1)


def _seed(layer: int, kind: str) -> int:
    return 3 * layer + ("gate", "up", "down", "other").index(kind)


def _round(array: np.ndarray, qtype, seed: int = 0) -> np.ndarray:
    """The values the file holds for ``array`` (itself where rows are not whole blocks)."""
    if not _fits(array, qtype):
        return array
    return gguf.quants.dequantize(_blocks(array, qtype, seed), qtype).reshape(array.shape)


def _rounded_oracle(tiny, quantize):
    """``tiny`` with every tensor :func:`_write` quantizes rounded through its GGML type:
    transformers running the weights the file holds."""
    types = _types(quantize)
    state = {}
    for key, value in tiny.hf_model.state_dict().items():
        array = value.float().numpy()
        layer = int(key.split(".")[2]) if key.startswith("model.layers.") else -1
        if key.endswith("experts.gate_up_proj"):
            half = array.shape[1] // 2
            array = np.concatenate([_round(array[:, :half], types["gate"], _seed(layer, "gate")),
                                    _round(array[:, half:], types["up"], _seed(layer, "up"))],
                                   axis=1)
        elif key.endswith("experts.down_proj"):
            array = _round(array, types["down"], _seed(layer, "down"))
        elif value.dim() >= 2 and not key.endswith((".mlp.gate.weight", ".router.weight",
                                                    "shared_expert_gate.weight")):
            array = _round(array, types["other"])
        state[key] = torch.from_numpy(np.ascontiguousarray(array))
    rounded = tiny.hf_model.__class__(tiny.hf_model.config).eval()
    rounded.load_state_dict(state)
    # the name keys test_parity's cache of transformers' outputs: one per set of types
    suffix = "_".join(f"{kind}_{t.name}" for kind, t in types.items())
    return dataclasses.replace(tiny, name=f"{tiny.name}_{suffix}", hf_model=rounded)


def _write(tiny, path, overrides: dict | None = None, quantize=None,
           legacy: bool = False) -> str:
    """The GGUF of ``tiny``; ``overrides``: ``<arch>.<key>`` values to write instead (None:
    leave the key out); ``quantize``: a GGMLQuantizationType for every 2-D / 3-D weight
    but the routers, or a :data:`K_MIX`-style dict of types by tensor kind (a tensor whose
    rows are not whole blocks stays F32)."""
    cfg = tiny.hf_model.config
    arch = _ARCH[tiny.name]
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    n_experts = getattr(cfg, "num_experts", None) or cfg.num_local_experts
    keys: dict = {
        "block_count": cfg.num_hidden_layers, "context_length": cfg.max_position_embeddings,
        "embedding_length": cfg.hidden_size, "feed_forward_length": cfg.intermediate_size,
        "attention.head_count": cfg.num_attention_heads,
        "attention.head_count_kv": cfg.num_key_value_heads,
        "attention.key_length": head_dim, "attention.value_length": head_dim,
        "rope.dimension_count": head_dim, "vocab_size": cfg.vocab_size,
        "expert_count": n_experts, "expert_used_count": cfg.num_experts_per_tok}
    floats = {"rope.freq_base": cfg.rope_parameters["rope_theta"],
              "attention.layer_norm_rms_epsilon": cfg.rms_norm_eps}
    if arch in ("qwen2moe", "qwen3moe"):
        keys["expert_feed_forward_length"] = cfg.moe_intermediate_size
    if arch == "qwen2moe":
        keys["expert_shared_feed_forward_length"] = cfg.shared_expert_intermediate_size
    if arch == "granitemoe":
        floats.update({"embedding_scale": cfg.embedding_multiplier,
                       "residual_scale": cfg.residual_multiplier,
                       "logit_scale": cfg.logits_scaling,
                       "attention.scale": cfg.attention_multiplier})
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in {**keys, **floats, **(overrides or {})}.items():
        if value is None:
            continue
        if isinstance(value, bool):
            w.add_bool(f"{arch}.{key}", value)
        elif isinstance(value, int):
            w.add_uint32(f"{arch}.{key}", value)
        else:
            w.add_float32(f"{arch}.{key}", value)
    w.add_uint32("tokenizer.ggml.bos_token_id", cfg.bos_token_id)
    w.add_uint32("tokenizer.ggml.eos_token_id", cfg.eos_token_id)
    for name, array in _moe_tensors(tiny.hf_model, arch, legacy).items():
        match = _EXPERT_KIND_RE.search(name)
        kind = match.group(1) if match else "other"
        qtype = None if quantize is None else _types(quantize)[kind]
        if qtype is not None and array.ndim >= 2 and "ffn_gate_inp" not in name \
                and _fits(array, qtype):
            seed = _seed(int(name.split(".")[1]) if name.startswith("blk.") else -1, kind)
            w.add_tensor(name, _blocks(array, qtype, seed), raw_dtype=qtype)
        else:
            w.add_tensor(name, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def _llm(tiny, path, **kwargs) -> LLM:
    return LLM(model=path, tokenizer=tiny.path, dtype="float32", device="cpu",
               num_kv_blocks=64, block_size=4, max_num_batched_tokens=16, **kwargs)


def _generate_matches_hf(tiny, path, **kwargs) -> None:
    for out in _llm(tiny, path, **kwargs).generate(_prompts([13, 22], tiny.vocab_size, seed=7), greedy(),
                                         use_tqdm=False):
        assert_matches_hf(tiny, out)


@pytest.mark.parametrize("name,hf_arch", [
    ("mixtral", "MixtralForCausalLM"), ("qwen2_moe", "Qwen2MoeForCausalLM"),
    ("qwen3_moe", "Qwen3MoeForCausalLM"), ("granite_moe", "GraniteMoeForCausalLM")])
def test_moe_gguf_generates_as_transformers(tiny_model_factory, tmp_path, name, hf_arch):
    tiny = tiny_model_factory(name)
    cfg = tiny.hf_model.config
    path = _write(tiny, tmp_path / f"{name}.gguf")
    got = load_gguf_config(path)
    assert got.architectures == [hf_arch]
    assert got.num_experts_per_tok == cfg.num_experts_per_tok
    if name in ("qwen2_moe", "qwen3_moe"):
        assert (got.num_experts, got.moe_intermediate_size, got.norm_topk_prob,
                list(got.mlp_only_layers)) == (cfg.num_experts, cfg.moe_intermediate_size,
                                               cfg.norm_topk_prob, list(cfg.mlp_only_layers))
    else:
        assert (got.num_local_experts, got.intermediate_size) == (cfg.num_local_experts,
                                                                  cfg.intermediate_size)
    if name == "qwen2_moe":
        assert got.shared_expert_intermediate_size == cfg.shared_expert_intermediate_size
    _generate_matches_hf(tiny, path)


def test_early_mixtral_gguf_with_per_expert_tensors(tiny_model_factory, tmp_path, caplog,
                                                    monkeypatch):
    """blk.N.ffn_{gate,up,down}.E (one tensor per expert) load as the stacked ones do; kept
    quantized (Q8_0) each comes as its blocks, or with KVFLOW_GGUF_MOE=dequantized as
    floats with a warning."""
    tiny = tiny_model_factory("mixtral")
    _generate_matches_hf(tiny, _write(tiny, tmp_path / "early.gguf", legacy=True))
    path = _write(tiny, tmp_path / "early_q8.gguf", legacy=True, quantize=Q.Q8_0)
    weights = dict(iter_gguf_weights(path, torch.float32, keep_quantized=True))
    down = weights["model.layers.1.mlp.experts.3.down_proj.weight"]
    assert (down.dtype, down.ggml_type, tuple(down.shape)) == (torch.uint8, Q.Q8_0, (64, 68))
    monkeypatch.setenv("KVFLOW_GGUF_MOE", "dequantized")
    with caplog.at_level(logging.WARNING, logger="kvflow"):
        weights = dict(iter_gguf_weights(path, torch.float32, keep_quantized=True))
    assert weights["model.layers.1.mlp.experts.3.down_proj.weight"].dtype == torch.float32
    assert weights["model.layers.1.self_attn.v_proj.weight"].dtype == torch.uint8
    assert "MoE expert tensors (24 x Q8_0) dequantized" in caplog.text  # 2 layers x 4 x 3
    _generate_matches_hf(_rounded_oracle(tiny, Q.Q8_0), path, quantization="gguf")


def _expert_layer(llm):
    """The first MoE layer's ``FusedMoE`` of ``llm``'s model."""
    model = llm.engine.core.executor.runner.model
    return next(m for m in model.modules() if hasattr(m, "num_local_experts"))


# Q5_1: a type gguf-py writes but kvflow has no kept kernel for (dequantized, held float32)
Q5_1_EXPERTS = {"gate": Q.Q5_1, "up": Q.Q5_1, "down": Q.Q5_1, "other": Q.Q8_0}


@pytest.mark.parametrize("name,quantize,gate_up_fused", [
    ("mixtral", Q.Q8_0, True), ("qwen2_moe", Q.Q8_0, True), ("qwen3_moe", Q.Q8_0, True),
    ("qwen3_moe_256", K_MIX, False), ("qwen3_moe", Q5_1_EXPERTS, True)])
def test_moe_gguf_experts_kept_quantized(tiny_model_factory, tmp_path, name, quantize,
                                         gate_up_fused):
    """``--quantization gguf``: the experts keep the file's blocks (stacked per layer, one
    GGML type per tensor: gate and up fused into w13 when they share it; a type without a
    kept kernel as float32), and tokens and logprobs equal transformers running the same
    rounded weights."""
    tiny = tiny_model_factory(name)
    llm = _llm(tiny, _write(tiny, tmp_path / "q.gguf", quantize=quantize),
               quantization="gguf")
    types = _types(quantize)
    layer = _expert_layer(llm)
    cfg = tiny.hf_model.config
    n_experts = getattr(cfg, "num_experts", None) or cfg.num_local_experts
    width = getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size
    want = {"w2_weight": (types["down"], cfg.hidden_size, width)}
    if gate_up_fused:
        want["w13_weight"] = (types["gate"], 2 * width, cfg.hidden_size)
    else:
        want.update(w1_weight=(types["gate"], width, cfg.hidden_size),
                    w3_weight=(types["up"], width, cfg.hidden_size))
    assert layer.gguf_types == {k: int(t) if t in KEPT_TYPES else F32
                                for k, (t, _, _) in want.items()}
    for param_name, (qtype, rows, cols) in want.items():
        block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
        param = getattr(layer, param_name)
        assert (param.dtype, tuple(param.shape)) == (
            (torch.uint8, (n_experts, rows, cols // block * block_bytes)) if qtype in KEPT_TYPES
            else (torch.float32, (n_experts, rows, cols)))
    oracle = _rounded_oracle(tiny, quantize)
    for out in llm.generate(_prompts([13, 22], tiny.vocab_size, seed=7), greedy(),
                            use_tqdm=False):
        assert_matches_hf(oracle, out)


def test_gguf_experts_refuse_wrong_shapes_and_missing_experts():
    """The GGUF MoE method names a tensor that does not fit the layer (rows, or columns
    counted in its type's blocks), a stacked tensor, and an expert the checkpoint lacked."""
    from kvflow.layers.moe import FusedMoE
    from kvflow.quant.gguf_moe import GGUFFusedMoEMethod

    layer = FusedMoE(2, 1, hidden_size=64, intermediate_size=32, renormalize=True)
    layer.set_quant_method(GGUFFusedMoEMethod())
    assert layer.w13_weight.numel() == 0  # no float stack allocated

    def blocks(rows: int, cols: int) -> torch.Tensor:
        raw = torch.from_numpy(gguf.quants.quantize(np.ones((rows, cols), np.float32), Q.Q8_0))
        raw.ggml_type = int(Q.Q8_0)
        return raw

    with pytest.raises(ValueError, match=r"expected 32 rows of 64 values"):
        layer.weight_loader(layer.w13_weight, blocks(32, 32), "w1", 0)
    with pytest.raises(ValueError, match=r"not a stacked w2 tensor"):
        layer.weight_loader(layer.w2_weight, torch.zeros(2, 64, 32), "w2")
    with pytest.raises(ValueError, match=r"unknown GGUF expert shard_id 'w13'"):
        layer.weight_loader(layer.w13_weight, torch.zeros(2, 64, 64), "w13")
    for shard, shape in (("w1", (32, 64)), ("w3", (32, 64)), ("w2", (64, 32))):
        layer.weight_loader(layer.w13_weight, blocks(*shape), shard, 0)
    layer.weight_loader(layer.w13_weight, blocks(32, 64), "w1", 1)
    with pytest.raises(ValueError, match=r"w3 of experts \[1\] are missing"):
        layer.quant_method.process_weights_after_loading(layer)


def test_moe_gguf_experts_dequantized_when_asked(tiny_model_factory, tmp_path, caplog,
                                                 monkeypatch):
    """KVFLOW_GGUF_MOE=dequantized: attention weights keep their Q8_0 blocks, the experts
    are float32 (4x the Q8_0 bytes: 34 bytes per 32 weights), with a warning; the output
    is the quantized experts' (the same rounded weights)."""
    tiny = tiny_model_factory("qwen3_moe")
    path = _write(tiny, tmp_path / "q8.gguf", quantize=Q.Q8_0)
    kept = _llm(tiny, path, quantization="gguf")
    kept_bytes = kept.engine.core.weight_bytes
    monkeypatch.setenv("KVFLOW_GGUF_MOE", "dequantized")
    with caplog.at_level(logging.WARNING, logger="kvflow"):
        llm = _llm(tiny, path, quantization="gguf")
    assert "MoE expert tensors (6 x Q8_0) dequantized" in caplog.text
    assert "has no effect" not in caplog.text  # read here (tests/test_gguf_moe_env_unread.py)
    layer = _expert_layer(llm)
    assert layer.w13_weight.dtype == torch.float32 and layer.w2_weight.dtype == torch.float32
    cfg = tiny.hf_model.config
    expert_weights = cfg.num_hidden_layers * cfg.num_experts * 3 * cfg.hidden_size * \
        cfg.moe_intermediate_size
    assert llm.engine.core.weight_bytes - kept_bytes == expert_weights * (4 - 34 / 32)
    prompts = _prompts([13, 22], tiny.vocab_size, seed=7)
    oracle = _rounded_oracle(tiny, Q.Q8_0)
    for out in llm.generate(prompts, greedy(), use_tqdm=False):
        assert_matches_hf(oracle, out)


def test_qwen2moe_expert_weights_norm_key_is_read(tiny_model_factory, tmp_path):
    """llama.cpp does not renormalize Qwen2-MoE's top-k weights; ``expert_weights_norm``
    true says it does (and Qwen3-MoE's default, renormalized, is llama.cpp's too)."""
    tiny = tiny_model_factory("qwen2_moe")
    assert load_gguf_config(_write(tiny, tmp_path / "a.gguf")).norm_topk_prob is False
    path = _write(tiny, tmp_path / "b.gguf", {"expert_weights_norm": True})
    assert load_gguf_config(path).norm_topk_prob is True
    path = _write(tiny_model_factory("qwen3_moe"), tmp_path / "c.gguf")
    assert load_gguf_config(path).norm_topk_prob is True


def test_moe_gguf_experts_load_per_expert(tiny_model_factory, tmp_path):
    """The loader yields the stacked experts one at a time, equal to transformers' halves
    of gate_up_proj and its down_proj; the shared-expert gate [H] comes back as [1, H]."""
    tiny = tiny_model_factory("qwen2_moe")
    state = tiny.hf_model.state_dict()
    weights = dict(iter_gguf_weights(_write(tiny, tmp_path / "q.gguf"), torch.float32))
    f = tiny.hf_model.config.moe_intermediate_size
    gate_up = state["model.layers.0.mlp.experts.gate_up_proj"]
    torch.testing.assert_close(weights["model.layers.0.mlp.experts.3.gate_proj.weight"],
                               gate_up[3, :f], rtol=0, atol=0)
    torch.testing.assert_close(weights["model.layers.0.mlp.experts.1.up_proj.weight"],
                               gate_up[1, f:], rtol=0, atol=0)
    torch.testing.assert_close(weights["model.layers.0.mlp.experts.2.down_proj.weight"],
                               state["model.layers.0.mlp.experts.down_proj"][2], rtol=0, atol=0)
    torch.testing.assert_close(weights["model.layers.0.mlp.shared_expert_gate.weight"],
                               state["model.layers.0.mlp.shared_expert_gate.weight"],
                               rtol=0, atol=0)


@pytest.mark.parametrize("name,overrides,message", [
    ("qwen3_moe", {"expert_count": 6}, (r"'qwen3moe.expert_count' is 6, but "
                                       r"blk.0.ffn_gate_inp.weight routes to 8 experts")),
    ("qwen3_moe", {"expert_count": None}, r"'qwen3moe.expert_count' is missing"),
    ("qwen3_moe", {"expert_used_count": 9}, (r"'qwen3moe.expert_used_count' is 9, more than "
                                            r"the 8 experts")),
    ("qwen3_moe", {"expert_used_count": None}, r"'qwen3moe.expert_used_count' is missing"),
    ("qwen3_moe", {"expert_feed_forward_length": 48},
     r"'qwen3moe.expert_feed_forward_length' is 48, but blk.0's expert gate weights have 32 "),
    ("qwen3_moe", {"expert_gating_func": 2}, r"'qwen3moe.expert_gating_func' is 2"),
    ("qwen3_moe", {"expert_weights_scale": 2.5}, r"'qwen3moe.expert_weights_scale' is 2.5"),
    ("qwen2_moe", {"expert_shared_feed_forward_length": 40},
     (r"'qwen2moe.expert_shared_feed_forward_length' is 40, but blk.0.ffn_gate_shexp.weight "
     r"has 48 rows")),
    ("mixtral", {"expert_weights_norm": False}, r"'llama.expert_weights_norm' is false"),
    # a corrupt block count: before, the router check listed range(2**32 - 1) (MemoryError or
    # the process OOM-killed) before the tensors were compared with it
    ("qwen3_moe", {"block_count": 2**32 - 1},
     r"'qwen3moe.block_count' is 4294967295 but the file has tensors for blocks 0..1"),
    # GraniteMoeShared's key: kvflow's Granite MoE has no shared expert
    ("granite_moe", {"expert_shared_feed_forward_length": 16},
     (r"'granitemoe.expert_shared_feed_forward_length' is 16: a shared expert is not "
     r"supported for GraniteMoeForCausalLM")),
])
def test_moe_gguf_bad_metadata_refused(tiny_model_factory, tmp_path, name, overrides,
                                       message):
    path = _write(tiny_model_factory(name), tmp_path / "bad.gguf", overrides)
    with pytest.raises(ValueError, match=message):
        load_gguf_config(path)


def test_dense_arch_with_experts_still_refused(tiny_model_factory, tmp_path):
    """qwen2 (dense) with an expert count: refused naming the key, as before."""
    tiny = tiny_model_factory("qwen2_moe")
    path = tmp_path / "q.gguf"
    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_uint32("qwen2.expert_count", 4)
    w.add_uint32("qwen2.block_count", 2)
    w.add_uint32("qwen2.embedding_length", tiny.hf_model.config.hidden_size)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=r"'qwen2.expert_count' is 4: mixture-of-experts"):
        load_gguf_config(str(path))
