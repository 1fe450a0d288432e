"""The Triton SGMV LoRA kernel (interpreter on CPU) against plain torch.

Oracle: the plain-torch grouped LoRA matmul (:func:`kvflow.lora.layers.grouped_lora`) run in
float64, and per-shard float64 products for a fused q/k/v layer. Tolerance: the standard
forward-error bound of fp32 dot products (Higham, "Accuracy and Stability of Numerical
Algorithms", 2002, section 3.1): a length-``n`` dot product is off by at most
``gamma_n = n u / (1 - n u)`` times ``sum |x_i a_i|`` (``u = 2^-24``). The shrink then expand
chain, with the intermediate rounded to fp32 and the final add rounded once more, stays within
``gamma_{K+R+2} * (|y| + |x| |A|^T |B|^T)`` elementwise (first order), whatever the summation
order the kernel or torch uses.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

from kvflow.kernels.lora import sgmv_lora
from kvflow.layers.linear import QKVParallelLinear
from kvflow.lora.layers import GroupedLoRA, LoRAContext, LoRALinear, grouped_lora, make_mapping

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
U32 = 2.0 ** -24


def _fp32_bound(y, x, a, b, slots, store_unit=U32):
    """Elementwise bound ``gamma_{K+R+2} (|y| + |x| |A_s|^T |B_s|^T)`` for adapted rows; with
    a 16-bit ``store_unit`` (the intermediate and the output rounded to it, products summed
    in fp32) ``2 * store_unit + gamma_{K+R}`` replaces the gamma."""
    n = x.shape[1] + a.shape[1] + 2
    gamma = n * U32 / (1 - n * U32)
    if store_unit != U32:
        gamma = 2 * store_unit + gamma
    y, x, a, b = (t.double().cpu() for t in (y, x, a, b))
    bound = y.abs()
    for t, s in enumerate(slots):
        if s >= 0:
            bound[t] += (x[t].abs() @ a[s].abs().T) @ b[s].abs().T
    return gamma * bound


def _assert_within(out, exact, bound):
    err = (out.double().cpu() - exact.cpu()).abs()
    bound = bound.cpu()
    worst = (err / bound.clamp_min(1e-300)).max().item()
    assert torch.all(err <= bound), f"error exceeds the fp32 bound (worst ratio {worst:.3g})"


def _case(seed, slots, in_dim, out_dim, rank, max_loras=4):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(len(slots), in_dim, generator=gen)
    a = torch.randn(max_loras, rank, in_dim, generator=gen)
    b = torch.randn(max_loras, out_dim, rank, generator=gen)
    y = torch.randn(len(slots), out_dim, generator=gen)
    return [t.to(DEVICE) for t in (y, x, a, b)]


@pytest.mark.parametrize("slots,in_dim,out_dim,rank", [
    ([1, -1, 0, 1, 2, -1, 0, 0, 2, 1], 24, 40, 8),      # 3 adapters + base rows interleaved
    ([3] * 37 + [-1] + [0] * 5, 100, 70, 16),           # a segment longer than a row tile
    ([2, -1, 2], 64, 130, 48),                          # rank over one rank tile, N > 2 tiles
    ([0, 1, 2, 3], 17, 9, 1),                           # rank 1, dims under one tile
])
def test_sgmv_matches_torch_within_fp32_bound(slots, in_dim, out_dim, rank):
    y, x, a, b = _case(0, slots, in_dim, out_dim, rank)
    mapping = make_mapping(np.array(slots), DEVICE)
    exact = grouped_lora(y.double(), x.double(), a.double(), b.double(), mapping)
    bound = _fp32_bound(y, x, a, b, slots)
    out = sgmv_lora(y.clone(), x, a, b, mapping.token_index, mapping.segment_table,
                    mapping.max_segment_len)
    _assert_within(out, exact, bound)
    _assert_within(grouped_lora(y.clone(), x, a, b, mapping), exact, bound)  # the bound holds
    base_rows = [t for t, s in enumerate(slots) if s < 0]
    assert torch.equal(out[base_rows], y[base_rows])  # no-adapter rows untouched, bit for bit
    assert not torch.allclose(out, y)  # the adapters did add something


def test_fused_qkv_slices_through_the_dispatching_op():
    """A q/k/v layer whose two adapters have different ranks per shard (k: none in slot 0);
    the CUDA implementation (the Triton kernel, interpreted on CPU) adds exactly each shard's
    ``B A x`` to its own rows, checked shard by shard in float64."""
    gen = torch.Generator().manual_seed(3)
    torch.manual_seed(0)
    base = QKVParallelLinear(32, head_dim=8, num_heads=4, num_kv_heads=2).to(DEVICE)
    ctx = LoRAContext()
    layer = LoRALinear(base, max_loras=3, max_rank=8, ctx=ctx)
    rows = {"q": slice(0, 32), "k": slice(32, 48), "v": slice(48, 64)}
    adapters = {0: {"q": 4, "v": 8}, 2: {"q": 2, "k": 8, "v": 3}}
    weights = {slot: {shard: (torch.randn(r, 32, generator=gen),
                              torch.randn(rows[shard].stop - rows[shard].start, r,
                                          generator=gen)) for shard, r in ranks.items()}
               for slot, ranks in adapters.items()}
    for slot, w in weights.items():
        layer.set_slot(slot, {s: (a.to(DEVICE), b.to(DEVICE)) for s, (a, b) in w.items()})
    slots = np.array([2, 0, -1, 0, 2, 2, -1])
    x = torch.randn(len(slots), 32, generator=gen).to(DEVICE)
    y = torch.randn(len(slots), 64, generator=gen).to(DEVICE)
    mapping = make_mapping(slots, DEVICE)
    # contiguous: on CPU the layer keeps B as the transpose of [L, R, out] (its native kernel's
    # layout); the CUDA path's kernel takes [L, out, R] with unit-stride rows, as on CUDA
    out = GroupedLoRA("triton").forward_cuda(y.clone(), x, layer.lora_a,
                                             layer.lora_b.contiguous(), mapping)
    exact = y.double().cpu()
    for t, slot in enumerate(slots):
        for shard, (a, b) in weights.get(int(slot), {}).items():
            exact[t, rows[shard]] += b.double() @ (a.double() @ x[t].double().cpu())
    _assert_within(out, exact, _fp32_bound(y, x, layer.lora_a, layer.lora_b, slots))
    assert torch.equal(out[[2, 6]], y[[2, 6]])
    assert torch.equal(out[[1, 3], 32:48], y[[1, 3], 32:48])  # slot 0 has no k adapter


def test_torch_path_selectable(monkeypatch):
    """``KVFLOW_LORA_KERNEL=torch`` keeps plain torch on CUDA (the kernel is never called);
    another value is refused naming the variable."""
    import kvflow.kernels.lora as kernel

    y, x, a, b = _case(1, [0, 1], 16, 16, 4)
    mapping = make_mapping(np.array([0, 1]), DEVICE)
    monkeypatch.setattr(kernel, "sgmv_lora", lambda *args: pytest.fail("kernel called"))
    monkeypatch.setenv("KVFLOW_LORA_KERNEL", "torch")
    out = GroupedLoRA().forward_cuda(y.clone(), x, a, b, mapping)
    assert torch.equal(out, grouped_lora(y.clone(), x, a, b, mapping))
    monkeypatch.setenv("KVFLOW_LORA_KERNEL", "cutlass")
    with pytest.raises(ValueError, match="KVFLOW_LORA_KERNEL"):
        GroupedLoRA()


def test_sgmv_rejects_mismatched_operands():
    y, x, a, b = _case(2, [0], 16, 16, 4)
    mapping = make_mapping(np.array([0]), DEVICE)
    with pytest.raises(ValueError, match="dtype"):
        sgmv_lora(y, x.double(), a, b, mapping.token_index, mapping.segment_table, 1)
    with pytest.raises(ValueError, match="chain"):
        sgmv_lora(y, x, a, b[:, :8], mapping.token_index, mapping.segment_table, 1)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_gpu_sgmv_bf16():
    slots = [int(s) for s in torch.randint(-1, 4, (300,), generator=torch.Generator()
                                           .manual_seed(4))]
    y, x, a, b = (t.bfloat16() for t in _case(4, slots, 4096, 4096, 64))
    mapping = make_mapping(np.array(slots), DEVICE)
    exact = grouped_lora(y.double(), x.double(), a.double(), b.double(), mapping)
    out = sgmv_lora(y.clone(), x, a, b, mapping.token_index, mapping.segment_table,
                    mapping.max_segment_len)
    _assert_within(out, exact, _fp32_bound(y, x, a, b, slots, store_unit=2.0 ** -8))
