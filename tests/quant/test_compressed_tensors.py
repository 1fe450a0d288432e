"""Pre-quantized compressed-tensors checkpoints (FP8 dynamic, FP8 static, INT8 W8A8, FP8
weight-only) built here from a tiny Llama with the compressed-tensors package's own helpers
(``apply_quantization_config``, ``calculate_qparams``, ``ModelCompressor``), loaded by kvflow
from config.json alone and checked against transformers loading the same folder (it
decompresses the weights and quantizes each linear's input as the scheme says)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from compressed_tensors.compressors import ModelCompressor
from compressed_tensors.quantization import (
    QuantizationConfig,
    QuantizationScheme,
    QuantizationStatus,
    apply_quantization_config,
    preset_name_to_scheme,
)
from compressed_tensors.quantization.utils import calculate_qparams

from kvflow import LLM, SamplingParams
from kvflow.quant.fp8 import Fp8LinearMethod
from kvflow.quant.int8 import Int8WeightOnlyMethod
from tests.quant.quant_logprobs import engine_prompt_logprobs


def _observe_inputs(model: torch.nn.Module, ids: torch.Tensor) -> dict[str, float]:
    """absmax of each linear's input over one calibration forward."""
    seen: dict[str, float] = {}
    hooks = [m.register_forward_pre_hook(
        lambda m, a, n=n: seen.__setitem__(n, max(seen.get(n, 0.0), float(a[0].abs().max()))))
        for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    with torch.no_grad():
        model(ids)
    for h in hooks:
        h.remove()
    return seen


def _scheme(preset: str) -> QuantizationScheme:
    if preset == "FP8_WEIGHT_ONLY":  # FP8 channel weights, activations left alone (W8A16)
        scheme = preset_name_to_scheme("FP8_DYNAMIC", ["Linear"])
        scheme.input_activations = None
        return scheme
    if preset == "INT8_WEIGHT_ONLY":  # INT8 channel weights, activations left alone (W8A16)
        scheme = preset_name_to_scheme("W8A8", ["Linear"])
        scheme.input_activations = None
        return scheme
    if preset == "FP8_TENSOR_DYNAMIC":  # one weight scale per q/k/v/gate/up tensor, dynamic acts
        scheme = preset_name_to_scheme("FP8_DYNAMIC", ["Linear"])
        scheme.weights.strategy = "tensor"
        return scheme
    return preset_name_to_scheme(preset, ["Linear"])


def build_checkpoint(tiny, preset: str, folder: str,
                     groups: dict[str, QuantizationScheme] | None = None) -> str:
    """Quantize ``tiny``'s HF model with a compressed-tensors preset (or the config ``groups``)
    and save it (plus the tokenizer) in ``folder``; static input scales come from one
    calibration forward."""
    import copy

    model = copy.deepcopy(tiny.hf_model)
    calib = _observe_inputs(model, torch.arange(2, 30).unsqueeze(0))
    qc = QuantizationConfig(config_groups=groups or {"group_0": _scheme(preset)},
                            ignore=["lm_head"], quantization_status=QuantizationStatus.INITIALIZED)
    apply_quantization_config(model, qc)
    for name, m in model.named_modules():
        scheme = getattr(m, "quantization_scheme", None)
        if scheme is None:
            continue
        w, args = m.weight.data, scheme.weights
        dims = {"dim": 1, "keepdim": True} if args.strategy == "channel" else {}
        scale, _ = calculate_qparams(w.amin(**dims).reshape(-1), w.amax(**dims).reshape(-1),
                                     args)
        m.weight_scale.data.copy_(scale.reshape(m.weight_scale.shape))
        if hasattr(m, "input_scale"):
            m.input_scale.data.fill_(calib[name] / 448)
        m.quantization_status = QuantizationStatus.FROZEN
    # llm-compressor stores INT8 weight-only as pack-quantized (test_pack_quantized.py); the
    # int-quantized format holds the same int8 values unpacked
    fmt = "int-quantized" if preset == "INT8_WEIGHT_ONLY" else None
    return save_compressed(model, tiny, folder, fmt)


def save_compressed(model, tiny, folder: str, fmt: str | None = None) -> str:
    """Compress ``model`` (its quantization config applied and frozen) in compressed-tensors
    format ``fmt`` (None: the library's choice) and save it with ``tiny``'s tokenizer."""
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    compressor.compress_model(model)
    model.save_pretrained(folder)
    compressor.update_config(folder)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{tiny.path}/{f}", folder)
    return folder


def _hf_logprobs(folder: str, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


@pytest.mark.parametrize("preset,method,weight_dtype", [
    ("FP8_DYNAMIC", Fp8LinearMethod, torch.float8_e4m3fn),
    ("FP8", Fp8LinearMethod, torch.float8_e4m3fn),
    ("W8A8", Int8WeightOnlyMethod, torch.int8),
    ("FP8_WEIGHT_ONLY", Fp8LinearMethod, torch.float8_e4m3fn),
    ("FP8_TENSOR_DYNAMIC", Fp8LinearMethod, torch.float8_e4m3fn),
    ("INT8_WEIGHT_ONLY", Int8WeightOnlyMethod, torch.int8),
])
def test_checkpoint_matches_transformers(tiny_model_factory, tmp_path, preset, method,
                                         weight_dtype):
    tiny = tiny_model_factory("llama")
    folder = build_checkpoint(tiny, preset, str(tmp_path / preset))
    prompt = torch.randint(2, tiny.vocab_size, (12,), generator=torch.Generator().manual_seed(5))
    llm = LLM(model=folder, dtype="float32", num_kv_blocks=64, block_size=4)
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    (out,) = llm.generate([prompt.tolist()], params, use_tqdm=False)
    ref = _hf_logprobs(folder, prompt.tolist())
    got = [next(iter(d.values())).logprob for d in out.prompt_logprobs[1:]]
    want = [float(ref[i, t]) for i, t in enumerate(prompt.tolist()[1:])]
    # W8A8 rounds each linear's input to INT8: a last-bit difference in an input (kvflow's
    # native kernels sum in another order than torch) can move one value across a rounding
    # boundary, a step of absmax / 127.5 (seen: 5.5e-4 on one logprob of 11, on an AVX2 CPU);
    # FP8 activations likewise (seen: 1.0e-3 with per-tensor weights, whose dequantized values
    # equal transformers' exactly)
    tol = 5e-3 if preset in ("W8A8", "FP8_TENSOR_DYNAMIC") else 5e-4
    assert got == pytest.approx(want, abs=tol)
    # the quantization is real: transformers on the unquantized weights differs
    with torch.no_grad():
        plain = torch.log_softmax(tiny.hf_model(prompt.unsqueeze(0)).logits[0], dim=-1)
    assert max(abs(w - float(plain[i, t])) for i, (w, t) in
               enumerate(zip(want, prompt.tolist()[1:]))) > 4 * tol
    layer = llm.engine.core.executor.runner.model.model.layers[1].mlp.gate_up_proj
    assert isinstance(layer.quant_method, method) and layer.weight.dtype == weight_dtype


def test_unsupported_scheme_is_a_value_error(tiny_model_factory, tmp_path):
    """An unpacked (``int-quantized``) INT4 group-wise config is refused before any tensor is
    read (packed INT4, llm-compressor's W4A16, loads: tests/quant/test_pack_quantized.py)."""
    folder = build_checkpoint(tiny_model_factory("llama"), "FP8_DYNAMIC", str(tmp_path / "w4"))
    with open(f"{folder}/config.json") as f:
        config = json.load(f)
    qc = config["quantization_config"]
    qc["format"] = qc["config_groups"]["group_0"]["format"] = "int-quantized"
    qc["config_groups"]["group_0"]["input_activations"] = None
    qc["config_groups"]["group_0"]["weights"] = {"num_bits": 4, "type": "int",
                                                 "strategy": "group", "group_size": 32,
                                                 "symmetric": True, "dynamic": False}
    with open(f"{folder}/config.json", "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match="scheme not supported.*int4/group"):
        LLM(model=folder, dtype="float32", num_kv_blocks=16)


def test_requantizing_a_quantized_checkpoint_is_refused(tiny_model_factory, tmp_path):
    folder = build_checkpoint(tiny_model_factory("llama"), "FP8_DYNAMIC", str(tmp_path / "f"))
    with pytest.raises(ValueError, match="already quantized"):
        LLM(model=folder, dtype="float32", quantization="int8", num_kv_blocks=16)


def test_quantized_lm_head_is_refused(tiny_model_factory, tmp_path):
    folder = build_checkpoint(tiny_model_factory("llama"), "FP8_DYNAMIC", str(tmp_path / "h"))
    with open(f"{folder}/config.json") as f:
        config = json.load(f)
    config["quantization_config"]["ignore"] = []
    with open(f"{folder}/config.json", "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match="quantizes 'lm_head'"):
        LLM(model=folder, dtype="float32", num_kv_blocks=16)


def test_most_specific_target_wins(tiny_model_factory, tmp_path):
    """Two groups both match down_proj ("Linear" FP8, "re:.*down_proj$" INT8 W8A8): as in
    compressed-tensors, the regex beats the class name whatever the group order (kvflow took
    the first group listed, FP8, and cast the stored int8 values to float8)."""
    tiny = tiny_model_factory("llama")
    groups = {"group_0": preset_name_to_scheme("FP8_DYNAMIC", ["Linear"]),
              "group_1": preset_name_to_scheme("W8A8", ["re:.*down_proj$"])}
    folder = build_checkpoint(tiny, "", str(tmp_path / "mixed"), groups)
    prompt = torch.randint(2, tiny.vocab_size, (12,),
                           generator=torch.Generator().manual_seed(5)).tolist()
    llm = LLM(model=folder, dtype="float32", num_kv_blocks=64, block_size=4)
    mlp = llm.engine.core.executor.runner.model.model.layers[1].mlp
    assert isinstance(mlp.down_proj.quant_method, Int8WeightOnlyMethod)
    assert isinstance(mlp.gate_up_proj.quant_method, Fp8LinearMethod)
    ref = _hf_logprobs(folder, prompt)
    want = [float(ref[i, t]) for i, t in enumerate(prompt[1:])]
    assert engine_prompt_logprobs(llm, prompt) == pytest.approx(want, abs=5e-3)


def test_fused_shards_with_different_schemes_are_refused(tiny_model_factory, tmp_path):
    """q_proj left unquantized while k_proj/v_proj are FP8: kvflow's one qkv_proj layer cannot
    hold both, so the load stops with a ValueError naming the layer and each shard's scheme."""
    folder = build_checkpoint(tiny_model_factory("llama"), "FP8_DYNAMIC", str(tmp_path / "q"))
    with open(f"{folder}/config.json") as f:
        config = json.load(f)
    config["quantization_config"]["ignore"] = ["lm_head", "re:.*q_proj$"]
    with open(f"{folder}/config.json", "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match=r"shards of 'model.layers.0.self_attn.qkv_proj' "
                                         r"differently \(q_proj: unquantized, k_proj: weights "
                                         r"float8/channel"):
        LLM(model=folder, dtype="float32", num_kv_blocks=16)


@pytest.fixture(scope="module")
def fp8_dynamic_folder(tiny_model_factory, tmp_path_factory) -> str:
    """One FP8_DYNAMIC checkpoint of the tiny Llama, to copy and edit."""
    return build_checkpoint(tiny_model_factory("llama"), "FP8_DYNAMIC",
                            str(tmp_path_factory.mktemp("ct") / "fp8_dynamic"))


def _set(key: str, value):
    return lambda qc: qc.__setitem__(key, value)


def _set_in_group(key: str, value):
    return lambda qc: qc["config_groups"]["group_0"].__setitem__(key, value)


@pytest.mark.parametrize("edit,message", [
    # each of these changes what the model computes, and compressed-tensors' config parser
    # drops (or kvflow did not read) it: the checkpoint used to load as plain FP8
    (_set_in_group("output_activations", {"num_bits": 8, "type": "float", "strategy": "token",
                                          "dynamic": True}),
     r"scheme not supported \(.*output activations quantized\)"),
    (_set_in_group("weights", None), r"scheme not supported \(weights none,"),
    (_set("transform_config", {"config_groups": {"u": {"type": "hadamard", "apply": [
        {"targets": ["Linear"], "location": "input"}]}}}), "transform_config is not supported"),
    (_set("sparsity_config", {"format": "sparse-24-bitmask", "sparsity_structure": "2:4",
                              "targets": ["Linear"]}),
     "sparsity_config.format='sparse-24-bitmask' is not supported"),
], ids=["output_activations", "no_weights", "transform_config", "sparsity_config"])
def test_unread_numerics_keys_are_refused(fp8_dynamic_folder, tmp_path, edit, message):
    folder = str(tmp_path / "ckpt")
    shutil.copytree(fp8_dynamic_folder, folder)
    with open(f"{folder}/config.json") as f:
        config = json.load(f)
    edit(config["quantization_config"])
    with open(f"{folder}/config.json", "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match=message):
        LLM(model=folder, dtype="float32", num_kv_blocks=16)


@pytest.mark.parametrize("preset,stored", [("FP8_DYNAMIC", "float8_e4m3fn"), ("W8A8", "int8")])
def test_float_weights_under_a_quantized_config_are_refused(tiny_model_factory, tmp_path,
                                                            preset, stored):
    """A folder whose config says the linears are FP8/INT8 but whose safetensors hold the
    dequantized float weights (``q * scale``): kvflow cast them to float8/int8 with the scales
    still applied on top (wrong logits, no error); now the tensor is named."""
    from safetensors.torch import load_file, save_file

    folder = build_checkpoint(tiny_model_factory("llama"), preset, str(tmp_path / preset))
    tensors = load_file(f"{folder}/model.safetensors")
    for name in [n for n in tensors if n.endswith(".weight_scale")]:
        weight = name.removesuffix("_scale")
        tensors[weight] = tensors[weight].float() * tensors[name].float()
    save_file(tensors, f"{folder}/model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"checkpoint tensor 'model\.layers\.0\..*\.weight': "
                                         rf"stored as torch.float32, .* quantized to torch\.{stored}"):
        LLM(model=folder, dtype="float32", num_kv_blocks=16)


def test_kv_cache_scheme_scales_are_skipped(fp8_dynamic_folder, tmp_path):
    """An FP8-KV checkpoint (``kv_cache_scheme`` plus per-layer ``self_attn.k_scale`` /
    ``v_scale``) failed to load ('k_scale matches no parameter'); the scales are skipped and
    the logits are the same checkpoint's without them (the cache type is --kv-cache-dtype's)."""
    from safetensors.torch import load_file, save_file

    folder = str(tmp_path / "kv")
    shutil.copytree(fp8_dynamic_folder, folder)
    with open(f"{folder}/config.json") as f:
        config = json.load(f)
    config["quantization_config"]["kv_cache_scheme"] = {
        "num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False,
        "symmetric": True}
    with open(f"{folder}/config.json", "w") as f:
        json.dump(config, f)
    tensors = load_file(f"{folder}/model.safetensors")
    for i in range(2):
        tensors[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(0.01)
        tensors[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(0.01)
    save_file(tensors, f"{folder}/model.safetensors", metadata={"format": "pt"})
    prompt = list(range(5, 17))
    kw = {"dtype": "float32", "num_kv_blocks": 16, "block_size": 4}
    want = engine_prompt_logprobs(LLM(model=fp8_dynamic_folder, **kw), prompt)
    assert engine_prompt_logprobs(LLM(model=folder, **kw), prompt) == want


@pytest.mark.parametrize("target", ["re:.*self_attn$", "LlamaAttention"])
def test_attention_quantization_group_is_refused(fp8_dynamic_folder, tmp_path, target):
    """A group targeting the attention modules (compressed-tensors then quantizes queries,
    keys and values inside attention) was ignored: the folder loaded as plain FP8 linears."""
    folder = str(tmp_path / "attn")
    shutil.copytree(fp8_dynamic_folder, folder)
    with open(f"{folder}/config.json") as f:
        config = json.load(f)
    qc = config["quantization_config"]
    qc["config_groups"]["attn"] = {"targets": [target], "input_activations": {
        "num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}}
    with open(f"{folder}/config.json", "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match="group 'attn' targets the attention module "
                                         "'model.layers.0.self_attn'"):
        LLM(model=folder, dtype="float32", num_kv_blocks=16)


def test_quantized_moe_gate_is_refused(tiny_model_factory, tmp_path):
    """Qwen2-MoE's shared_expert_gate is an nn.Linear, so a "Linear" group quantizes it; kvflow
    keeps routers and gates unquantized, and failed with 'shared_expert_gate.weight_scale
    matches no parameter'; now the error names the layer and why."""
    folder = build_checkpoint(tiny_model_factory("qwen2_moe"), "FP8_DYNAMIC",
                              str(tmp_path / "moe"))
    with pytest.raises(ValueError, match=r"quantizes 'model\.layers\.0\.mlp\.\w+', which kvflow "
                                         r"keeps unquantized"):
        LLM(model=folder, dtype="float32", num_kv_blocks=16)
