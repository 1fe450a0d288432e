"""Native batched multi-LoRA (kernels/csrc/cpu_lora.c) at every ISA level this CPU runs.

Oracle: the same LoRA in float64 from plain torch indexing, ``y[t] + (x[t] A[s]^T) B[s]^T``
per row. Error bound of the kernel's fp32 math (Higham, Accuracy and Stability of Numerical
Algorithms, 3.1: a dot product of n terms errs by at most ~n u times the sum of its terms'
magnitudes): the shrink's ``in`` terms and the expand's ``R`` give ``(in + R + 2) u`` times
``(|x| |A|^T) |B|^T``; the sum ``y + delta`` rounds once more (one unit roundoff of the
result), a 16-bit ``y`` twice, as torch's ``y.add_(delta.to(y.dtype))`` does (the delta, then
the sum).
"""

from __future__ import annotations

import pytest
import torch

from kvflow.kernels import cpu_native
from kvflow.lora.layers import GroupedLoRA, grouped_lora, make_mapping

UNIT = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
SLOTS = [0, -1, 2, 2, 1, -1, 0, 2, 2, 2, 2, 1, 0]  # 13 rows: three adapters and none, mixed


def _operands(dtype: torch.dtype, rank: int, in_features: int = 97, out: int = 131,
              max_loras: int = 3, seed: int = 0, layout: str = "rows"):
    """(y, x, lora_a, lora_b, slots) of SLOTS' rows; ``layout`` ``cols``: lora_b the transpose
    of a contiguous [max_loras, R, out] (what LoRALinear keeps on CPU), ``rows``: contiguous."""
    gen = torch.Generator().manual_seed(seed)
    rows = len(SLOTS)
    x = torch.randn(rows, in_features, generator=gen).to(dtype)
    y = torch.randn(rows, out, generator=gen).to(dtype)
    a = torch.randn(max_loras, rank, in_features, generator=gen) / in_features**0.5
    b = torch.randn(max_loras, out, rank, generator=gen) / rank**0.5
    if layout == "cols":
        b = b.transpose(1, 2).contiguous().transpose(1, 2)
        assert not b.is_contiguous() or rank == 1  # (rank 1: both layouts are one)
    return y, x, a, b, torch.tensor(SLOTS, dtype=torch.int32)


def _reference(y, x, a, b, slots):
    """(float64 result, its error bound) per element; rows of slot -1 keep y exactly."""
    ref, bound = y.double().clone(), torch.zeros(y.shape, dtype=torch.float64)
    u32, u = UNIT[torch.float32], UNIT[y.dtype]
    for t, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        xa = x[t].double() @ a[s].double().T
        delta = xa @ b[s].double().T
        mags = (x[t].double().abs() @ a[s].double().abs().T) @ b[s].double().abs().T
        ref[t] += delta
        fp32 = (a.shape[2] + a.shape[1] + 2) * u32 * mags
        # fp32 y: the sum y + delta rounds once more (u |result|: small deltas on large y)
        bound[t] = fp32 + u32 * (ref[t].abs() + fp32) if y.dtype == torch.float32 else \
            fp32 + u * (delta.abs() + fp32) + u * (ref[t].abs() + u * delta.abs() + fp32)
    return ref, bound


