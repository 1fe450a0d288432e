"""GPTQ and AWQ 4-bit checkpoints. The oracle is a small packer written here from the formats'
specs (AutoGPTQ's ``qweight`` [K/8, N] packed along input rows, ``qzeros`` [G, N/8] holding
``zero - 1`` in the ``gptq`` format; AutoAWQ GEMM's [K, N/8] words in the interleaved column
order 0,2,4,6,1,3,5,7): the tiny Llama's linears are quantized with known scales and zeros,
packed, saved, and kvflow's logits are compared with transformers running the dequantized
float weights ``(q - zero) * scale``."""

from __future__ import annotations

import copy
import json
import shutil

import pytest
import torch
from safetensors.torch import save_file

from kvflow import LLM, SamplingParams
from kvflow.quant.gptq_awq import GPTQAWQMethod, GPTQInt8Method, unpack_nibble_columns
from tests.quant.quant_logprobs import engine_prompt_logprobs, hf_prompt_logprobs

_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's pack order


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 values in [0, 2^32) -> the int32 of the same bits."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _pack_rows(q: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """int64 [R, C] of ``bits``-bit values -> int32 [R / p, C], p = 32 / bits: rows pi..pi+p-1
    at bits 0, bits, 2 bits, ..."""
    p = 32 // bits
    q = q.view(-1, p, q.shape[1])
    return _to_int32(sum(q[:, j] << (bits * j) for j in range(p)))


def _pack_cols(q: torch.Tensor, order=None, bits: int = 4) -> torch.Tensor:
    """int64 [R, C] -> int32 [R, C / p]: bits ``bits * j`` of word c hold column
    ``p c + order[j]`` (default order: j)."""
    p = 32 // bits
    order = order or tuple(range(p))
    q = q.view(q.shape[0], -1, p)
    return _to_int32(sum(q[..., order[j]] << (bits * j) for j in range(p)))


def _quantize(w: torch.Tensor, g_idx: torch.Tensor, groups: int, sym: bool, min_zero: int,
              bits: int = 4):
    """Asymmetric (or symmetric, zero 2^(bits-1)) min/max quantization of ``w`` [N, K] by the
    groups ``g_idx`` [K] names. Returns q int64 [N, K], scale fp16 [G, N], zero int64 [G, N]
    and the dequantized float32 weight."""
    top, mid = (1 << bits) - 1, 1 << (bits - 1)
    n, _ = w.shape
    scale, zero = torch.empty(groups, n), torch.empty(groups, n, dtype=torch.int64)
    for g in range(groups):
        cols = w[:, g_idx == g]
        lo, hi = cols.amin(1).clamp(max=0), cols.amax(1).clamp(min=0)
        if sym:
            s, z = torch.maximum(-lo / mid, hi / (mid - 1)), torch.full((n,), mid)
        else:
            s = (hi - lo) / top
            z = torch.round(-lo / s).to(torch.int64).clamp(min_zero, top)
        scale[g], zero[g] = s.half().float(), z
    s_k, z_k = scale[g_idx].t(), zero[g_idx].t()  # [N, K]
    q = torch.clamp(torch.round(w / s_k) + z_k, 0, top).to(torch.int64)
    return q, scale.half(), zero, (q - z_k).float() * s_k


def _build(tiny, folder: str, method: str, group: int, *, sym: bool = False,
           fmt: str = "gptq", desc_act: bool = False, skip: tuple[str, ...] = (),
           bits: int = 4):
    """``tiny`` quantized and packed as ``method`` writes it (the linears named in ``skip``
    left float, as ``modules_to_not_convert`` says); returns (folder, the HF model with the
    dequantized weights)."""
    model = copy.deepcopy(tiny.hf_model)
    tied = tiny.hf_model.config.tie_word_embeddings
    tensors = {k: v.contiguous() for k, v in tiny.hf_model.state_dict().items()
               if not k.endswith(tuple(f"{p}.weight" for p in _LINEARS if p not in skip))
               and not (tied and k == "lm_head.weight")}
    gen = torch.Generator().manual_seed(3)
    perms: dict[str, torch.Tensor] = {}
    for name, m in model.named_modules():
        if not name.endswith(_LINEARS) or name.endswith(skip):
            continue
        k = m.in_features
        g = group if group > 0 else k
        # act order: one column order per layer input (q/k/v share it, as gate/up do)
        key = name if name.endswith(("o_proj", "down_proj")) else name.rsplit(".", 1)[0]
        perm = perms.setdefault(key, torch.randperm(k, generator=gen) if desc_act
                                else torch.arange(k))
        g_idx = torch.empty(k, dtype=torch.int32)
        g_idx[perm] = (torch.arange(k) // g).to(torch.int32)
        q, scale, zero, w = _quantize(m.weight.data, g_idx, k // g, sym,
                                      1 if method == "gptq" and fmt == "gptq" else 0, bits)
        m.weight.data = w
        stored_zero = zero - (1 if method == "gptq" and fmt == "gptq" else 0)
        if method == "gptq":
            tensors[f"{name}.qweight"] = _pack_rows(q.t().contiguous(), bits)
            tensors[f"{name}.qzeros"] = _pack_cols(stored_zero, bits=bits)
            tensors[f"{name}.g_idx"] = g_idx
        else:
            tensors[f"{name}.qweight"] = _pack_cols(q.t().contiguous(), _ORDER)
            tensors[f"{name}.qzeros"] = _pack_cols(stored_zero, _ORDER)
        tensors[f"{name}.scales"] = scale
    shutil.copytree(tiny.path, folder)
    save_file(tensors, f"{folder}/model.safetensors")
    with open(f"{folder}/config.json") as f:
        config = json.load(f)
    if method == "gptq":
        qc = {"quant_method": "gptq", "bits": bits, "group_size": group, "sym": sym,
              "desc_act": desc_act, "checkpoint_format": fmt}
    else:
        qc = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
              "version": "gemm", "modules_to_not_convert": list(skip) or None}
    config["quantization_config"] = qc
    with open(f"{folder}/config.json", "w") as f:
        json.dump(config, f)
    return folder, model.eval()


def test_unpack_hand_made_words():
    """One word per layout, worked by hand: 0x76543210 holds 0..7 from the low nibble up;
    AWQ's slot j is column [0,2,4,6,1,3,5,7][j], so columns read 0,4,1,5,2,6,3,7; a negative
    word (0xFEDCBA98) reads its nibbles unsigned."""
    words = torch.tensor([[0x76543210, 0xFEDCBA98 - 2**32]], dtype=torch.int32)
    assert unpack_nibble_columns(words, awq=False).tolist() == [list(range(16))]
    assert unpack_nibble_columns(words, awq=True).tolist() == [
        [0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15]]


_CASES = {  # (method, group_size, _build options, tiny model)
    "gptq-sym-g32": ("gptq", 32, {"sym": True}, "llama"),
    "gptq-asym-g32": ("gptq", 32, {}, "llama"),
    "gptq-v2-g16": ("gptq", 16, {"fmt": "gptq_v2"}, "llama"),  # 16: the dequantizing reference
    "gptq-channel": ("gptq", -1, {"sym": True}, "llama"),
    "gptq-desc-act": ("gptq", 32, {"desc_act": True}, "llama"),
    "gptq-qwen2-bias": ("gptq", 32, {}, "qwen2"),  # q/k/v biases beside the packed weights
    "gptq-int8-g32": ("gptq", 32, {"sym": True, "bits": 8}, "llama"),  # INT8, group scales
    "gptq-int8-g64": ("gptq", 64, {"sym": True, "bits": 8}, "llama"),  # in the native kernel
    "gptq-int8-g32-desc-act": ("gptq", 32, {"sym": True, "bits": 8, "desc_act": True}, "llama"),
    "gptq-int8-channel": ("gptq", -1, {"sym": True, "bits": 8}, "llama"),
    "awq-g32": ("awq", 32, {}, "llama"),
    "awq-g64": ("awq", 64, {}, "llama"),
    "awq-skip-down": ("awq", 32, {"skip": ("down_proj",)}, "llama"),  # modules_to_not_convert
}


@pytest.mark.parametrize("case", list(_CASES))
def test_matches_dequantized_transformers(tiny_model_factory, tmp_path, case):
    """kvflow refused quant_method gptq/awq; now its logprobs and greedy tokens are
    transformers' on the dequantized weights."""
    method, group, kw, arch = _CASES[case]
    tiny = tiny_model_factory(arch)
    folder, ref = _build(tiny, str(tmp_path / "ckpt"), method, group, **kw)
    ids = torch.randint(2, tiny.vocab_size, (12,),
                        generator=torch.Generator().manual_seed(5)).tolist()
    want = hf_prompt_logprobs(ref, ids)
    llm = LLM(model=folder, dtype="float32", num_kv_blocks=32, block_size=4)
    assert engine_prompt_logprobs(llm, ids) == pytest.approx(want, abs=5e-4)
    layers = llm.engine.core.executor.runner.model.model.layers
    want_cls = GPTQInt8Method if "int8" in case else GPTQAWQMethod
    assert type(layers[1].mlp.gate_up_proj.quant_method) is want_cls
    assert (layers[0].self_attn.qkv_proj.input_perm is not None) == ("desc" in case)
    assert (type(layers[0].mlp.down_proj.quant_method) is want_cls) == ("skip" not in case)
    (out,) = llm.generate([ids], SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    with torch.no_grad():
        hf = ref.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False)
    assert list(out.outputs[0].token_ids) == hf[0, len(ids):].tolist()
    plain = hf_prompt_logprobs(tiny.hf_model, ids)  # the quantization is real
    assert max(abs(a - b) for a, b in zip(plain, want)) > 2e-3


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_bf16_runs_torch_int4_kernel(tiny_model_factory, tmp_path, method):
    """bf16 runs torch's CPU int4 kernel on the unpacked nibbles (group 32, zeros folded into
    tinygemm's ``(8 - zero) * scale``): within bf16 rounding of the float reference."""
    tiny = tiny_model_factory("llama")
    folder, ref = _build(tiny, str(tmp_path / "ckpt"), method, 32,
                         desc_act=method == "gptq")
    ids = list(range(5, 17))
    llm = LLM(model=folder, dtype="bfloat16", num_kv_blocks=32, block_size=4)
    layer = llm.engine.core.executor.runner.model.model.layers[0].self_attn.qkv_proj
    assert layer.int4_cpu_packed and layer.quant_method.group_size == 32
    assert engine_prompt_logprobs(llm, ids) == pytest.approx(hf_prompt_logprobs(ref, ids), abs=0.1)


