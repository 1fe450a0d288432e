"""Quantized KV cache (int8 / fp8_e4m3, one float32 scale per token and KV head): the torch
rule against hand-computed values, the Triton store against the torch store (bit-exact, in the
interpreter on CPU), and Triton and torch-backend attention over a quantized cache against the
plain reference attention over the dequantized cache."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kvflow.attention.backend import AttentionMetadata
from kvflow.attention.torch_paged import TorchPagedAttentionBackend
from kvflow.kernels.kv_quant import (
    dequantize_kv,
    fake_quantize_kv,
    hadamard_matrix,
    key_rotation,
    quantize_kv,
)
from kvflow.kernels.kv_store import store_kvcache, store_kvcache_ref
from kvflow.kernels.paged_attention import paged_attention, paged_attention_ref
from tests.kernels.paged_batch import make_batch

DTYPES = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}


def test_int8_rule_by_hand():
    x = torch.tensor([[0.5, -1.27, 0.0, 0.3]])
    q, s = quantize_kv(x, torch.int8)
    assert float(s[0]) == pytest.approx(0.01)  # absmax 1.27 / 127
    assert q.tolist() == [[50, -127, 0, 30]]
    zero_q, zero_s = quantize_kv(torch.zeros(1, 4), torch.int8)
    assert zero_q.eq(0).all() and float(zero_s[0]) > 0


def test_hadamard_by_hand_and_against_scipy():
    from scipy.linalg import hadamard

    torch.testing.assert_close(hadamard_matrix(2), torch.tensor([[1.0, 1.0], [1.0, -1.0]]) / 2 ** 0.5)
    for n in (1, 4, 64, 256):
        h = hadamard_matrix(n)
        torch.testing.assert_close(h, torch.from_numpy(hadamard(n)).float() / n ** 0.5)
        torch.testing.assert_close(h @ h.T, torch.eye(n), atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="power-of-2"):
        hadamard_matrix(80)


def test_key_rotation_blocks_and_orthonormality():
    r = key_rotation(80)  # 80 = 5 x 16: five Hadamard blocks of order 16
    torch.testing.assert_close(r[:16, :16], hadamard_matrix(16))
    assert torch.equal(r[:16, 16:], torch.zeros(16, 64))
    torch.testing.assert_close(r @ r.T, torch.eye(80), atol=1e-6, rtol=0)
    torch.testing.assert_close(key_rotation(256), hadamard_matrix(256))


def test_rotation_keeps_scores_and_shrinks_outlier_keys_error():
    """(q R).(k R) = q.k, and a key row with one outlier channel rounds ~8x better rotated
    (hand estimate: the step shrinks from 64/127 to about absmax(k R)/127 ~ 5/127)."""
    gen = torch.Generator().manual_seed(1)
    q, k = torch.randn(32, 256, generator=gen), torch.randn(32, 256, generator=gen)
    k[:, 7] = 64.0  # an outlier channel, as gemma's keys have
    r = key_rotation(256)
    torch.testing.assert_close((q @ r) @ (k @ r).T, q @ k.T, atol=1e-3, rtol=1e-5)
    plain = (fake_quantize_kv(k, torch.int8) - k).pow(2).mean()
    rotated = (fake_quantize_kv(k @ r, torch.int8) @ r.T - k).pow(2).mean()
    assert float(plain / rotated) > 8


@pytest.mark.parametrize("name", DTYPES)
def test_rule_error_bounds(name):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, 32, generator=gen) * torch.logspace(-2, 2, 4).view(1, 4, 1)
    q, s = quantize_kv(x, DTYPES[name])
    assert q.dtype == DTYPES[name] and s.shape == (64, 4)
    err = (dequantize_kv(q, s, torch.float32) - x).abs()
    if name == "int8":  # half a step of absmax/127 per (token, head)
        assert bool((err <= s.unsqueeze(-1) / 2 * (1 + 1e-5)).all())
    else:  # e4m3: 3 mantissa bits, relative 2^-4 for normal values
        normal = x.abs() >= s.unsqueeze(-1) * 2 ** -6
        assert bool((err[normal] <= x.abs()[normal] * 2 ** -4 * (1 + 1e-5)).all())
    torch.testing.assert_close(fake_quantize_kv(x, DTYPES[name]),
                               dequantize_kv(q, s, torch.float32))


@pytest.mark.parametrize("name", DTYPES)
@pytest.mark.parametrize("num_kv_heads,head_dim", [(2, 64), (3, 80)])
def test_triton_store_matches_torch(name, num_kv_heads, head_dim):
    gen = torch.Generator().manual_seed(num_kv_heads)
    k = torch.randn(19, num_kv_heads, head_dim, generator=gen) * 3
    v = torch.randn(19, num_kv_heads, head_dim, generator=gen)
    k[4] = 0.0  # an all-zero row keeps zeros
    slots = torch.randperm(6 * 16, generator=gen)[:19]
    slots[::5] = -1
    caches = [torch.zeros(2, 6, 16, num_kv_heads, head_dim, dtype=DTYPES[name])
              for _ in range(2)]
    scales = [torch.zeros(2, 6, 16, num_kv_heads) for _ in range(2)]
    store_kvcache(k, v, caches[0], slots, scales[0])
    store_kvcache_ref(k, v, caches[1], slots, scales[1])
    assert torch.equal(scales[0], scales[1])
    assert torch.equal(caches[0].view(torch.uint8), caches[1].view(torch.uint8))


def _quantized_batch(name: str, reqs, seed: int, poison: bool = True):
    """A paged batch whose cache is quantized; unused slots are NaN (``poison``: a read
    outside a context shows) or zero (the torch backend gathers whole blocks and masks)."""
    batch = make_batch(reqs, num_heads=4, num_kv_heads=2, head_dim=64, seed=seed)
    if not poison:
        batch["kv_cache"] = batch["kv_cache"].nan_to_num(0.0)
    qcache, scales = quantize_kv(batch["kv_cache"], DTYPES[name])
    deq = dequantize_kv(qcache, scales, torch.float32)
    return batch, qcache, scales, deq


@pytest.mark.parametrize("name", DTYPES)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_triton_attention_reads_quantized_cache(name, num_splits):
    batch, qcache, scales, deq = _quantized_batch(name, [(37, 5), (0, 9), (70, 1)], seed=3)
    n = int(batch["query_start_loc"][-1])
    ref = paged_attention_ref(**{**batch, "kv_cache": deq})
    out = paged_attention(**{**batch, "kv_cache": qcache}, kv_scales=scales,
                          num_splits=num_splits)
    torch.testing.assert_close(out[:n], ref[:n], atol=1e-4, rtol=1e-4)
    plain = paged_attention_ref(**batch)
    assert (plain[:n] - ref[:n]).abs().max() > 1e-4  # quantization is visible


@pytest.mark.parametrize("name", DTYPES)
def test_torch_backend_stores_and_reads_quantized_cache(name):
    """A mixed step (a prefill chunk after a cached prefix, a decode) on the torch backend:
    the new K/V are quantized into the cache, and attention equals the reference over the
    dequantized cache."""
    reqs = [(21, 6), (40, 1)]
    batch, qcache, scales, deq = _quantized_batch(name, reqs, seed=5, poison=False)
    n = int(batch["query_start_loc"][-1])
    gen = torch.Generator().manual_seed(9)
    k, v = (torch.randn(n, 2, 64, generator=gen) for _ in range(2))
    block_size, slots = 16, []
    for i, (cached, q_len) in enumerate(reqs):
        for pos in range(cached, cached + q_len):
            slots.append(int(batch["block_table"][i, pos // block_size]) * block_size
                         + pos % block_size)
    slot_mapping = torch.tensor(slots)
    meta = AttentionMetadata(slot_mapping, batch["query_start_loc"], batch["seq_lens"],
                             batch["block_table"], batch["max_query_len"],
                             batch["max_seq_len"], n)
    backend = TorchPagedAttentionBackend()
    backend.prepare(meta, block_size)
    out = backend.forward(batch["q"][:n], k, v, qcache, meta, batch["scale"],
                          kv_scales=scales)
    for i, x in enumerate((k, v)):  # the reference cache holds the same rounded rows
        deq[i].view(-1, 2, 64)[slot_mapping] = fake_quantize_kv(x, DTYPES[name])
    ref = paged_attention_ref(**{**batch, "kv_cache": deq})
    torch.testing.assert_close(out, ref[:n], atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", DTYPES)
def test_gpu_triton_store_matches_torch_bit_for_bit(name):
    """On a GPU the Triton store divides as torch does (``div_rn``; Triton's plain ``/`` is
    the approximate ``div.full.f32`` there: tests/kernels/test_kv_store_gpu_build.py), so
    4096 bf16 tokens x 8 KV heads quantize to the same values and scales as the torch rule."""
    from kvflow.kernels.rotary_kv_store import rotary_store_kvcache

    gen = torch.Generator(device="cuda").manual_seed(0)
    k = (torch.randn(4096, 8, 128, generator=gen, device="cuda") * 3).bfloat16()
    v = torch.randn(4096, 8, 128, generator=gen, device="cuda").bfloat16()
    slots = torch.randperm(300 * 16, generator=gen, device="cuda")[:4096]
    want_k, want_sk = quantize_kv(k, DTYPES[name])
    want_v, want_sv = quantize_kv(v, DTYPES[name])
    for fused in (False, True):
        cache = torch.zeros(2, 300, 16, 8, 128, dtype=DTYPES[name], device="cuda")
        scales = torch.zeros(2, 300, 16, 8, device="cuda")
        if fused:  # rotation by angle 0 (cos 1, sin 0): the fused kernel's store alone
            cos_sin = torch.cat([torch.ones(1, 64), torch.zeros(1, 64)], 1).cuda()
            q = torch.zeros(4096, 8, 128, dtype=torch.bfloat16, device="cuda")
            rotary_store_kvcache(torch.zeros(4096, dtype=torch.int64, device="cuda"), q,
                                 k.clone(), v, cos_sin, True, cache, slots, scales)
        else:
            store_kvcache(k, v, cache, slots, scales)
        for i, (want, want_s) in enumerate(((want_k, want_sk), (want_v, want_sv))):
            assert torch.equal(scales[i].view(-1, 8)[slots], want_s), (fused, i)
            assert torch.equal(cache[i].view(-1, 8, 128)[slots].view(torch.uint8),
                               want.view(torch.uint8)), (fused, i)