@pytest.mark.parametrize("layout", ["rows", "cols"])
@pytest.mark.parametrize("rank", [8, 16, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_lora_rows_match_float64(kernels, dtype, rank, layout):
    y, x, a, b, slots = _operands(dtype, rank, layout=layout)
    before = y.clone()
    assert kernels.lora(y, x, a, b, slots) is y
    ref, bound = _reference(before, x, a, b, slots)
    assert ((y.double() - ref).abs() <= bound).all(), (y.double() - ref).abs().max()
    none = slots < 0
    assert torch.equal(y[none], before[none])  # rows without an adapter: untouched
    assert not torch.equal(y[~none], before[~none])


# (rank, in, out): odd ranks and sizes; outputs 83 and 131 reach every path of the vector
# expand (blocks of 4 or 2 vectors, single vectors, single outputs) at 8 and 16 lanes
ODD_SHAPES = [(1, 5, 3), (5, 97, 83), (7, 33, 131), (3, 8, 16)]


@pytest.mark.parametrize("layout", ["rows", "cols"])
@pytest.mark.parametrize("rank,in_features,out", ODD_SHAPES)
def test_odd_shapes_match_float64(kernels, rank, in_features, out, layout):
    y, x, a, b, slots = _operands(torch.float32, rank, in_features, out, layout=layout)
    before = y.clone()
    kernels.lora(y, x, a, b, slots)
    ref, bound = _reference(before, x, a, b, slots)
    assert ((y.double() - ref).abs() <= bound).all(), (y.double() - ref).abs().max()


@pytest.mark.parametrize("rank", [16, 7])
@pytest.mark.parametrize("layout", ["rows", "cols"])
def test_a_rows_result_does_not_depend_on_the_step_mix(kernels, layout, rank):
    """A replayed step graph serves any mix of adapters: each row's bits are those it gets
    alone (tiles of one slot, fixed summation order per row; a row alone runs the one-row
    shrink, 4 rank rows at a time, and with ``cols`` the one-row expand, in a tile of 2-4
    rows the tile's)."""
    y, x, a, b, slots = _operands(torch.bfloat16, rank, out=83, layout=layout)
    mixed = y.clone()
    kernels.lora(mixed, x, a, b, slots)
    for t, s in enumerate(SLOTS):
        alone = y[t:t + 1].clone()
        kernels.lora(alone, x[t:t + 1], a, b, torch.tensor([s], dtype=torch.int32))
        assert torch.equal(alone[0], mixed[t]), t


# rank 64 on a fused layer of two shards (128 rank rows, as SmolLM2's gate_up at
# --max-lora-rank 64), 70 rows: 67 of one slot (a block of 64 rows, then 3: the blocked
# shrink's 8-rank-row groups over pairs of rows and a row alone, the expand's chunks of B
# packed for several tiles), 2 of another, 1 without; in = 600 (a k tail of 8 past the
# 16-lane loads), out = 1000 (7 chunks of 64 outputs, then 104: a block of 4 vectors, 2,
# single outputs)
BIG_SLOTS = [1] * 40 + [0, -1] + [1] * 27 + [0]


def _big_operands(dtype: torch.dtype, layout: str):
    gen = torch.Generator().manual_seed(5)
    rows, rank, in_features, out = len(BIG_SLOTS), 128, 600, 1000
    x = torch.randn(rows, in_features, generator=gen).to(dtype)
    y = torch.randn(rows, out, generator=gen).to(dtype)
    a = torch.randn(2, rank, in_features, generator=gen) / in_features**0.5
    b = torch.randn(2, out, rank, generator=gen) / rank**0.5
    if layout == "cols":
        b = b.transpose(1, 2).contiguous().transpose(1, 2)
    return y, x, a, b, torch.tensor(BIG_SLOTS, dtype=torch.int32)


@pytest.mark.parametrize("layout", ["rows", "cols"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rank_64_blocks_match_float64(kernels, dtype, layout):
    """Many rows of one adapter at rank 64 (the blocked shrink and chunked expand), against
    float64 within the bound of the module docstring: (in + R + 2) u = 730 u of fp32 times
    the magnitudes' sum, plus y's roundings."""
    y, x, a, b, slots = _big_operands(dtype, layout)
    before = y.clone()
    kernels.lora(y, x, a, b, slots)
    ref, bound = _reference(before, x, a, b, slots)
    assert ((y.double() - ref).abs() <= bound).all(), (y.double() - ref).abs().max()
    assert torch.equal(y[1 + 40], before[1 + 40])  # the row without an adapter


@pytest.mark.parametrize("layout", ["rows", "cols"])
def test_rank_64_rows_do_not_depend_on_their_block(kernels, layout):
    """Each row's bits in a 70-row call (blocks of up to 64 rows, pairs, a row alone) are
    those it gets alone: the shrink's and the expand's sums per row run in one order."""
    y, x, a, b, slots = _big_operands(torch.bfloat16, layout)
    mixed = y.clone()
    kernels.lora(mixed, x, a, b, slots)
    for t, s in enumerate(BIG_SLOTS):
        alone = y[t:t + 1].clone()
        kernels.lora(alone, x[t:t + 1], a, b, torch.tensor([s], dtype=torch.int32))
        assert torch.equal(alone[0], mixed[t]), t


@pytest.mark.parametrize("layout", ["rows", "cols"])
def test_strided_rows(kernels, layout):
    """x and y as column slices of wider rows (a fused layer's output, say)."""
    y, x, a, b, slots = _operands(torch.float32, 8, layout=layout)
    wide_x = torch.randn(len(SLOTS), 200)
    wide_x[:, 50:50 + x.shape[1]] = x
    wide_y = torch.randn(len(SLOTS), 300)
    wide_y[:, 7:7 + y.shape[1]] = y
    kept = wide_y.clone()
    kernels.lora(wide_y[:, 7:7 + y.shape[1]], wide_x[:, 50:50 + x.shape[1]], a, b, slots)
    kernels.lora(y, x, a, b, slots)
    assert torch.equal(wide_y[:, 7:7 + y.shape[1]], y)
    assert torch.equal(wide_y[:, :7], kept[:, :7]) and torch.equal(wide_y[:, 138:], kept[:, 138:])


def test_slot_past_max_loras_raises_and_writes_nothing(kernels):
    y, x, a, b, slots = _operands(torch.float32, 8)
    slots[-1] = 3
    before = y.clone()
    with pytest.raises(ValueError, match="max_loras=3"):
        kernels.lora(y, x, a, b, slots)
    assert torch.equal(y, before)


@pytest.mark.parametrize("change,match", [
    (lambda ops: {**ops, "slots": ops["slots"].long()}, "slots must be"),
    (lambda ops: {**ops, "slots": ops["slots"][:-1]}, "slots must be"),
    (lambda ops: {**ops, "lora_a": ops["lora_a"].bfloat16()}, "lora_a and lora_b"),
    (lambda ops: {**ops, "lora_b": ops["lora_b"][:, ::2]}, "lora_a and lora_b"),
    (lambda ops: {**ops, "lora_b": ops["lora_b"].transpose(0, 1).contiguous().transpose(0, 1)},
     "lora_a and lora_b"),
    (lambda ops: {**ops, "x": ops["x"][:, :-1]}, "shapes do not chain"),
    (lambda ops: {**ops, "y": ops["y"].t()}, "unit-stride rows"),
])
def test_bad_arguments_raise_value_error(change, match):
    kernels = cpu_native.native_cpu_kernels()
    if kernels is None:
        pytest.skip("no C compiler")
    y, x, a, b, slots = _operands(torch.float32, 8)
    ops = change({"y": y, "x": x, "lora_a": a, "lora_b": b, "slots": slots})
    with pytest.raises(ValueError, match=match):
        kernels.lora(**ops)


def test_layer_runs_the_kernel_only_with_row_slots():
    """GroupedLoRA on CPU: a mapping with ``row_slots`` (a CPU step graph's) runs the native
    kernel, agreeing with the torch path (one matmul pair per adapter) to fp32 rounding;
    without them it is the torch path itself, bit for bit."""
    kernels = cpu_native.native_cpu_kernels()
    if kernels is None:
        pytest.skip("no C compiler")
    y, x, a, b, slots = _operands(torch.float32, 16)
    mapping = make_mapping(slots.long().numpy(), torch.device("cpu"))
    op = GroupedLoRA()
    torch_path = grouped_lora(y.clone(), x, a, b, mapping)
    assert torch.equal(op(y.clone(), x, a, b, mapping), torch_path)
    native = op(y.clone(), x, a, b, mapping.__class__(**{**vars(mapping), "row_slots": slots}))
    assert torch.equal(native, kernels.lora(y.clone(), x, a, b, slots))
    assert torch.allclose(native, torch_path, rtol=0, atol=1e-4)