@pytest.fixture(scope="module")
def gptq_folder(tiny_model_factory, tmp_path_factory) -> str:
    return _build(tiny_model_factory("llama"), str(tmp_path_factory.mktemp("gq") / "g"),
                  "gptq", 32)[0]


def _edited(src: str, dst: str, quantization_config: dict) -> str:
    shutil.copytree(src, dst)
    with open(f"{dst}/config.json") as f:
        config = json.load(f)
    config["quantization_config"].update(quantization_config)
    with open(f"{dst}/config.json", "w") as f:
        json.dump(config, f)
    return dst


@pytest.mark.parametrize("edit,message", [
    ({"bits": 3}, r"gptq quantization_config not supported: bits=3 \(4 or 8\)"),
    ({"bits": 8, "sym": False}, r"bits=8 with sym=False \(8-bit runs symmetric only\)"),
    ({"quant_method": "awq", "bits": 8},
     r"awq quantization_config not supported: bits=8 \(4 only\)"),
    ({"checkpoint_format": "marlin"}, r"checkpoint_format='marlin'"),
    ({"dynamic": {"-:.*down_proj": {}}}, r"dynamic \(per-module overrides\)"),
    ({"quant_method": "awq", "version": "gemv"},
     r"awq quantization_config not supported: version='gemv' \(gemm only\)"),
    ({"quant_method": "awq", "zero_point": False}, r"zero_point=False"),
    ({"quant_method": "awq", "version": "exllama"}, r"version='exllama'"),
    ({"group_size": 48}, r"gptq group_size=48 does not divide a layer's 64 input columns"),
], ids=["bits3", "int8-asym", "awq-bits8", "format", "dynamic", "awq-gemv", "awq-no-zero", "awq-exllama", "group"])
def test_unsupported_layout_is_refused(gptq_folder, tmp_path, edit, message):
    folder = _edited(gptq_folder, str(tmp_path / "ckpt"), edit)
    with pytest.raises(ValueError, match=message):
        LLM(model=folder, dtype="float32", num_kv_blocks=16)


