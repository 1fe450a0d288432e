"""MoE GGUF experts kept quantized (``--quantization gguf``): the float expert stacks are never
allocated, and tensor parallelism splits the experts' blocks (gate/up rows, down columns in
whole blocks) so that the ranks' partial outputs sum to the one-rank layer and to a plain-torch
loop over gguf-py's dequantized weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kvflow.layers.moe import FusedMoE
from kvflow.quant.gguf_moe import GGUFFusedMoEMethod
from tests.layers.test_moe import naive_moe
from tests.models.test_moe_gguf import Q, _blocks, _expert_layer, _llm, _write

gguf = pytest.importorskip("gguf")


class _FloatShapes(TorchDispatchMode):
    """Records the shape of every floating-point tensor an op returns off the meta device."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: set[tuple[int, ...]] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.is_floating_point() and not t.is_meta:
                self.shapes.add(tuple(t.shape))
        return out


@pytest.mark.parametrize("choice", ["quantized", "dequantized"])
def test_kept_experts_never_allocate_float_stacks(tiny_model_factory, tmp_path, monkeypatch,
                                                  choice):
    """Building a Q8_0 Qwen3-MoE under --quantization gguf creates no float tensor of an
    expert stack's shape ([E, 2I, H] or [E, H, I]) anywhere; with KVFLOW_GGUF_MOE=dequantized
    the float stacks are allocated (and hold the experts)."""
    tiny = tiny_model_factory("qwen3_moe")
    cfg = tiny.hf_model.config
    path = _write(tiny, tmp_path / "q8.gguf", quantize=Q.Q8_0)
    monkeypatch.setenv("KVFLOW_GGUF_MOE", choice)
    e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    stacks = {(e, 2 * i, h), (e, h, i)}
    with _FloatShapes() as seen:
        llm = _llm(tiny, path, quantization="gguf")
    layer = _expert_layer(llm)
    if choice == "quantized":
        assert layer.w13_weight.dtype == torch.uint8
        assert not stacks & seen.shapes
    else:
        assert layer.w13_weight.dtype == torch.float32
        assert stacks <= seen.shapes
    llm.shutdown()


class _PartialGroup:
    """One TP rank's group: ``all_reduce`` keeps the rank's partial output (the test sums the
    ranks' parts, as the real all-reduce does)."""

    world_size = 2

    def __init__(self) -> None:
        self.partial = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self.partial = x.clone()
        return x


def _expert_blocks(types: dict, e: int, h: int, i: int) -> dict:
    """shard -> per-expert uint8 blocks (tagged ``ggml_type``) and their float32 values."""
    rng = np.random.default_rng(5)
    out = {}
    for n, (shard, shape) in enumerate((("w1", (i, h)), ("w3", (i, h)), ("w2", (h, i)))):
        array = rng.normal(0, 0.3, (e, *shape)).astype(np.float32)
        raw = _blocks(array, types[shard], seed=n)
        values = gguf.quants.dequantize(raw, types[shard]).reshape(array.shape)
        out[shard] = [torch.from_numpy(raw[x].copy()) for x in range(e)], torch.from_numpy(values)
        for blocks in out[shard][0]:
            blocks.ggml_type = int(types[shard])
    return out


def _gguf_layer(e: int, h: int, i: int, experts: dict, tp_rank: int = 0, tp_size: int = 1,
                tp_group=None) -> FusedMoE:
    layer = FusedMoE(e, 2, h, i, True, tp_rank=tp_rank, tp_size=tp_size, tp_group=tp_group)
    layer.set_quant_method(GGUFFusedMoEMethod())
    for shard, (blocks, _) in experts.items():
        for x, raw in enumerate(blocks):
            layer.weight_loader(layer.w2_weight if shard == "w2" else layer.w13_weight, raw,
                                shard, x)
    layer.quant_method.process_weights_after_loading(layer)
    return layer


Q8 = {"w1": Q.Q8_0, "w3": Q.Q8_0, "w2": Q.Q8_0}
K_QUANTS = {"w1": Q.Q4_K, "w3": Q.Q5_K, "w2": Q.Q6_K}


