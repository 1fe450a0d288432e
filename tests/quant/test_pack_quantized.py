"""compressed-tensors ``pack-quantized`` checkpoints (llm-compressor's W4A16 / W8A16 presets:
int32 ``weight_packed``, ``weight_scale``, ``weight_shape``), built here from the tiny Llama
with the package's own ``ModelCompressor`` and checked against a plain torch reference that
unpacks and dequantizes the saved tensors per the format (and transformers on the folder)."""

from __future__ import annotations

import copy
import json
import shutil

import pytest
import torch
from compressed_tensors.quantization import (
    QuantizationConfig,
    QuantizationStatus,
    apply_quantization_config,
    preset_name_to_scheme,
)
from compressed_tensors.quantization.utils import calculate_qparams
from safetensors.torch import load_file

from kvflow import LLM
from kvflow.quant.pack_quantized import PackedInt4Method, PackedInt8Method
from tests.quant.quant_logprobs import engine_prompt_logprobs, hf_prompt_logprobs
from tests.quant.test_compressed_tensors import save_compressed


def _build(tiny, bits: int, group: int | None, folder: str, symmetric: bool = True) -> str:
    """``tiny`` quantized with llm-compressor's W{bits}A16 scheme (group ``group``, or
    channel when None), min/max scales, saved pack-quantized."""
    model = copy.deepcopy(tiny.hf_model)
    scheme = preset_name_to_scheme(f"W{bits}A16", ["Linear"])
    scheme.weights.strategy = "group" if group else "channel"
    scheme.weights.group_size = group
    scheme.weights.symmetric = symmetric
    qc = QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"],
                            quantization_status=QuantizationStatus.INITIALIZED)
    apply_quantization_config(model, qc)
    for m in model.modules():
        if getattr(m, "quantization_scheme", None) is None:
            continue
        w = m.weight.data
        g = w.view(w.shape[0], -1, group or w.shape[1])
        scale, zero = calculate_qparams(g.amin(-1), g.amax(-1), m.quantization_scheme.weights)
        m.weight_scale.data.copy_(scale.reshape(m.weight_scale.shape))
        m.weight_zero_point.data.copy_(zero.reshape(m.weight_zero_point.shape))
        m.quantization_status = QuantizationStatus.FROZEN
    return save_compressed(model, tiny, folder)


def _dequantized_reference(tiny, folder: str, bits: int) -> torch.nn.Module:
    """``tiny``'s HF model with each linear's weight read back from the folder by the format's
    spec: value i of a row at bits [i*b, (i+1)*b) of its int32 words, stored as q + 2^(b-1);
    w = q * scale of its group."""
    tensors = load_file(f"{folder}/model.safetensors")
    model = copy.deepcopy(tiny.hf_model)
    for name, m in model.named_modules():
        if f"{name}.weight_packed" not in tensors:
            continue
        packed = tensors[f"{name}.weight_packed"].to(torch.int64) & 0xFFFFFFFF
        n, k = tensors[f"{name}.weight_shape"].tolist()
        vals = [(packed >> (b * bits)) & ((1 << bits) - 1) for b in range(32 // bits)]
        q = torch.stack(vals, dim=-1).reshape(n, -1)[:, :k] - (1 << (bits - 1))
        scale = tensors[f"{name}.weight_scale"].float()
        m.weight.data = q.float() * scale.repeat_interleave(k // scale.shape[1], dim=1)
    return model


@pytest.mark.parametrize("bits,group,method", [
    (4, 32, PackedInt4Method), (4, 16, PackedInt4Method), (4, None, PackedInt4Method),
    (8, 32, PackedInt8Method), (8, 64, PackedInt8Method), (8, None, PackedInt8Method),
], ids=["int4-group32", "int4-group16", "int4-channel", "int8-group32", "int8-group64",
        "int8-channel"])
def test_pack_quantized_matches_reference(tiny_model_factory, tmp_path, bits, group, method):
    """kvflow refused every pack-quantized folder; now its logits are the torch reference's
    (the folder's own unpacked weights) and transformers'."""
    tiny = tiny_model_factory("llama")
    folder = _build(tiny, bits, group, str(tmp_path / "ckpt"))
    ids = torch.randint(2, tiny.vocab_size, (12,),
                        generator=torch.Generator().manual_seed(5)).tolist()
    want = hf_prompt_logprobs(_dequantized_reference(tiny, folder, bits), ids)
    llm = LLM(model=folder, dtype="float32", num_kv_blocks=16, block_size=4)
    assert engine_prompt_logprobs(llm, ids) == pytest.approx(want, abs=5e-4)
    layer = llm.engine.core.executor.runner.model.model.layers[1].mlp.gate_up_proj
    assert type(layer.quant_method) is method
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert hf_prompt_logprobs(hf, ids) == pytest.approx(want, abs=5e-4)
    plain = hf_prompt_logprobs(tiny.hf_model, ids)  # the quantization is real
    assert max(abs(a - b) for a, b in zip(plain, want)) > 2e-3


def test_pack_quantized_int4_bf16_kernel(tiny_model_factory, tmp_path):
    """bf16 runs torch's CPU int4 kernel on the unpacked nibbles (channel scales repeated to
    64-column groups, the kernel's largest that divides K = 64): within bf16 rounding of the
    fp32 reference."""
    tiny = tiny_model_factory("llama")
    folder = _build(tiny, 4, None, str(tmp_path / "ckpt"))
    ids = list(range(5, 17))
    want = hf_prompt_logprobs(_dequantized_reference(tiny, folder, 4), ids)
    llm = LLM(model=folder, dtype="bfloat16", num_kv_blocks=16, block_size=4)
    layer = llm.engine.core.executor.runner.model.model.layers[0].self_attn.qkv_proj
    assert layer.int4_cpu_packed and layer.quant_method.group_size == 64
    assert engine_prompt_logprobs(llm, ids) == pytest.approx(want, abs=0.1)


@pytest.fixture(scope="module")
def w4_folder(tiny_model_factory, tmp_path_factory) -> str:
    return _build(tiny_model_factory("llama"), 4, 32, str(tmp_path_factory.mktemp("pq") / "w4"))


@pytest.mark.parametrize("weights,message", [
    ({"symmetric": False}, r"weights\.symmetric=False \(weight_zero_point"),
    ({"actorder": "weight"}, r"weights\.actorder='weight' \(g_idx"),
    ({"num_bits": 2}, r"weights\.num_bits=2"),
    ({"group_size": 48}, r"weights\.group_size=48 does not divide a layer's 64 input"),
    ({"strategy": "tensor", "group_size": None}, r"weights\.strategy='tensor'"),
], ids=["asymmetric", "actorder", "num_bits", "group_size", "strategy"])
def test_unsupported_pack_quantized_is_refused(w4_folder, tmp_path, weights, message):
    folder = str(tmp_path / "ckpt")
    shutil.copytree(w4_folder, folder)
    with open(f"{folder}/config.json") as f:
        config = json.load(f)
    config["quantization_config"]["config_groups"]["group_0"]["weights"].update(weights)
    with open(f"{folder}/config.json", "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match=message):
        LLM(model=folder, dtype="float32", num_kv_blocks=16)