def test_quantization_flag_must_match(gptq_folder, tiny_model_factory):
    """``--quantization gptq`` (or vLLM's ``gptq_marlin``) loads a GPTQ folder; ``awq`` names
    both methods; ``gptq`` on a float folder says what it needs."""
    ids = list(range(5, 12))
    want = engine_prompt_logprobs(LLM(model=gptq_folder, dtype="float32", num_kv_blocks=16), ids)
    alias = LLM(model=gptq_folder, dtype="float32", num_kv_blocks=16, quantization="gptq_marlin")
    assert engine_prompt_logprobs(alias, ids) == want
    with pytest.raises(ValueError, match=r"quantization='awq' does not match the checkpoint, "
                                         r"whose quantization_config.quant_method is 'gptq'"):
        LLM(model=gptq_folder, dtype="float32", num_kv_blocks=16, quantization="awq")
    with pytest.raises(ValueError, match=r"quantization='gptq' needs a checkpoint whose "
                                         r"config.json has a quantization_config with "
                                         r"quant_method 'gptq', which this model's"):
        LLM(model=tiny_model_factory("llama").path, dtype="float32", num_kv_blocks=16,
            quantization="gptq")


GGUF_REFUSAL = ("quantization={asked!r} needs a checkpoint whose config.json has a "
                "quantization_config with quant_method {method!r}; this model is a .gguf file, "
                "whose weights carry llama.cpp's own quantization (read as 'gguf'): leave "
                "quantization unset, or give gguf")


