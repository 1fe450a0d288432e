"""The fused rotary + KV-store kernel against (1) the plain-torch reference (rotary reference,
then the store reference) and (2) the unfused Triton composition it replaces
(``rotary_embedding`` then ``store_kvcache``), which it must equal bit for bit: fp32 and bf16,
neox and gpt-j layouts, partial rotary with an odd head_dim, padding slots (-1), a
slot_mapping shorter than the batch, q/k/v as views of one fused QKV output, int8 and
float8_e4m3fn caches. On CPU in the Triton interpreter; the Llama-3.1-8B shape (GQA 32/8,
head_dim 128, bf16) at a few tokens runs here too, many tokens under the ``gpu`` marker."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kvflow.kernels.kv_quant import dequantize_kv
from kvflow.kernels.kv_store import store_kvcache
from kvflow.kernels.rotary import rotary_embedding
from kvflow.kernels.rotary_kv_store import rotary_store_kvcache, rotary_store_kvcache_ref

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
QUANT = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}


def _cos_sin(max_pos: int, rot_dim: int) -> torch.Tensor:
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, rot_dim, 2, dtype=torch.float32) / rot_dim)
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(DEVICE)


def _case(num_tokens, hq, hk, head_dim, dtype, cache_dtype=None, seed=0, num_slots=None):
    """q/k/v as views of one [T, (hq + 2 hk) * D] QKV buffer, positions, slots (every third
    one -1), a NaN-poisoned cache (int caches: zero) and, for quantized caches, scales."""
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(num_tokens, (hq + 2 * hk) * head_dim, generator=gen).to(DEVICE, dtype)
    q, k, v = qkv.split([hq * head_dim, hk * head_dim, hk * head_dim], dim=-1)
    views = [x.view(num_tokens, -1, head_dim) for x in (q, k, v)]
    positions = torch.randint(0, 2048, (num_tokens,), generator=gen).to(DEVICE)
    num_blocks, block_size = 2 * num_tokens // 16 + 2, 16
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_slots or num_tokens]
    slots[::3] = -1
    cache_dtype = cache_dtype or dtype
    shape = (2, num_blocks, block_size, hk, head_dim)
    cache = torch.zeros(shape, dtype=cache_dtype, device=DEVICE) if cache_dtype in \
        QUANT.values() else torch.full(shape, float("nan"), dtype=cache_dtype, device=DEVICE)
    scales = torch.zeros(shape[:4], device=DEVICE) if cache_dtype in QUANT.values() else None
    return positions, views, slots.to(DEVICE), cache, scales


def _clone(views, cache, scales):
    return ([x.clone() for x in views], cache.clone(),
            None if scales is None else scales.clone())


def _run_three(positions, views, slots, cache, scales, cos_sin, is_neox):
    """(fused, unfused composition, reference) results: (q, k, cache, scales) each."""
    results = []
    for way in ("fused", "unfused", "ref"):
        (q, k, v), c, s = _clone(views, cache, scales)
        if way == "fused":
            out = rotary_store_kvcache(positions, q, k, v, cos_sin, is_neox, c, slots, s)
            assert out[0] is q and out[1] is k
        elif way == "unfused":
            rotary_embedding(positions, q, k, cos_sin, is_neox)
            store_kvcache(k, v, c, slots, s)
        else:
            q, k = rotary_store_kvcache_ref(positions, q, k, v, cos_sin, is_neox, c, slots, s)
        results.append((q, k, c, s))
    return results


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int16) \
        if t.element_size() == 2 else t.view(torch.int32)


def _assert_same_bits(a, b):
    """Equal bit patterns (NaN-poisoned cache slots included)."""
    assert torch.equal(_bits(a), _bits(b))


@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("hq,hk,head_dim,rot_dim", [(4, 2, 64, 64), (3, 1, 80, 32)])
def test_fused_matches_composition_and_reference_fp32(is_neox, hq, hk, head_dim, rot_dim):
    case = _case(9, hq, hk, head_dim, torch.float32, seed=hq)
    fused, unfused, ref = _run_three(*case, _cos_sin(2048, rot_dim), is_neox)
    for got, want in zip(fused, unfused):
        if got is not None:
            _assert_same_bits(got, want)
    for got, want in zip(fused[:3], ref[:3]):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, equal_nan=True)
    stored = ~fused[2].isnan().all(-1).all(-1)  # [2, blocks, block_size] slots written
    assert int(stored[0].sum()) == int((case[2] >= 0).sum())  # each real slot, no padding


@pytest.mark.parametrize("num_tokens", [1, 3])
def test_fused_llama8b_shape_bf16(num_tokens):
    """GQA 32/8, head_dim 128, bf16: equal to the composition, close to the reference."""
    case = _case(num_tokens, 32, 8, 128, torch.bfloat16, seed=num_tokens)
    fused, unfused, ref = _run_three(*case, _cos_sin(2048, 128), True)
    for got, want in zip(fused[:3], unfused[:3]):
        _assert_same_bits(got, want)
    for got, want in zip(fused[:3], ref[:3]):  # one bf16 rounding apart at most
        torch.testing.assert_close(got, want, atol=1.6e-2, rtol=1.6e-2, equal_nan=True)


@pytest.mark.parametrize("name", QUANT)
@pytest.mark.parametrize("head_dim,rot_dim", [(64, 64), (80, 32)])
def test_fused_quantized_cache(name, head_dim, rot_dim):
    case = _case(7, 4, 2, head_dim, torch.float32, QUANT[name], seed=5)
    case[1][1][2] = 0.0  # an all-zero key row keeps zeros and a tiny scale
    fused, unfused, ref = _run_three(*case, _cos_sin(2048, rot_dim), True)
    for got, want in zip(fused, unfused):
        _assert_same_bits(got, want)
    # the reference rotates with other fp32 roundings: scales agree to fp32 precision,
    # dequantized values to one quantization step (int8: a scale; e4m3: 2^-3 relative)
    torch.testing.assert_close(fused[3], ref[3], rtol=1e-5, atol=0)
    deq_fused, deq_ref = (dequantize_kv(c, s, torch.float32) for _, _, c, s in (fused, ref))
    step = ref[3].unsqueeze(-1) * (1.0 if name == "int8" else 2.0 ** -3 * 448)
    assert bool(((deq_fused - deq_ref).abs() <= step * 1.001).all())
    assert (deq_fused == deq_ref).float().mean() > 0.95  # and nearly all equal


def test_trailing_tokens_rotated_not_stored():
    """slot_mapping shorter than positions (CUDA-graph padding): all tokens are rotated, only
    the first N are stored."""
    positions, views, slots, cache, _ = _case(6, 2, 1, 64, torch.float32, num_slots=3, seed=2)
    slots = torch.tensor([5, -1, 17], device=DEVICE)
    fused, unfused, _ = _run_three(positions, views, slots, cache, None, _cos_sin(2048, 64),
                                   True)
    for got, want in zip(fused[:3], unfused[:3]):
        _assert_same_bits(got, want)
    assert int((~cache.isnan()).sum()) == 0 and int((~fused[2].isnan()).sum()) == 2 * 2 * 64
    torch.testing.assert_close(fused[2][0, 0, 5], fused[1][0])  # token 0's rotated key


def test_bad_inputs():
    positions, (q, k, v), slots, cache, _ = _case(4, 2, 1, 64, torch.float32)
    cos_sin = _cos_sin(2048, 64)
    with pytest.raises(ValueError, match="kv_scales"):
        rotary_store_kvcache(positions, q, k, v, cos_sin, True, cache, slots,
                             torch.zeros(cache.shape[:4], device=DEVICE))
    with pytest.raises(ValueError, match="needs kv_scales"):
        rotary_store_kvcache(positions, q, k, v, cos_sin, True, cache.to(torch.int8), slots)
    with pytest.raises(ValueError, match="rot_dim"):
        rotary_store_kvcache(positions, q, k, v, _cos_sin(8, 66)[:, :66], True, cache, slots)
    with pytest.raises(ValueError, match="heads/dim"):
        rotary_store_kvcache(positions, q, k, v, cos_sin, True, cache[:, :, :, :, :32], slots)
    with pytest.raises(ValueError, match="fewer tokens"):
        rotary_store_kvcache(torch.arange(5, device=DEVICE), q, k, v, cos_sin, True, cache,
                             slots)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("name", [None, "int8", "fp8_e4m3"])
def test_gpu_fused_llama8b_many_tokens(name):
    case = _case(300, 32, 8, 128, torch.bfloat16, QUANT.get(name), seed=11)
    fused, unfused, _ = _run_three(*case, _cos_sin(2048, 128), True)
    for got, want in zip(fused, unfused):
        if got is not None:
            _assert_same_bits(got, want)
