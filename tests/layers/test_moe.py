"""FusedMoE (routing, grouped experts, weighted combine, weight loading) vs a naive per-expert
loop that visits every (token, slot) through one-hot masks, as transformers does."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvflow.kernels.moe_ref import fused_experts_ref
from kvflow.layers.moe import FusedMoE, select_experts


def naive_moe(x, w1, w3, w2, router_logits, top_k, renormalize):
    """Per-expert loop over dense masks: every expert sees all tokens, masked by its routing
    weight (0 where the token did not pick it). w1/w3: [E, I, H], w2: [E, H, I]."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    top_vals, top_ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        top_vals = top_vals / top_vals.sum(-1, keepdim=True)
    out = torch.zeros(x.shape, dtype=torch.float64)
    for e in range(w1.shape[0]):
        weight = (top_vals * (top_ids == e)).sum(-1, dtype=torch.float64)  # [T], 0 if unpicked
        y = F.linear(F.silu(F.linear(x.double(), w1[e].double())) *
                     F.linear(x.double(), w3[e].double()), w2[e].double())
        out += weight[:, None] * y
    return out.to(x.dtype)


def _weights(num_experts, hidden, inter, seed):
    gen = torch.Generator().manual_seed(seed)
    w1 = torch.randn(num_experts, inter, hidden, generator=gen) / hidden ** 0.5
    w3 = torch.randn(num_experts, inter, hidden, generator=gen) / hidden ** 0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=gen) / inter ** 0.5
    return w1, w3, w2


def _load_per_expert(layer: FusedMoE, w1, w3, w2) -> None:
    for e in range(w1.shape[0]):
        layer.w13_weight.weight_loader(layer.w13_weight, w1[e], "w1", e)
        layer.w13_weight.weight_loader(layer.w13_weight, w3[e], "w3", e)
        layer.w2_weight.weight_loader(layer.w2_weight, w2[e], "w2", e)


@pytest.mark.parametrize("num_tokens,num_experts,top_k,renormalize,unused", [
    (1, 4, 2, True, ()),
    (9, 8, 2, True, (0, 3, 7)),      # Mixtral-style; three experts get no token
    (33, 6, 3, False, (2,)),         # Qwen-style (norm_topk_prob false)
    (16, 4, 1, False, (1, 2, 3)),    # every token on one expert
    (0, 4, 2, True, ()),             # empty batch
])
def test_fused_moe_matches_naive_loop(num_tokens, num_experts, top_k, renormalize, unused):
    hidden, inter = 32, 24
    w1, w3, w2 = _weights(num_experts, hidden, inter, seed=num_tokens)
    layer = FusedMoE(num_experts, top_k, hidden, inter, renormalize)
    _load_per_expert(layer, w1, w3, w2)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(num_tokens, hidden, generator=gen)
    logits = torch.randn(num_tokens, num_experts, generator=gen) * 2
    logits[:, list(unused)] = -1e4
    picked = set(select_experts(logits, top_k, renormalize)[1].reshape(-1).tolist())
    assert not picked & set(unused)
    out = layer(x, logits)
    assert out.shape == (num_tokens, hidden) and out.dtype == torch.float32
    expected = naive_moe(x, w1, w3, w2, logits, top_k, renormalize)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_routing_rules():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0], [0.0, 3.0, 3.5, 1.0]])
    weights, ids = select_experts(logits, 2, renormalize=True)
    assert ids.tolist() == [[0, 1], [2, 1]]
    # Mixtral: softmax over the top-k logits
    torch.testing.assert_close(weights, torch.softmax(logits.gather(1, ids), dim=-1))
    raw, _ = select_experts(logits, 2, renormalize=False)
    # Qwen with norm_topk_prob false: the full softmax's top-k probabilities, not summing to 1
    torch.testing.assert_close(raw, torch.softmax(logits, -1).gather(1, ids))
    assert bool((raw.sum(-1) < 1).all())


def test_stacked_and_tensor_parallel_loading():
    """transformers-5 stacked tensors load like per-expert ones; TP ranks hold disjoint
    slices of the intermediate dim whose partial outputs sum to the full layer's output."""
    num_experts, hidden, inter = 4, 16, 8
    w1, w3, w2 = _weights(num_experts, hidden, inter, seed=5)
    full = FusedMoE(num_experts, 2, hidden, inter, True)
    _load_per_expert(full, w1, w3, w2)
    stacked = FusedMoE(num_experts, 2, hidden, inter, True)
    stacked.w13_weight.weight_loader(stacked.w13_weight, torch.cat([w1, w3], 1), "w13")
    stacked.w2_weight.weight_loader(stacked.w2_weight, w2, "w2")
    assert torch.equal(stacked.w13_weight, full.w13_weight)
    assert torch.equal(stacked.w2_weight, full.w2_weight)
    x, logits = torch.randn(5, hidden), torch.randn(5, num_experts)
    partial = torch.zeros(5, hidden)
    for rank in range(2):
        shard = FusedMoE(num_experts, 2, hidden, inter, True, tp_rank=rank, tp_size=2)
        _load_per_expert(shard, w1, w3, w2)
        assert shard.w13_weight.shape == (num_experts, inter, hidden)
        assert torch.equal(shard.w2_weight, w2[..., rank * 4:(rank + 1) * 4])
        # forward() all-reduces when tp_size > 1; sum the ranks' partial outputs by hand
        weights, ids = select_experts(logits, 2, True)
        partial += fused_experts_ref(x, shard.w13_weight, shard.w2_weight, weights, ids)
    torch.testing.assert_close(partial, full(x, logits), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError):
        full.w2_weight.weight_loader(full.w2_weight, torch.zeros(3, 3), "w2", 0)
    with pytest.raises(ValueError):
        full.w13_weight.weight_loader(full.w13_weight, w1[0], "w9", 0)


