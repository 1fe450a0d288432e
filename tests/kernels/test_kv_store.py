"""store_kvcache (Triton) vs store_kvcache_ref: pure copies, so results must match exactly."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kvflow.kernels.kv_store import store_kvcache, store_kvcache_ref

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


def _run(num_tokens, num_kv_heads, head_dim, block_size, num_blocks, dtype, seed, strided=False):
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)
    if strided:  # k/v as views into a fused [T, 2*H, D] buffer
        fused = torch.cat([k, v], dim=1)
        k, v = fused[:, :num_kv_heads], fused[:, num_kv_heads:]
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[::4] = -1  # padding tokens are skipped
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    k, v, cache = (t.to(device=DEVICE, dtype=dtype) for t in (k, v, cache))
    slots = slots.to(DEVICE)
    expected = cache.clone()
    store_kvcache_ref(k, v, expected, slots)
    store_kvcache(k, v, cache, slots)
    torch.testing.assert_close(cache, expected, atol=0, rtol=0)


@pytest.mark.parametrize(
    "num_kv_heads,head_dim,block_size", [(2, 64, 16), (3, 128, 16), (1, 80, 8)]
)
def test_store_kvcache(num_kv_heads, head_dim, block_size):
    _run(21, num_kv_heads, head_dim, block_size, 6, torch.float32, seed=num_kv_heads)


def test_store_kvcache_strided_int32_slots_and_trailing_tokens():
    _run(13, 2, 64, 16, 4, torch.float32, seed=7, strided=True)
    # slot_mapping shorter than k/v: trailing tokens are ignored; int32 slots accepted.
    k = torch.ones(5, 2, 64, device=DEVICE)
    cache = torch.zeros(2, 2, 16, 2, 64, device=DEVICE)
    store_kvcache(k, k * 2, cache, torch.tensor([3, -1, 17], dtype=torch.int32, device=DEVICE))
    assert cache[0, 0, 3].eq(1).all() and cache[1, 1, 1].eq(2).all()
    assert cache.ne(0).sum() == 2 * 2 * 2 * 64


def test_store_kvcache_bad_shapes():
    k = torch.zeros(3, 2, 64, device=DEVICE)
    cache = torch.zeros(2, 2, 16, 2, 32, device=DEVICE)
    with pytest.raises(ValueError):
        store_kvcache(k, k, cache, torch.zeros(3, dtype=torch.int64, device=DEVICE))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_gpu_store_kvcache_bf16():
    _run(4096, 8, 128, 16, 1024, torch.bfloat16, seed=11)
