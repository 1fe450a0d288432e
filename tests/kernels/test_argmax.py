"""The native argmax of greedy sampling (``kernels/argmax.py``, ``csrc/cpu_argmax.c``) against
``torch.argmax``: random rows, ties (the first index wins), NaN (the first NaN wins), rows of
-inf, +inf, a strided batch, and the sampler's greedy tokens; the first two at every ISA level
this CPU runs (the max reduction vectorizes 16, 8 or 4 lanes wide)."""

from __future__ import annotations

import pytest
import torch

from kvflow.kernels import argmax
from kvflow.kernels.argmax import argmax_rows
from kvflow.kernels.cpu_native import native_cpu_kernels

pytestmark = pytest.mark.skipif(native_cpu_kernels() is None, reason="no C compiler")


@pytest.fixture
def at_level(kernels, monkeypatch):
    """argmax_rows on the kernels of each ISA level (the ``kernels`` fixture)."""
    monkeypatch.setattr(argmax, "native_cpu_kernels", lambda: kernels)


def test_random_rows_match_torch(at_level):
    gen = torch.Generator().manual_seed(0)
    for rows, vocab in ((1, 1), (3, 17), (64, 49152), (5, 100_003)):
        x = torch.randn(rows, vocab, generator=gen)
        assert torch.equal(argmax_rows(x), x.argmax(dim=-1))


def test_ties_nan_and_infinities_as_torch(at_level):
    x = torch.zeros(6, 40)
    x[0, [5, 9, 30]] = 2.0                                     # tie: the first
    x[1, [3, 20]] = float("nan")                               # NaN above all: the first NaN
    x[1, 2] = float("inf")
    x[2] = float("-inf")                                        # every value -inf: index 0
    x[3, [7, 39]] = float("inf")
    x[4, 39] = 1e-30                                            # the last element
    x[5] = -1.0
    x[5, 11] = -0.5
    assert argmax_rows(x).tolist() == [5, 3, 0, 7, 39, 11]
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))


def test_strided_and_other_inputs():
    gen = torch.Generator().manual_seed(1)
    wide = torch.randn(8, 300, generator=gen)
    x = wide[::2, 10:250]  # row stride 600, unit-stride rows: the native path
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))
    for other in (x.t(), x.double(), x.bfloat16(), torch.empty(3, 0)):  # torch's path
        if other.numel():
            assert torch.equal(argmax_rows(other), other.argmax(dim=-1))
    with pytest.raises(IndexError):  # an empty vocabulary: torch's error
        argmax_rows(torch.empty(3, 0))
