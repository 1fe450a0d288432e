"""Block-wise FP8 checkpoints (``quant_method: fp8`` with ``weight_block_size``, as DeepSeek-V3
and Qwen3-*-FP8 ship): built here from tiny Llama, Qwen3-MoE and DeepSeek-V3 models by
quantizing every projection block by block from the format's definition (one scale per
``bn x bk`` block, ``absmax / 448``, stored as ``weight_scale_inv``, the multiplier), loaded by
kvflow from config.json alone and checked against transformers running the dequantized
weights (``weight * scale_inv`` per block, written out here as a loop over blocks), and against
transformers loading the FP8 folder itself (on CPU it dequantizes at load)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kvflow import LLM, SamplingParams
from kvflow.attention.layer import AttentionContext
from kvflow.attention.torch_paged import TorchPagedAttentionBackend
from kvflow.distributed.comm import CommGroup
from kvflow.distributed.parallel_state import ParallelState
from kvflow.models.loader import load_hf_config, load_model
from kvflow.models.model_resolver import resolve_model
from kvflow.quant import get_quant_config
from kvflow.quant.fp8_block import dequantize_block_fp8, is_ignored
from tests.conftest import TinyModel
from tests.models.test_parity import assert_matches_hf, greedy
from tests.test_deterministic import MAX_TOKENS, _results, needs_native

E4M3 = torch.float8_e4m3fn
# every attention and MLP projection (DeepSeek's MLA ones included), experts and shared
# experts too; embeddings, LM head, norms and MoE routers (``mlp.gate``) stay float, as in
# DeepSeek-V3's and Qwen3's FP8 releases
QUANTIZED = re.compile(r"_proj(_with_mqa)?\.weight$")
BLOCKS = [(128, 128), (16, 24)]  # the real one (every tiny weight one partial block), and many


def _blocks(n: int, k: int, block: tuple[int, int]):
    bn, bk = block
    for i in range(-(-n // bn)):
        for j in range(-(-k // bk)):
            yield i, j, slice(i * bn, (i + 1) * bn), slice(j * bk, (j + 1) * bk)


def quantize_blockwise(w: torch.Tensor, block: tuple[int, int]
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn [N, K], scale_inv float32 [ceil(N/bn), ceil(K/bk)]): each block's scale
    is its absmax / 448 and its values ``e4m3(w / scale)``."""
    n, k = w.shape
    q = torch.empty(n, k, dtype=E4M3)
    s = torch.empty(-(-n // block[0]), -(-k // block[1]))
    for i, j, rows, cols in _blocks(n, k, block):
        s[i, j] = w[rows, cols].abs().max() / 448
        q[rows, cols] = (w[rows, cols] / s[i, j]).clamp(-448, 448).to(E4M3)
    return q, s


def dequantize_blockwise(q: torch.Tensor, s: torch.Tensor,
                         block: tuple[int, int]) -> torch.Tensor:
    """float32 ``q * s[i, j]`` over each block (i, j)."""
    out = torch.empty(q.shape)
    for i, j, rows, cols in _blocks(*q.shape, block):
        out[rows, cols] = q[rows, cols].float() * s[i, j]
    return out


def _read(path: str) -> dict[str, torch.Tensor]:
    with safe_open(path, "pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118


def _copy_folder(tiny: TinyModel, folder: Path, tensors: dict[str, torch.Tensor],
                 quantization_config: dict | None) -> str:
    folder.mkdir()
    for f in Path(tiny.path).iterdir():
        if f.name not in ("model.safetensors", "config.json"):
            shutil.copy(f, folder)
    config = json.loads((Path(tiny.path) / "config.json").read_text())
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    (folder / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return str(folder)


def build_fp8_checkpoint(tiny: TinyModel, folder: Path, block: tuple[int, int],
                         not_converted: tuple[str, ...] = (), **config_keys
                         ) -> tuple[str, str]:
    """Quantize ``tiny``'s projections block-wise (but the modules in ``not_converted``) and
    save (FP8 folder, folder of the same weights dequantized, no quantization_config)."""
    fp8, dequantized = {}, {}
    for name, w in _read(f"{tiny.path}/model.safetensors").items():
        if not QUANTIZED.search(name) or name.removesuffix(".weight") in not_converted:
            fp8[name] = dequantized[name] = w
            continue
        q, s = quantize_blockwise(w, block)
        fp8[name], fp8[name + "_scale_inv"] = q, s
        dequantized[name] = dequantize_blockwise(q, s, block)
    qc = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
          "weight_block_size": list(block), **config_keys}
    if not_converted:
        qc["modules_to_not_convert"] = list(not_converted)
    return (_copy_folder(tiny, folder / "fp8", fp8, qc),
            _copy_folder(tiny, folder / "dequantized", dequantized, None))


def _load(folder: str, dtype: torch.dtype, tp_rank: int | None = None) -> torch.nn.Module:
    """The bare model as loaded from ``folder`` (no engine), as TP rank ``tp_rank`` of 2 if
    given (loading sends nothing: the group's process group is a stand-in)."""
    source = resolve_model(folder)
    config = load_hf_config(source)
    parallel = None
    if tp_rank is not None:
        one, pair = CommGroup.single(), CommGroup([0, 1], tp_rank, device_group=object())
        parallel = ParallelState(pair, pair, one, one, one)
    return load_model(source, config, AttentionContext(TorchPagedAttentionBackend()), dtype,
                      torch.device("cpu"), quant_config=get_quant_config(None, config, "hf"),
                      parallel=parallel)


def _hf(folder: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def test_dequantize_matches_block_loop():
    """Shapes that are not multiples of the block (ceil, a short last block) and stacked
    experts ``[E, N, K]``, against the loop over blocks."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(3, 70, 50, generator=gen)
    parts = [quantize_blockwise(e, (16, 24)) for e in w]
    q, s = torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts])
    assert s.shape == (3, 5, 3)
    got = dequantize_block_fp8(q, s, (16, 24))
    for e in range(3):
        assert torch.equal(got[e], dequantize_blockwise(q[e], s[e], (16, 24)))
        assert torch.equal(dequantize_block_fp8(q[e], s[e], (16, 24)), got[e])
    # e4m3 keeps 3 mantissa bits: within 2^-4 of each value (relative to its block's scale)
    assert (got - w).abs().max() <= w.abs().max() / 16
    with pytest.raises(ValueError, match=r"'x.weight' \(70, 50\) with block \[16, 24\] needs a "
                       r"scale 'x.weight_scale_inv' of shape \(5, 3\), got \(5, 2\)"):
        dequantize_block_fp8(q[0], s[0, :, :2], (16, 24), "x.weight")
    with pytest.raises(ValueError, match="has dtype torch.float32, but"):
        dequantize_block_fp8(w[0], s[0], (16, 24))


@pytest.mark.parametrize("pattern,module,ignored", [
    ("lm_head", "lm_head", True),
    ("model.layers.1", "model.layers.1.mlp.down_proj", True),
    ("model.layers.1", "model.layers.11.mlp.down_proj", False),
    ("mlp.gate", "model.layers.3.mlp.gate", True),
    ("model.layers.3.mlp.gate", "model.layers.3.mlp.gate_proj", False),
    (r"model\.layers\.\d+\.self_attn", "model.layers.7.self_attn.o_proj", True),
    ("o_proj", "model.layers.7.self_attn.o_proj", True),
])
def test_ignored_module_names(pattern, module, ignored):
    """transformers' modules_to_not_convert rule: a name or regex from the start to a module
    boundary, or a suffix."""
    assert is_ignored(module, [pattern]) is ignored


@pytest.mark.parametrize("block", BLOCKS, ids=["128x128", "16x24"])
@pytest.mark.parametrize("arch,dtype", [("llama", torch.float32), ("llama", torch.bfloat16),
                                        ("qwen3_moe", torch.float32),
                                        ("deepseek_v3", torch.float32)])
def test_loaded_weights_equal_dequantized(tiny_model_factory, tmp_path, arch, dtype, block):
    """Every parameter (fused q/k/v and gate/up, stacked experts, MLA projections) equals the
    one loaded from the folder of dequantized weights, in the model dtype."""
    tiny = tiny_model_factory(arch)
    fp8, dequantized = build_fp8_checkpoint(tiny, tmp_path, block)
    got = dict(_load(fp8, dtype).named_parameters())
    want = dict(_load(dequantized, dtype).named_parameters())
    assert got.keys() == want.keys()
    for name, param in got.items():
        assert param.dtype == want[name].dtype and torch.equal(param, want[name]), name
    plain = dict(_load(tiny.path, dtype).named_parameters())  # the blocks really rounded
    for name in [n for n in got if n.endswith(("qkv_proj.weight", "w13_weight",
                                               "kv_b_proj.weight", "kv_a_proj_with_mqa.weight"))]:
        assert not torch.equal(got[name], plain[name]), name


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe", "deepseek_v3"])
def test_tensor_parallel_shards_equal_dequantized(tiny_model_factory, tmp_path, arch):
    """Each of 2 TP ranks holds the shard of the dequantized weights (blocks that straddle a
    shard boundary dequantize before the split: 16x24 blocks over 64 columns)."""
    tiny = tiny_model_factory(arch)
    fp8, dequantized = build_fp8_checkpoint(tiny, tmp_path, (16, 24))
    o_proj = "model.layers.0.self_attn.o_proj.weight"
    for rank in range(2):
        got = dict(_load(fp8, torch.float32, rank).named_parameters())
        want = dict(_load(dequantized, torch.float32, rank).named_parameters())
        assert got.keys() == want.keys()
        for name, param in got.items():
            assert torch.equal(param, want[name]), (rank, name)
        assert got[o_proj].shape[1] * 2 == tiny.hf_model.get_parameter(o_proj).shape[1]


@pytest.mark.parametrize("block", [(16, 24), (8, 8)], ids=["16x24", "8x8"])
@pytest.mark.parametrize("arch", ["llama", "qwen3_moe", "deepseek_v3"])
def test_engine_matches_transformers_on_dequantized_weights(tiny_model_factory, tmp_path, arch,
                                                            block):
    """Greedy tokens and their logprobs against transformers on the dequantized weights; with
    8x8 blocks (which divide every tiny shape) also against transformers reading the FP8
    folder itself. transformers' CPU dequantization takes the block size from the shapes
    (``rows // scale_rows``), so it refuses a weight whose rows or columns the block does not
    divide (16x24 here; DeepSeek-V3's 576-row kv_a_proj_with_mqa at 128x128)."""
    tiny = tiny_model_factory(arch)
    fp8, dequantized = build_fp8_checkpoint(tiny, tmp_path, block)
    reference = TinyModel(f"{arch}-fp8-{block[0]}x{block[1]}", fp8, _hf(dequantized),
                          tiny.vocab_size, tiny.eos_token_id)
    prompts = [torch.randint(2, tiny.vocab_size, (n,), generator=torch.Generator().manual_seed(n)
                             ).tolist() for n in (9, 14)]
    llm = LLM(model=fp8, dtype="float32", num_kv_blocks=64, block_size=4)
    outs = llm.generate(prompts, greedy(), use_tqdm=False)
    for out in outs:
        assert_matches_hf(reference, out)
    # transformers loading the FP8 folder itself (on CPU it dequantizes the blocks at load)
    fp8_hf = _hf(fp8) if block == (8, 8) else None
    with torch.no_grad():
        for out in outs if fp8_hf is not None else ():
            ids = torch.tensor([out.prompt_token_ids + out.outputs[0].token_ids])
            logprobs = torch.log_softmax(fp8_hf(ids).logits[0], dim=-1)
            n = len(out.prompt_token_ids)
            assert logprobs[n - 1:-1].argmax(-1).tolist() == out.outputs[0].token_ids
            want = [float(logprobs[n - 1 + i, t]) for i, t in enumerate(out.outputs[0].token_ids)]
            got = [out.outputs[0].logprobs[i][t].logprob
                   for i, t in enumerate(out.outputs[0].token_ids)]
            assert got == pytest.approx(want, abs=1e-4)
    # the quantization is real: the unquantized model's logprobs differ
    with torch.no_grad():
        ids = torch.tensor([outs[0].prompt_token_ids])
        plain = torch.log_softmax(tiny.hf_model(ids).logits[0, -1], dim=-1)
    first = outs[0].outputs[0].token_ids[0]
    assert abs(float(plain[first]) - outs[0].outputs[0].logprobs[0][first].logprob) > 1e-3


def test_modules_to_not_convert_load_as_stored(tiny_model_factory, tmp_path):
    """Layers the checkpoint leaves in float (named in modules_to_not_convert) load as they
    are, beside block-FP8 layers."""
    tiny = tiny_model_factory("llama")
    kept = ("model.layers.1.self_attn.o_proj", "model.layers.0.mlp.down_proj")
    fp8, dequantized = build_fp8_checkpoint(tiny, tmp_path, (16, 24), kept)
    got = dict(_load(fp8, torch.float32).named_parameters())
    want = dict(_load(dequantized, torch.float32).named_parameters())
    plain = dict(_load(tiny.path, torch.float32).named_parameters())
    for name, param in want.items():
        assert torch.equal(got[name], param), name
    assert torch.equal(got["model.layers.1.self_attn.o_proj.weight"],
                       plain["model.layers.1.self_attn.o_proj.weight"])
    assert not torch.equal(got["model.layers.0.self_attn.o_proj.weight"],
                           plain["model.layers.0.self_attn.o_proj.weight"])


def _edit(folder: str, config_edit=None, tensors_edit=None) -> str:
    if config_edit is not None:
        path = Path(folder) / "config.json"
        config = json.loads(path.read_text())
        config_edit(config["quantization_config"])
        path.write_text(json.dumps(config))
    if tensors_edit is not None:
        tensors = _read(f"{folder}/model.safetensors")
        tensors_edit(tensors)
        save_file(tensors, f"{folder}/model.safetensors", metadata={"format": "pt"})
    return folder


@pytest.mark.parametrize("edit,match", [
    (lambda c: c.update(activation_scheme="static"), "activation_scheme='static' is not"),
    (lambda c: c.update(fmt="e5m2"), "fmt='e5m2' is not supported"),
    (lambda c: c.pop("weight_block_size"), "weight_block_size=None is not supported"),
    (lambda c: c.update(weight_block_size=[128]), r"weight_block_size=\[128\] is not"),
    (lambda c: c.update(expert_dtype="fp4"), "expert_dtype='fp4' is not supported"),
    (lambda c: c.update(modules_to_convert=["model.embed_tokens"]), "modules_to_convert="),
    # a module the config says is unquantized, stored in FP8: cast, it would be garbage
    (lambda c: c.update(modules_to_not_convert=["model.layers.0.self_attn.q_proj"]),
     "'model.layers.0.self_attn.q_proj.weight' is float8, but"),
], ids=["static", "e5m2", "no_block", "bad_block", "fp4_experts", "modules_to_convert",
        "fp8_module_not_converted"])
def test_unreadable_configs_are_refused(tiny_model_factory, tmp_path, edit, match):
    fp8, _ = build_fp8_checkpoint(tiny_model_factory("llama"), tmp_path, (128, 128))
    _edit(fp8, edit)
    with pytest.raises(ValueError, match=match):
        LLM(model=fp8, dtype="float32", num_kv_blocks=16)


def test_unpaired_and_misshapen_tensors_are_refused(tiny_model_factory, tmp_path):
    tiny = tiny_model_factory("llama")
    fp8, _ = build_fp8_checkpoint(tiny, tmp_path, (16, 24))
    name = "model.layers.1.mlp.up_proj.weight"
    folder = _edit(fp8, tensors_edit=lambda t: t.pop(name + "_scale_inv"))
    with pytest.raises(ValueError, match=rf"without their pair .*\['{name}'\]"):
        _load(folder, torch.float32)
    folder = _edit(fp8, tensors_edit=lambda t: t.update({name + "_scale_inv": torch.ones(2, 2)}))
    with pytest.raises(ValueError, match=r"needs a scale '.*up_proj.weight_scale_inv' of "
                       r"shape \(8, 3\), got"):
        _load(folder, torch.float32)
    with pytest.raises(ValueError, match=r"already quantized \(fp8\); quantization='int8'"):
        LLM(model=fp8, dtype="float32", quantization="int8", num_kv_blocks=16)


def test_quantization_fp8_reads_the_checkpoint(tiny_model_factory, tmp_path):
    """``--quantization fp8`` on a block-FP8 checkpoint reads it (vLLM's flag does too): the
    same weights as without the flag, not re-quantized per tensor."""
    tiny = tiny_model_factory("llama")
    fp8, _ = build_fp8_checkpoint(tiny, tmp_path, (16, 24))
    config = load_hf_config(resolve_model(fp8))
    quant = get_quant_config("fp8", config, "hf")
    assert quant.block_fp8 and not quant.quantizes_layers
    prompt = torch.randint(2, tiny.vocab_size, (8,), generator=torch.Generator().manual_seed(1))
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=0)
    a, b = (LLM(model=fp8, dtype="float32", num_kv_blocks=32, block_size=4, quantization=q)
            .generate([prompt.tolist()], params, use_tqdm=False)[0].outputs[0]
            for q in (None, "fp8"))
    assert a.token_ids == b.token_ids
    assert [lp[t].logprob for lp, t in zip(a.logprobs, a.token_ids)] == \
        [lp[t].logprob for lp, t in zip(b.logprobs, b.token_ids)]


@needs_native
def test_deterministic_mode_runs_a_block_fp8_checkpoint(tiny_model_factory, tmp_path):
    """``--deterministic`` accepts a block-FP8 checkpoint (its layers run the unquantized,
    batch-invariant GEMMs: the weights are dequantized at load) and keeps its promise: the
    watched prompt's tokens and logprobs alone equal those inside a batch of 8."""
    fp8, _ = build_fp8_checkpoint(tiny_model_factory("llama"), tmp_path, (16, 24))
    alone, in_batch = _results(fp8, "float32", True, None, False, sizes=(8,))
    assert len(alone[0]) == MAX_TOKENS and in_batch == alone