class _Loaded(AssertionError):
    """Raised by the stand-in for the step that starts loading the model's weights."""


@pytest.mark.parametrize("asked, method", [("awq", "awq"), ("gptq_marlin", "gptq")])
def test_checkpoint_scheme_on_a_gguf_is_refused_before_loading(monkeypatch, asked, method):
    """``--quantization awq`` on a GGUF said "has a awq quantization_config" once the
    engine core was building the model (~12 s into ``kvflow serve``); now it is refused
    from the file's metadata (GGUF: no quantization_config) before anything loads: offline
    before the engine core is made, served before the core processes are let go (both
    replaced by stand-ins that fail the test), worded for a GGUF."""
    from kvflow.config import EngineConfig
    from kvflow.engine import async_llm, llm_engine

    def loaded(*args, **kwargs):
        raise _Loaded("the engine went on to load the model")

    expected = GGUF_REFUSAL.format(asked=asked, method=method)
    monkeypatch.setattr(llm_engine, "EngineCore", loaded)
    with pytest.raises(ValueError) as info:
        LLM(model="SmolLM2-135M-Instruct", quantization=asked)
    assert str(info.value) == expected
    monkeypatch.setattr(async_llm.ReplicaSet, "start", lambda self, gated=False: None)
    monkeypatch.setattr(async_llm.ReplicaSet, "release", loaded)
    with pytest.raises(ValueError) as info:
        async_llm.AsyncLLM(EngineConfig.from_kwargs(model="SmolLM2-135M-Instruct",
                                                    quantization=asked))
    assert str(info.value) == expected


def test_fused_shards_with_different_act_order_are_refused(tiny_model_factory, tmp_path):
    """q, k and v fuse into one layer, which takes one column order: k_proj's g_idx differing
    from q_proj's is a ValueError (not a silently wrong k)."""
    tiny = tiny_model_factory("llama")
    folder, _ = _build(tiny, str(tmp_path / "ckpt"), "gptq", 32, desc_act=True)
    from safetensors.torch import load_file

    tensors = load_file(f"{folder}/model.safetensors")
    name = "model.layers.0.self_attn.k_proj.g_idx"
    tensors[name] = tensors[name].flip(0).contiguous()
    save_file(tensors, f"{folder}/model.safetensors")
    with pytest.raises(ValueError, match=r"self_attn\.[qkv]_proj\.g_idx'.*the g_idx \(desc_act "
                                         r"order\) of the shards kvflow fuses into one layer"):
        LLM(model=folder, dtype="float32", num_kv_blocks=16)


