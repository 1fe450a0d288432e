"""kvflow's native INT8 embedding lookup (``csrc/cpu_quant_embed.c``) against plain torch, at
every ISA level this CPU runs.

Oracle: the torch expression the INT8 embedding method computes without the native kernels,
``(F.embedding(ids, q).float() * scale[ids, None]).to(dtype)``. The lookup is a gather, an
exact widening, one fp32 multiply and one round-to-nearest-even, so the kernel must equal it
bit for bit (compared as bit patterns), also where fp16 overflows to inf or goes subnormal.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvflow.kernels import cpu_native
from kvflow.layers.embedding import VocabParallelEmbedding
from kvflow.quant.int8 import Int8EmbeddingMethod

pytestmark = pytest.mark.skipif(cpu_native.native_cpu_kernels() is None,
                                reason="native CPU kernels not built")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}



def _reference(q: torch.Tensor, scale: torch.Tensor, ids: torch.Tensor,
               dtype: torch.dtype) -> torch.Tensor:
    return (F.embedding(ids, q).float() * scale[ids, None]).to(dtype)


def _table(n: int, width: int, stride: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """An int8 table [n, width] with row stride ``stride`` (padded rows), every int8 value
    including -128, and scales from 1e-9 (fp16 subnormals and zeros) to 1e3 (fp16 overflow)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-128, 128, (n, stride), dtype=torch.int8, generator=gen)[:, :width]
    q[0, :4] = torch.tensor([-128, 127, 0, -1], dtype=torch.int8)[:width]
    scale = torch.exp(torch.empty(n).uniform_(-21, 7, generator=gen)).float()
    q[n - 1, 0], scale[n - 1] = 127, 1e3  # 127000: inf in fp16
    q[7, 0], scale[7] = 1, 1e-7  # an fp16 subnormal
    return q, scale


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [1, 24, 67, 576])
def test_int8_embedding_equals_torch_bit_for_bit(kernels, dtype, width):
    """Any order, repeats, the first and last rows, K not a multiple of any vector width."""
    q, scale = _table(53, width, width + 13, width)
    ids = torch.tensor([52, 0, 7, 7, 31, 2, 0, 52], dtype=torch.int64)
    out = kernels.int8_embedding(q, scale, ids, dtype)
    ref = _reference(q, scale, ids, dtype)
    assert out.dtype == dtype and out.shape == (8, width) and out.is_contiguous()
    assert torch.equal(out.view(BITS[dtype]), ref.view(BITS[dtype]))
    if dtype == torch.float16:  # the scales reach both ends of fp16's range
        assert ref.isinf().any() and (ref != 0).logical_and(ref.abs() < 2 ** -14).any()
    assert kernels.int8_embedding(q, scale, ids[:0], dtype).shape == (0, width)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_embedding_many_rows_on_threads(kernels, dtype):
    """A prefill-sized lookup (64K+ values: rows shared among OpenMP threads) equals torch."""
    q, scale = _table(400, 320, 320, 5)
    ids = torch.randint(0, 400, (700,), generator=torch.Generator().manual_seed(6))
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        out = kernels.int8_embedding(q, scale, ids, dtype)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(out.view(BITS[dtype]), _reference(q, scale, ids, dtype).view(BITS[dtype]))


def test_int8_embedding_refuses_bad_input():
    kernels = cpu_native.native_cpu_kernels()
    q, scale = _table(10, 4, 4, 0)
    for ids in (torch.tensor([3, 10]), torch.tensor([-1])):
        with pytest.raises(ValueError, match=r"\[0, 10\)"):
            kernels.int8_embedding(q, scale, ids, torch.float32)
    bad = [(q.float(), scale, torch.tensor([1]), torch.float32),  # not int8
           (q, scale[:9], torch.tensor([1]), torch.float32),  # one scale short
           (q, scale.double(), torch.tensor([1]), torch.float32),
           (q, scale, torch.tensor([1], dtype=torch.int32), torch.float32),
           (q, scale, torch.tensor([1]), torch.float64)]
    for args in bad:
        with pytest.raises(ValueError, match="int8_embedding needs"):
            kernels.int8_embedding(*args)


@pytest.mark.parametrize("dtype", DTYPES)
def test_int8_embedding_method_native_equals_torch(dtype):
    """The INT8 embedding method with the native kernels attached (what worker/cpu_setup.py
    does on CPU) returns the torch lookup's bits; without them it runs that torch lookup."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        layer = VocabParallelEmbedding(37, 40, quant_method=Int8EmbeddingMethod())
    finally:
        torch.set_default_dtype(previous)
    layer.weight.data.copy_(torch.randn(37, 40, generator=torch.Generator().manual_seed(2)))
    layer.quant_method.process_weights_after_loading(layer)
    ids = torch.tensor([36, 0, 5, 5, 17])
    plain = layer(ids)
    layer.native_kernels = cpu_native.native_cpu_kernels()
    native = layer(ids)
    ref = _reference(layer.weight, layer.weight_scale, ids, dtype)
    assert plain.dtype == native.dtype == dtype
    assert torch.equal(plain.view(BITS[dtype]), ref.view(BITS[dtype]))
    assert torch.equal(native.view(BITS[dtype]), ref.view(BITS[dtype]))
