"""MoE grouped-GEMM kernel vs the torch reference (TRITON_INTERPRET=1 on CPU).

fp32: atol=rtol=1e-4 (the kernel keeps the down projection in fp32 before weighting, the
reference rounds it first -- a no-op in fp32); bf16 (GPU): atol=rtol=2e-2.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kvflow.kernels.moe import fused_experts, fused_experts_ref, moe_align_block_size
from kvflow.layers.moe import select_experts

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


def _case(num_tokens, num_experts, top_k, hidden, inter, seed, dtype=torch.float32,
          skip_experts=()):
    """Random activations/weights and a routing that never picks ``skip_experts``."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden ** 0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=gen) / inter ** 0.5
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    logits[:, list(skip_experts)] = -1e9
    weights, ids = select_experts(logits, top_k, renormalize=True)
    return (x.to(DEVICE, dtype), w13.to(DEVICE, dtype), w2.to(DEVICE, dtype),
            weights.to(DEVICE), ids.to(DEVICE))


def test_align_block_size_groups_rows_by_expert():
    ids = torch.tensor([[2, 0], [2, 3], [0, 2], [2, 0]], device=DEVICE)  # expert 1 unused
    sorted_ids, tile_expert = moe_align_block_size(ids, num_experts=4, block_m=2)
    m = ids.numel()
    assert tile_expert.numel() == 4 + 4 and sorted_ids.numel() == 2 * tile_expert.numel()
    tiles = sorted_ids.view(-1, 2).tolist()
    experts = tile_expert.tolist()
    # expert 0: rows 1, 4, 7 (2 tiles), expert 2: rows 0, 2, 5, 6 (2 tiles), expert 3: row 3
    assert experts == [0, 0, 2, 2, 3, -1, -1, -1]
    assert tiles[:5] == [[1, 4], [7, m], [0, 2], [5, 6], [3, m]]
    flat = ids.reshape(-1).tolist()
    for tile, expert in zip(tiles, experts):
        assert all(r == m or flat[r] == expert for r in tile)


@pytest.mark.parametrize("num_tokens,num_experts,top_k,hidden,inter,skip", [
    (1, 4, 2, 32, 48, ()),          # decode: one token
    (7, 8, 2, 48, 40, (1, 5, 6)),   # experts with no tokens, non-power-of-2 dims
    (40, 4, 1, 32, 64, (3,)),       # top-1, groups longer than a tile
    (19, 6, 3, 64, 24, (0,)),
])
def test_fused_experts_matches_reference(num_tokens, num_experts, top_k, hidden, inter, skip):
    x, w13, w2, weights, ids = _case(num_tokens, num_experts, top_k, hidden, inter, seed=0,
                                     skip_experts=skip)
    assert not set(skip) & set(ids.reshape(-1).tolist())
    out = fused_experts(x, w13, w2, weights, ids)
    assert out.shape == x.shape and out.dtype == x.dtype
    torch.testing.assert_close(out, fused_experts_ref(x, w13, w2, weights, ids),
                               atol=1e-4, rtol=1e-4)


def test_fused_experts_no_tokens():
    x, w13, w2, weights, ids = _case(0, 4, 2, 32, 32, seed=1)
    assert fused_experts(x, w13, w2, weights, ids).shape == (0, 32)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("num_tokens", [1, 64, 2048])
def test_gpu_fused_experts_bf16(num_tokens):
    x, w13, w2, weights, ids = _case(num_tokens, 8, 2, 1024, 1408, seed=2, dtype=torch.bfloat16,
                                     skip_experts=(7,))
    torch.testing.assert_close(fused_experts(x, w13, w2, weights, ids),
                               fused_experts_ref(x, w13, w2, weights, ids), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_gpu_fused_experts_many_experts_bf16():
    """Qwen3-30B-A3B-like routing: 128 experts, top-8, decode and prefill sizes."""
    for num_tokens in (4, 512):
        x, w13, w2, weights, ids = _case(num_tokens, 128, 8, 512, 256, seed=3,
                                         dtype=torch.bfloat16)
        torch.testing.assert_close(fused_experts(x, w13, w2, weights, ids),
                                   fused_experts_ref(x, w13, w2, weights, ids),
                                   atol=2e-2, rtol=2e-2)