def test_modules_in_block_to_quantize():
    """optimum's ``modules_in_block_to_quantize`` leaves the unnamed linears float; a fused
    layer needs all its shards named or none."""
    from kvflow.quant.gptq_awq import int4_checkpoint_method

    mapping = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"),
               "v_proj": ("qkv_proj", "v"), "gate_proj": ("gate_up_proj", 0),
               "up_proj": ("gate_up_proj", 1)}
    config = {"quant_method": "gptq", "bits": 4, "group_size": 32,
              "modules_in_block_to_quantize": [
                  ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
                  ["mlp.down_proj"]]}
    got = {name: int4_checkpoint_method(config, f"model.layers.0.{name}", mapping) is not None
           for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj",
                        "mlp.down_proj")}
    assert got == {"self_attn.qkv_proj": True, "self_attn.o_proj": False,
                   "mlp.gate_up_proj": False, "mlp.down_proj": True}
    config["modules_in_block_to_quantize"] = [["self_attn.q_proj", "self_attn.k_proj"]]
    with pytest.raises(ValueError, match=r"quantizes some shards of "
                                         r"'model.layers.0.self_attn.qkv_proj' and not others"):
        int4_checkpoint_method(config, "model.layers.0.self_attn.qkv_proj", mapping)


def _gptq_tensors(w: torch.Tensor, group: int, perm: torch.Tensor | None = None):
    """``w`` [N, K] quantized (asymmetric) and packed as GPTQ (``gptq`` format) with columns
    ``perm`` in act order; returns ({qweight, qzeros, scales, g_idx}, the dequantized w)."""
    k = w.shape[1]
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[torch.arange(k) if perm is None else perm] = (torch.arange(k) // group).int()
    q, scale, zero, deq = _quantize(w, g_idx, k // group, False, 1)
    return {"qweight": _pack_rows(q.t().contiguous()), "qzeros": _pack_cols(zero - 1),
            "scales": scale, "g_idx": g_idx}, deq


def _awq_tensors(w: torch.Tensor, group: int):
    k = w.shape[1]
    q, scale, zero, deq = _quantize(w, torch.arange(k) // group, k // group, False, 0)
    return {"qweight": _pack_cols(q.t().contiguous(), _ORDER),
            "qzeros": _pack_cols(zero, _ORDER), "scales": scale}, deq


def _method(name: str, group: int, bits: int = 4) -> GPTQAWQMethod | GPTQInt8Method:
    from kvflow.quant.gptq_awq import parse_int4_checkpoint

    fmt = parse_int4_checkpoint({"quant_method": name, "bits": bits, "group_size": group})
    return GPTQInt8Method(fmt) if bits == 8 else GPTQAWQMethod(fmt)


def test_row_parallel_ranks_sum_to_the_dequantized_product():
    """tensor_parallel_size=2: each rank of a row-parallel GPTQ layer unpacks its half of the
    input rows (and of the groups and trivial g_idx); the partial products sum to
    ``x @ W.T`` of the dequantized weight."""
    from kvflow.layers.linear import RowParallelLinear

    gen = torch.Generator().manual_seed(1)
    tensors, deq = _gptq_tensors(torch.randn(32, 64, generator=gen), 16)
    x = torch.randn(3, 64, generator=gen)
    partial = []
    for rank in range(2):
        layer = RowParallelLinear(64, 32, tp_rank=rank, tp_size=2)
        layer.set_quant_method(_method("gptq", 16))
        for name, t in tensors.items():
            param = getattr(layer, name)
            param.weight_loader(param, t)
        layer.quant_method.process_weights_after_loading(layer)
        partial.append(layer.quant_method.apply(layer, x.chunk(2, dim=1)[rank]))
    torch.testing.assert_close(partial[0] + partial[1], x @ deq.t(), rtol=0, atol=1e-4)

    tensors, _ = _gptq_tensors(torch.randn(32, 64, generator=gen), 16,
                               torch.randperm(64, generator=gen))
    layer = RowParallelLinear(64, 32, tp_rank=1, tp_size=2)
    layer.set_quant_method(_method("gptq", 16))
    for name, t in tensors.items():
        getattr(layer, name).weight_loader(getattr(layer, name), t)
    with pytest.raises(ValueError, match=r"gptq desc_act: .* under tensor parallelism"):
        layer.quant_method.process_weights_after_loading(layer)


def test_qkv_column_parallel_ranks_hold_their_heads():
    """tensor_parallel_size=2: AWQ q, k and v land in each rank's fused qkv_proj as that
    rank's heads; its output is those rows of ``x @ W.T`` (dequantized)."""
    from kvflow.layers.linear import QKVParallelLinear

    gen = torch.Generator().manual_seed(2)
    shards = {s: _awq_tensors(torch.randn(rows, 64, generator=gen), 32)
              for s, rows in (("q", 64), ("k", 32), ("v", 32))}
    x = torch.randn(3, 64, generator=gen)
    for rank in range(2):
        layer = QKVParallelLinear(64, 16, 4, 2, tp_rank=rank, tp_size=2)
        layer.set_quant_method(_method("awq", 32))
        for shard, (tensors, _) in shards.items():
            for name, t in tensors.items():
                getattr(layer, name).weight_loader(getattr(layer, name), t, shard)
        layer.quant_method.process_weights_after_loading(layer)
        want = torch.cat([deq.chunk(2, dim=0)[rank] for _, deq in shards.values()])
        torch.testing.assert_close(layer.quant_method.apply(layer, x), x @ want.t(),
                                   rtol=0, atol=1e-4)


def test_extra_zero_bias_is_dropped(gptq_folder, tmp_path):
    """Older GPTQ exports carry a zero ``bias`` for layers the model builds without one: it is
    dropped (the logprobs are the folder's without it); a non-zero one is refused by name."""
    from safetensors.torch import load_file

    ids = list(range(5, 12))
    want = engine_prompt_logprobs(LLM(model=gptq_folder, dtype="float32", num_kv_blocks=16), ids)
    folder = str(tmp_path / "ckpt")
    shutil.copytree(gptq_folder, folder)
    tensors = load_file(f"{folder}/model.safetensors")
    for name in ("self_attn.q_proj", "self_attn.o_proj", "mlp.up_proj"):
        rows = tensors[f"model.layers.0.{name}.scales"].shape[1]
        tensors[f"model.layers.0.{name}.bias"] = torch.zeros(rows, dtype=torch.float16)
    save_file(tensors, f"{folder}/model.safetensors")
    assert engine_prompt_logprobs(LLM(model=folder, dtype="float32", num_kv_blocks=16), ids) == want
    tensors["model.layers.0.mlp.up_proj.bias"][3] = 0.5
    save_file(tensors, f"{folder}/model.safetensors")
    with pytest.raises(ValueError, match=r"'model.layers.0.mlp.up_proj.bias' is a non-zero "
                                         r"bias of a layer the model's config builds without"):
        LLM(model=folder, dtype="float32", num_kv_blocks=16)


def test_int8_zero_points_other_than_128_are_refused():
    """8-bit GPTQ runs as symmetric INT8 (``q - 128``): a layer whose stored zero points are
    not all 128 (asymmetric, though the config says sym) is refused, not run shifted."""
    from kvflow.layers.linear import ReplicatedLinear

    w = torch.randn(16, 32, generator=torch.Generator().manual_seed(4))
    q, scale, zero, _ = _quantize(w, torch.arange(32) // 16, 2, False, 1, bits=8)
    layer = ReplicatedLinear(32, 16)
    layer.set_quant_method(_method("gptq", 16, bits=8))
    for name, t in {"qweight": _pack_rows(q.t().contiguous(), 8),
                    "qzeros": _pack_cols(zero - 1, bits=8), "scales": scale}.items():
        getattr(layer, name).weight_loader(getattr(layer, name), t)
    with pytest.raises(ValueError, match=r"gptq bits=8: a zero point is not 128"):
        layer.quant_method.process_weights_after_loading(layer)


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_bench_compare_hf_refused_where_transformers_cannot_load(tiny_model_factory, tmp_path,
                                                                method):
    """``kvflow bench throughput --compare hf`` on a GPTQ / AWQ folder is refused before the
    run, naming the packages, exactly when transformers itself cannot load the folder (it
    needs gptqmodel; without the check the kvflow run finished and then an ImportError
    traceback came out of transformers)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from kvflow.bench.throughput import require_hf_can_run

    folder = _build(tiny_model_factory("llama"), str(tmp_path / "ckpt"), method, 32)[0]
    try:
        AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        hf_loads = True
    except (ImportError, RuntimeError):  # transformers: no gptqmodel / optimum (or no GPU)
        hf_loads = False
    config = AutoConfig.from_pretrained(folder)
    if hf_loads:
        require_hf_can_run(config)
    else:
        with pytest.raises(ValueError, match=rf"--compare hf: transformers loads this {method} "
                                             r"checkpoint .* only with gptqmodel"):
            require_hf_can_run(config)
