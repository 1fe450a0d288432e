"""DeepSeek's MoE routing (GroupedTopKRouting) against transformers' DeepSeek-V2/V3 routers on
random router weights and inputs, plus hand-computed cases where the group limit changes the
choice, and the routed FusedMoE layer against a per-expert loop."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvflow.layers.moe import FusedMoE, GroupedTopKRouting

E, HIDDEN = 16, 32


def _hf_router(version: str, **overrides):
    """transformers' DeepseekV{2,3}TopkRouter with a random fp32 weight (and V3's correction
    bias), from a config with E experts."""
    import transformers
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    fields = {"hidden_size": HIDDEN, "n_routed_experts": E, "num_experts_per_tok": 4,
              "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5, **overrides}
    gen = torch.Generator().manual_seed(hash(tuple(sorted(fields.items()))) % 2**31)
    if version == "v2":
        router = DeepseekV2TopkRouter(transformers.DeepseekV2Config(**fields))
    else:
        router = DeepseekV3TopkRouter(transformers.DeepseekV3Config(**fields))
        router.e_score_correction_bias.copy_(0.3 * torch.randn(E, generator=gen))
    with torch.no_grad():
        router.weight.copy_(0.5 * torch.randn(E, HIDDEN, generator=gen))
    return router


def _by_expert(weights: torch.Tensor, ids: torch.Tensor, num_experts: int = E) -> torch.Tensor:
    """[T, k] routes -> dense [T, E] weights (0 for experts not picked): order-free."""
    return torch.zeros(ids.shape[0], num_experts).scatter_(1, ids, weights)


@pytest.mark.parametrize("version,overrides,routing", [
    ("v2", {"topk_method": "greedy"}, GroupedTopKRouting(4, "softmax", "greedy",
                                                          routed_scaling_factor=2.5)),
    ("v2", {"topk_method": "group_limited_greedy"},
     GroupedTopKRouting(4, "softmax", "group_limited_greedy", 4, 2,
                        routed_scaling_factor=2.5)),
    ("v3", {"norm_topk_prob": True}, GroupedTopKRouting(4, "sigmoid", "noaux_tc", 4, 2, True,
                                                        2.5)),
    ("v3", {"norm_topk_prob": False, "n_group": 2, "topk_group": 1},
     GroupedTopKRouting(4, "sigmoid", "noaux_tc", 2, 1, False, 2.5)),
], ids=["v2_greedy", "v2_group_limited", "v3_noaux_tc_norm", "v3_noaux_tc_2groups"])
def test_matches_transformers_router(version, overrides, routing):
    router = _hf_router(version, **overrides)
    hidden = torch.randn(64, HIDDEN, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits, hf_weights, hf_ids = router(hidden)
    bias = getattr(router, "e_score_correction_bias", None)
    weights, ids = routing.select(logits, bias)
    assert weights.dtype == torch.float32 and ids.shape == (64, 4)
    assert torch.equal(ids.sort(-1).values, hf_ids.sort(-1).values)
    torch.testing.assert_close(_by_expert(weights, ids), _by_expert(hf_weights, hf_ids))


def test_v2_single_expert_is_scaled_not_renormalized():
    """DeepSeek's V2 gate renormalizes only for top-k above 1, else scales by
    routed_scaling_factor; transformers' V2 router always scales: with one expert per token
    and norm_topk_prob set, both give probability x 2.5 (kvflow gave weight 1.0)."""
    import transformers

    from kvflow.models.deepseek import DeepseekV2ForCausalLM

    fields = {"num_experts_per_tok": 1, "norm_topk_prob": True, "topk_method": "greedy"}
    router = _hf_router("v2", **fields)
    routing = DeepseekV2ForCausalLM.routing_for(transformers.DeepseekV2Config(
        hidden_size=HIDDEN, n_routed_experts=E, routed_scaling_factor=2.5, **fields))
    hidden = torch.randn(16, HIDDEN, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        logits, hf_weights, hf_ids = router(hidden)
    weights, ids = routing.select(logits)
    assert torch.equal(ids, hf_ids)
    torch.testing.assert_close(weights, hf_weights)
    torch.testing.assert_close(weights, 2.5 * logits.softmax(-1).max(-1, keepdim=True).values)


def test_group_limit_and_correction_bias_by_hand():
    """4 experts in 2 groups, 1 group kept, top-2. V2 (group = best expert): expert 3 scores
    best overall but group 0 {0, 1} wins on its best score, so 3 is out. V3: the bias moves the
    choice (to group {2, 3} by its top-2 sum) while weights stay the unbiased sigmoid scores."""
    logits = torch.tensor([[3.0, 2.9, 0.0, 2.95]])
    v2 = GroupedTopKRouting(2, "softmax", "group_limited_greedy", 2, 1, routed_scaling_factor=3)
    weights, ids = v2.select(logits)
    probs = logits.softmax(-1)[0]
    assert sorted(ids[0].tolist()) == [0, 1]
    torch.testing.assert_close(_by_expert(weights, ids, 4)[0, :2], 3 * probs[:2])
    v3 = GroupedTopKRouting(2, "sigmoid", "noaux_tc", 2, 1, renormalize=True,
                            routed_scaling_factor=2.0)
    bias = torch.tensor([0.0, 0.0, 0.5, 0.0])  # group 1's biased sum now beats group 0's
    weights, ids = v3.select(logits, bias)
    assert sorted(ids[0].tolist()) == [2, 3]
    scores = logits.sigmoid()[0, [2, 3]]
    torch.testing.assert_close(_by_expert(weights, ids, 4)[0, 2:],
                               2.0 * scores / scores.sum())


def test_bad_rules_raise():
    with pytest.raises(ValueError, match="scoring_func"):
        GroupedTopKRouting(2, scoring_func="tanh")
    with pytest.raises(ValueError, match="topk_method"):
        GroupedTopKRouting(2, topk_method="random")
    with pytest.raises(ValueError, match="routing groups"):
        FusedMoE(6, 2, 8, 4, False, routing=GroupedTopKRouting(2, num_expert_group=4))
    for topk_group in (0, 5):  # torch.topk's "selected index k out of range" at the first step
        with pytest.raises(ValueError, match=f"topk_group={topk_group} must be between 1 and "
                                             "n_group=4"):
            GroupedTopKRouting(2, "sigmoid", "noaux_tc", 4, topk_group)
    GroupedTopKRouting(2, "softmax", "greedy", 1, 3)  # greedy ignores the groups
    with pytest.raises(ValueError, match="n_group=4 leaves 1 of the 4 experts per group"):
        FusedMoE(4, 2, 8, 4, False, routing=GroupedTopKRouting(2, "sigmoid", "noaux_tc", 4, 2))
    with pytest.raises(ValueError, match="num_experts_per_tok=5 must be between 1 and the "
                                         "layer's 4 experts"):
        FusedMoE(4, 5, 8, 4, False)


def test_fused_moe_with_grouped_routing_matches_expert_loop():
    """FusedMoE with noaux_tc routing: the layer holds the correction bias as a parameter and
    its output equals a per-expert loop weighted by the routing's weights."""
    gen = torch.Generator().manual_seed(3)
    routing = GroupedTopKRouting(3, "sigmoid", "noaux_tc", 4, 2, True, 1.7)
    layer = FusedMoE(E, 3, HIDDEN, 8, True, routing=routing)
    assert layer.e_score_correction_bias.shape == (E,)
    w13, w2 = torch.randn(E, 16, HIDDEN, generator=gen), torch.randn(E, HIDDEN, 8, generator=gen)
    layer.weight_loader(layer.w13_weight, w13, "w13")
    layer.weight_loader(layer.w2_weight, w2, "w2")
    layer.e_score_correction_bias.data.copy_(torch.randn(E, generator=gen))
    x, logits = torch.randn(10, HIDDEN, generator=gen), torch.randn(10, E, generator=gen)
    weights = _by_expert(*routing.select(logits, layer.e_score_correction_bias))
    expected = torch.zeros(10, HIDDEN)
    for e in range(E):
        gate, up = F.linear(x, w13[e]).chunk(2, dim=-1)
        expected += weights[:, e:e + 1] * F.linear(F.silu(gate) * up, w2[e])
    torch.testing.assert_close(layer(x, logits), expected, atol=1e-4, rtol=1e-4)
