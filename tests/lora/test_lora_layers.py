"""The grouped LoRA matmul and the LoRA wrapper against plain per-token torch."""

from __future__ import annotations

import numpy as np
import torch

from kvflow.layers.linear import QKVParallelLinear
from kvflow.lora.layers import LoRAContext, LoRALinear, grouped_lora, make_mapping


def test_grouped_lora_matches_a_per_token_loop():
    gen = torch.Generator().manual_seed(0)
    slots = np.array([1, -1, 0, 1, 2, -1, 0, 0, 2, 1])  # 3 adapters and base, interleaved
    x = torch.randn(len(slots), 24, generator=gen)
    a = torch.randn(3, 8, 24, generator=gen)
    b = torch.randn(3, 40, 8, generator=gen)
    y = torch.randn(len(slots), 40, generator=gen)
    expected = y.clone()
    for t, s in enumerate(slots):
        if s >= 0:
            expected[t] += b[s] @ (a[s] @ x[t])
    mapping = make_mapping(slots, torch.device("cpu"))
    assert [seg[0] for seg in mapping.segments] == [0, 1, 2]
    torch.testing.assert_close(grouped_lora(y.clone(), x, a, b, mapping), expected)
    assert make_mapping(np.full(4, -1), torch.device("cpu")) is None


def test_bf16_layer_on_cpu_runs_fp32_slots_and_a_whole_batch_unscattered():
    """On CPU the slots are fp32 (a rank-r bf16 matmul costs ~20 us of set-up there) and a
    step whose every token runs one slot (``whole``) adds its delta without gather/scatter:
    both paths match the float64 per-token sum, the delta rounded once to bf16."""
    gen = torch.Generator().manual_seed(4)
    torch.set_default_dtype(torch.bfloat16)
    try:
        base = QKVParallelLinear(16, head_dim=4, num_heads=4, num_kv_heads=2)
    finally:
        torch.set_default_dtype(torch.float32)
    base.weight.data.copy_(torch.randn(base.weight.shape, generator=gen))
    ctx = LoRAContext()
    layer = LoRALinear(base, max_loras=2, max_rank=4, ctx=ctx)
    assert layer.lora_a.dtype == layer.lora_b.dtype == torch.float32
    pairs = [(torch.randn(4, 16, generator=gen), torch.randn(32, 4, generator=gen))
             for _ in range(2)]
    for slot, (a, b) in enumerate(pairs):
        layer.set_slot(slot, {None: (a.bfloat16(), b.bfloat16())})
    x = torch.randn(5, 16, generator=gen).bfloat16()
    plain = base(x)
    for slots, whole in (([1] * 5, True), ([1, 0, -1, 1, 0], False), ([-1, 1, 1, 1, 1], False)):
        mapping = make_mapping(np.array(slots), torch.device("cpu"))
        assert mapping.whole is whole
        with ctx.bind(mapping):
            y = layer(x)
        expected = plain.clone()
        for t, s in enumerate(slots):
            if s >= 0:
                a, b = (w.bfloat16().double() for w in pairs[s])
                expected[t] += (b @ (a @ x[t].double())).bfloat16()
        assert y.dtype == torch.bfloat16
        torch.testing.assert_close(y, expected)  # bf16: within one rounding


def test_mapping_of_a_token_subset_renumbers_its_tokens():
    """A context-parallel rank runs only some of the step's tokens (``LoRAContext.select``):
    the grouped matmul over that subset adds each kept token's own adapter, as the per-token
    loop over the kept tokens does."""
    gen = torch.Generator().manual_seed(3)
    slots = np.array([1, -1, 0, 1, 0, -1])
    keep = torch.tensor([0, 2, 3, 5])  # slots 1, 0, 1, -1
    x = torch.randn(len(keep), 6, generator=gen)
    a, b = torch.randn(2, 4, 6, generator=gen), torch.randn(2, 5, 4, generator=gen)
    y = torch.randn(len(keep), 5, generator=gen)
    expected = y.clone()
    for t, s in enumerate(slots[keep.numpy()]):
        if s >= 0:
            expected[t] += b[s] @ (a[s] @ x[t])
    ctx = LoRAContext()
    with ctx.bind(make_mapping(slots, torch.device("cpu"))):
        ctx.select(keep)
        # by hand: slot 0 holds local token 1, slot 1 local tokens 0 and 2
        assert ctx.mapping.token_index.tolist() == [1, 0, 2]
        assert ctx.mapping.segments == [(0, 0, 1), (1, 1, 3)]
        torch.testing.assert_close(grouped_lora(y.clone(), x, a, b, ctx.mapping), expected)
    with ctx.bind(make_mapping(slots, torch.device("cpu"))):
        ctx.select(torch.tensor([1, 5]))  # base-model tokens only
        assert ctx.mapping is None