@pytest.mark.parametrize("types,e,h,i", [(Q8, 4, 64, 64), (K_QUANTS, 2, 256, 512)])
def test_tp2_expert_shards_sum_to_one_rank_and_reference(types, e, h, i):
    """TP=2: rank r keeps gate/up rows [r*I/2, (r+1)*I/2) and the down blocks of those
    columns (a quarter of the bytes each shard); the ranks' partial outputs sum to the
    one-rank layer and to a float64 loop over the dequantized experts."""
    experts = _expert_blocks(types, e, h, i)
    gen = torch.Generator().manual_seed(3)
    x, logits = torch.randn(7, h, generator=gen), torch.randn(7, e, generator=gen) * 2
    one = _gguf_layer(e, h, i, experts)(x, logits)
    total = torch.zeros(7, h)
    for rank in range(2):
        group = _PartialGroup()
        layer = _gguf_layer(e, h, i, experts, rank, 2, group)
        _, block_bytes = gguf.GGML_QUANT_SIZES[types["w2"]]
        block = gguf.GGML_QUANT_SIZES[types["w2"]][0]
        assert layer.w2_weight.shape == (e, h, i // 2 // block * block_bytes)
        layer(x, logits)
        total += group.partial
    w1, w3, w2 = (experts[s][1] for s in ("w1", "w3", "w2"))
    # float32 sums of I products, in another order: a few ulps of the output's scale
    atol = 1e-6 * one.abs().max().item()
    torch.testing.assert_close(total, one, atol=atol, rtol=1e-5)
    reference = naive_moe(x.double(), w1, w3, w2, logits, 2, True)
    torch.testing.assert_close(total.double(), reference, atol=atol, rtol=1e-5)


def test_tp_split_cutting_blocks_is_refused():
    """I / tp_size not a multiple of the down type's block: a ValueError names the type,
    the block size and the split."""
    experts = _expert_blocks(Q8, 2, 64, 32)
    with pytest.raises(ValueError, match=r"Q8_0, blocks of 32 elements\) cannot be split by "
                                         r"columns over tensor_parallel_size 2: "
                                         r"intermediate_size 32 / 2 = 16 is not a multiple"):
        _gguf_layer(2, 64, 32, experts, 0, 2, _PartialGroup())


def test_block_cutting_split_is_refused_before_any_worker(tiny_model_factory, tmp_path,
                                                         monkeypatch):
    """Qwen3-MoE with Q8_0 experts of width 32 at TP=2 (16 per rank, half a block): the
    engine refuses at start-up, from the file's header, naming the tensor, type and split,
    before any worker starts; experts dequantized at load or placed whole by expert
    parallelism split fine."""
    from kvflow import LLM
    from kvflow.models.gguf_tp_checks import check_tp_block_splits

    tiny = tiny_model_factory("qwen3_moe")
    path = _write(tiny, tmp_path / "q8.gguf", quantize=Q.Q8_0)

    def no_workers(*args, **kwargs):
        raise AssertionError("workers were started")

    monkeypatch.setattr("kvflow.core.engine_startup.make_executor", no_workers)
    with pytest.raises(ValueError, match=r"blk\.0\.ffn_down_exps\.weight \(Q8_0, blocks of 32 "
                                         r"elements\) cannot be split by columns over "
                                         r"tensor_parallel_size 2: 32 / 2 = 16 is not"):
        LLM(model=path, tokenizer=tiny.path, quantization="gguf", tensor_parallel_size=2)
    check_tp_block_splits(path, 1)
    check_tp_block_splits(path, 2, expert_parallel=True)  # attn_output: 128 / 2, whole blocks
    with pytest.raises(ValueError, match=r"attn_output\.weight \(Q8_0.* 128 / 8 = 16"):
        check_tp_block_splits(path, 8, expert_parallel=True)
    monkeypatch.setenv("KVFLOW_GGUF_MOE", "dequantized")
    check_tp_block_splits(path, 2)
