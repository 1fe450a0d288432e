"""Rotary embedding (in place) vs torch reference, neox and gpt-j layouts, partial rotary.

fp32 (CPU): atol=rtol=1e-5.  bf16 (GPU): atol=rtol=1.6e-2 (kernel math is fp32, one
rounding at the end, same as the reference).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kvflow.kernels.rotary import rotary_embedding, rotary_embedding_ref

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


def _cache(max_pos: int, rot_dim: int, base: float = 10000.0) -> torch.Tensor:
    inv_freq = 1.0 / base ** (torch.arange(0, rot_dim, 2, dtype=torch.float32) / rot_dim)
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


def _run(is_neox, num_tokens, hq, hk, head_dim, rot_dim, dtype, flat, tol, seed=0):
    gen = torch.Generator().manual_seed(seed)
    max_pos = 4096
    positions = torch.randint(0, max_pos, (num_tokens,), generator=gen).to(DEVICE)
    q = torch.randn(num_tokens, hq, head_dim, generator=gen).to(DEVICE, dtype)
    k = torch.randn(num_tokens, hk, head_dim, generator=gen).to(DEVICE, dtype)
    if flat:
        q, k = q.flatten(1), k.flatten(1)
    cache = _cache(max_pos, rot_dim).to(DEVICE)
    exp_q, exp_k = rotary_embedding_ref(positions, q, k, cache, is_neox, head_size=head_dim)
    out_q, out_k = rotary_embedding(positions, q, k, cache, is_neox, head_size=head_dim)
    assert out_q is q and out_k is k
    torch.testing.assert_close(q, exp_q, **tol)
    torch.testing.assert_close(k, exp_k, **tol)


@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize(
    "hq,hk,head_dim,rot_dim,flat",
    [
        (4, 2, 64, 64, False),
        (6, 2, 128, 128, True),
        (3, 1, 80, 32, False),  # partial rotary, non-power-of-two head_dim
    ],
)
def test_rotary(is_neox, hq, hk, head_dim, rot_dim, flat):
    tol = {"atol": 1e-5, "rtol": 1e-5}
    _run(is_neox, 9, hq, hk, head_dim, rot_dim, torch.float32, flat, tol)


def test_rotary_known_values_and_q_only():
    # Position 1, one pair, angle 1 rad: (1, 0) -> (cos 1, sin 1) in both layouts.
    cache = _cache(4, 2).to(DEVICE)
    pos = torch.tensor([1], device=DEVICE)
    for is_neox in (True, False):
        q = torch.tensor([[[1.0, 0.0]]], device=DEVICE)
        rotary_embedding(pos, q, None, cache, is_neox)
        one = torch.tensor(1.0)
        expected = torch.stack([one.cos(), one.sin()]).view(1, 1, 2)
        torch.testing.assert_close(q.cpu(), expected, atol=1e-6, rtol=1e-6)


def test_rotary_errors():
    q = torch.randn(2, 128, device=DEVICE)
    with pytest.raises(ValueError):  # 2-D without head_size
        rotary_embedding(
            torch.zeros(2, dtype=torch.long, device=DEVICE), q, None, _cache(4, 64).to(DEVICE), True
        )


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("is_neox", [True, False])
def test_gpu_rotary_bf16(is_neox):
    tol = {"atol": 1.6e-2, "rtol": 1.6e-2}
    _run(is_neox, 4096, 32, 8, 128, 128, torch.bfloat16, True, tol, seed=1)