def test_token_subset_runs_the_native_kernel_as_its_row_count_picks():
    """A context-parallel rank's share (``LoRAContext.select``) carries its own tokens' slots
    as ``row_slots`` (the native CPU kernel's) where the context's eager choice gives its row
    count ``native``, and none where it gives ``torch``; without a choice (CUDA) it keeps the
    bound mapping's path. The native kernel over the share adds each kept token's own adapter
    (the per-token loop)."""
    from kvflow.kernels.cpu_native import native_cpu_kernels
    from kvflow.lora.layers import GroupedLoRA, with_row_slots

    gen = torch.Generator().manual_seed(6)
    slots = np.array([1, -1, 0, 1, 0, -1, 1])
    keep = torch.tensor([0, 1, 3, 4, 6])  # slots 1, -1, 1, 0, 1
    picked = []
    ctx = LoRAContext(lambda rows: picked.append(rows) or ("native" if rows < 6 else "torch"))
    with ctx.bind(make_mapping(slots, torch.device("cpu"))):
        ctx.select(keep)
        assert picked == [5]
        assert ctx.mapping.row_slots.dtype == torch.int32
        assert ctx.mapping.row_slots.tolist() == [1, -1, 1, 0, 1]
        mapping = ctx.mapping
    with ctx.bind(make_mapping(slots, torch.device("cpu"))):
        ctx.select(torch.arange(7))  # 7 rows: torch
        assert ctx.mapping.row_slots is None
    plain = LoRAContext()
    for bound in (make_mapping(slots, torch.device("cpu")),
                  with_row_slots(make_mapping(slots, torch.device("cpu")))):
        with plain.bind(bound):
            plain.select(keep)
            assert (plain.mapping.row_slots is None) == (bound.row_slots is None)
    if native_cpu_kernels() is None:
        return
    x = torch.randn(len(keep), 24, generator=gen)
    a = torch.randn(2, 8, 24, generator=gen)
    b = torch.randn(2, 8, 40, generator=gen).transpose(1, 2)
    y = torch.randn(len(keep), 40, generator=gen)
    expected = y.double().clone()
    for t, s in enumerate(slots[keep.numpy()]):
        if s >= 0:
            expected[t] += b[s].double() @ (a[s].double() @ x[t].double())
    got = GroupedLoRA()(y.clone(), x, a, b, mapping)
    torch.testing.assert_close(got.double(), expected, rtol=0, atol=1e-4)


def test_fused_qkv_slot_is_block_diagonal():
    """An adapter on q and v only (ranks 2 and 3 in slots of rank 4) adds exactly
    ``B_q A_q x`` to the q rows and ``B_v A_v x`` to the v rows; k rows are untouched."""
    gen = torch.Generator().manual_seed(1)
    torch.manual_seed(0)
    base = QKVParallelLinear(16, head_dim=4, num_heads=4, num_kv_heads=2)
    base.weight.data.copy_(torch.randn(base.weight.shape, generator=gen))
    ctx = LoRAContext()
    layer = LoRALinear(base, max_loras=2, max_rank=4, ctx=ctx)
    a_q, b_q = torch.randn(2, 16, generator=gen), torch.randn(16, 2, generator=gen)
    a_v, b_v = torch.randn(3, 16, generator=gen), torch.randn(8, 3, generator=gen)
    layer.set_slot(1, {"q": (a_q, b_q), "v": (a_v, b_v)})
    x = torch.randn(3, 16, generator=gen)
    with ctx.bind(make_mapping(np.array([1, -1, 1]), torch.device("cpu"))):
        y = layer(x)
    plain = x @ base.weight.T
    expected = plain.clone()
    for t in (0, 2):
        expected[t, :16] += b_q @ (a_q @ x[t])
        expected[t, 24:] += b_v @ (a_v @ x[t])
    torch.testing.assert_close(y, expected)
    with ctx.bind(None):
        torch.testing.assert_close(layer(x), plain)


def test_lora_on_a_quantized_base_layer():
    """LoRA adds its delta to whatever the base layer's quantization method computes (int8
    here: the layer's own int8 output, plus the plain-torch LoRA product)."""
    from kvflow.layers.linear import RowParallelLinear
    from kvflow.quant.int8 import Int8WeightOnlyMethod

    gen = torch.Generator().manual_seed(2)
    base = RowParallelLinear(32, 16)
    base.set_quant_method(Int8WeightOnlyMethod())
    base.weight_loader(base.weight, torch.randn(16, 32, generator=gen))
    base.quant_method.process_weights_after_loading(base)
    x = torch.randn(5, 32, generator=gen)
    quantized = base(x)
    ctx = LoRAContext()
    layer = LoRALinear(base, max_loras=1, max_rank=4, ctx=ctx)
    a, b = torch.randn(4, 32, generator=gen), torch.randn(16, 4, generator=gen)
    layer.set_slot(0, {None: (a, b)})
    with ctx.bind(make_mapping(np.zeros(5, np.int64), torch.device("cpu"))):
        torch.testing.assert_close(layer(x), quantized + x @ a.T @ b.T)