def test_fused_experts_ref_bf16_close_to_fp32():
    num_experts, hidden, inter = 4, 64, 32
    w1, w3, w2 = _weights(num_experts, hidden, inter, seed=7)
    w13 = torch.cat([w1, w3], 1)
    x, logits = torch.randn(12, hidden), torch.randn(12, num_experts)
    weights, ids = select_experts(logits, 2, True)
    ref = fused_experts_ref(x, w13, w2, weights, ids)
    out = fused_experts_ref(x.bfloat16(), w13.bfloat16(), w2.bfloat16(), weights, ids)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=3e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_fused_moe_bf16_matches_naive_loop():
    num_experts, hidden, inter = 8, 256, 128
    w1, w3, w2 = _weights(num_experts, hidden, inter, seed=11)
    layer = FusedMoE(num_experts, 2, hidden, inter, True)
    _load_per_expert(layer, w1, w3, w2)
    layer = layer.to("cuda", torch.bfloat16)
    x, logits = torch.randn(300, hidden), torch.randn(300, num_experts)
    logits[:, 5] = -1e4
    out = layer(x.cuda().bfloat16(), logits.cuda())
    expected = naive_moe(x, w1, w3, w2, logits, 2, True)
    torch.testing.assert_close(out.float().cpu(), expected, atol=3e-2, rtol=3e-2)


class _RecordingGroup:
    """Stands in for one rank's EP process group: ``all_reduce`` keeps the rank's partial
    output (the test sums the ranks' parts by hand, as the real all-reduce would)."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size, self.partial = rank, world_size, None

    def all_reduce(self, x):
        self.partial = x.clone()
        return x


@pytest.mark.parametrize("stacked", [False, True])
def test_expert_parallel_ranks_hold_their_experts_and_sum_to_the_layer(stacked):
    """EP over 2 ranks: rank r loads only experts [2r, 2r + 2) (per-expert or stacked
    checkpoints), runs only the pairs routed to them, and the two partial outputs sum to the
    naive loop over all 4 experts."""
    num_experts, hidden, inter, top_k = 4, 16, 8, 2
    w1, w3, w2 = _weights(num_experts, hidden, inter, seed=13)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(11, hidden, generator=gen)
    logits = torch.randn(11, num_experts, generator=gen) * 2
    total = torch.zeros(11, hidden)
    for rank in range(2):
        group = _RecordingGroup(rank, 2)
        layer = FusedMoE(num_experts, top_k, hidden, inter, True, ep_group=group)
        if stacked:
            layer.w13_weight.weight_loader(layer.w13_weight, torch.cat([w1, w3], 1), "w13")
            layer.w2_weight.weight_loader(layer.w2_weight, w2, "w2")
        else:
            _load_per_expert(layer, w1, w3, w2)  # other ranks' experts are skipped
        assert layer.num_local_experts == 2 and layer.w2_weight.shape[0] == 2
        assert torch.equal(layer.w2_weight, w2[2 * rank:2 * rank + 2])
        layer(x, logits)
        total += group.partial
    torch.testing.assert_close(total, naive_moe(x, w1, w3, w2, logits, top_k, True),
                               atol=1e-5, rtol=1e-5)


def test_expert_parallel_and_tensor_parallel_exclude_each_other():
    with pytest.raises(ValueError, match="not both"):
        FusedMoE(4, 2, 16, 8, True, tp_rank=0, tp_size=2, ep_group=_RecordingGroup(0, 2))
    layer = FusedMoE(4, 2, 16, 8, True)
    with pytest.raises(ValueError, match="expert_id 4"):
        layer.w2_weight.weight_loader(layer.w2_weight, torch.zeros(16, 8), "w2", 4)


def test_float_stacks_are_allocated_on_first_load_not_at_build():
    """The float stacks are shapes only (meta) after construction; forward before any load
    is refused; the first float load allocates both in the build-time default dtype."""
    layer = FusedMoE(4, 2, 16, 8, True)
    assert layer.w13_weight.is_meta and layer.w2_weight.shape == (4, 16, 8)
    with pytest.raises(RuntimeError, match="never loaded"):
        layer(torch.randn(3, 16), torch.randn(3, 4))
    w2 = _weights(4, 16, 8, seed=3)[2]
    layer.weight_loader(layer.w2_weight, w2[1], "w2", 1)
    assert (layer.w13_weight.device.type, layer.w13_weight.dtype) == ("cpu", torch.float32)
    assert torch.equal(layer.w2_weight[1], w2[1])
