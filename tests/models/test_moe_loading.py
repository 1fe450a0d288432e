"""MoE weight loading: transformers 5's in-memory layout (stacked ``experts.gate_up_proj`` /
``experts.down_proj``, Mixtral's block named ``mlp``) loads into exactly the same parameters
as the per-expert checkpoint on disk (``experts.{e}.w1`` / ``gate_proj`` ..., Mixtral's
``block_sparse_moe``). Generation parity for these models is in test_parity.py."""

from __future__ import annotations

import pytest
import torch

from kvflow.attention.layer import AttentionContext
from kvflow.attention.torch_paged import TorchPagedAttentionBackend
from kvflow.models.loader import load_model
from kvflow.models.model_resolver import resolve_model


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_stacked_expert_names_load_like_checkpoint(name, tiny_model_factory):
    tiny = tiny_model_factory(name)
    # the bare model as loaded from disk (an engine would also pack its weights for oneDNN)
    model = load_model(resolve_model(tiny.path), tiny.hf_model.config,
                       AttentionContext(TorchPagedAttentionBackend()), torch.float32,
                       torch.device("cpu"))
    from_disk = {n: p.detach().clone() for n, p in model.named_parameters()}
    hf_names = list(tiny.hf_model.state_dict())
    assert any(n.endswith(".experts.gate_up_proj") for n in hf_names)
    for p in model.parameters():
        p.data.zero_()
    loaded = model.load_weights(tiny.hf_model.state_dict().items())
    assert loaded == set(from_disk)
    for n, p in model.named_parameters():
        assert torch.equal(p, from_disk[n]), n
    with pytest.raises(ValueError, match="matches no parameter"):
        model.load_weights([("model.layers.9.mlp.experts.0.w1.weight", torch.zeros(1))])
