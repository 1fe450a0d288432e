"""The torch GGML dequantizers against ``gguf.quants.dequantize`` (the gguf package's numpy
implementation) on random blocks of every kept type."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvflow.kernels.gguf_dequant import BLOCK_SHAPES, dequantize_rows

gguf_quants = pytest.importorskip("gguf.quants")
from gguf.constants import GGMLQuantizationType

# byte offsets of each type's fp16 fields (random bytes there could be inf/NaN)
F16_FIELDS = {2: (0,), 3: (0, 2), 6: (0,), 8: (0,), 12: (0, 2), 13: (0, 2), 14: (208,)}


def random_blocks(ggml_type: int, rows: int, blocks: int, seed: int) -> np.ndarray:
    _, nbytes = BLOCK_SHAPES[ggml_type]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, blocks, nbytes), dtype=np.uint8)
    for off in F16_FIELDS[ggml_type]:
        raw[..., off:off + 2] = rng.uniform(-0.05, 0.05, (rows, blocks, 1)) \
            .astype(np.float16).view(np.uint8)
    return raw.reshape(rows, blocks * nbytes)


@pytest.mark.parametrize("ggml_type", sorted(F16_FIELDS))
def test_dequantize_matches_gguf(ggml_type):
    raw = random_blocks(ggml_type, rows=3, blocks=2, seed=ggml_type)
    ref = gguf_quants.dequantize(raw, GGMLQuantizationType(ggml_type)).astype(np.float32)
    got = dequantize_rows(torch.from_numpy(raw), ggml_type)
    assert got.shape == ref.shape
    torch.testing.assert_close(got, torch.from_numpy(ref), rtol=1e-6, atol=1e-7)


def test_unsupported_type_and_bad_row():
    with pytest.raises(ValueError, match="GGML type"):
        dequantize_rows(torch.zeros(1, 10, dtype=torch.uint8), 10)  # Q2_K
    with pytest.raises(ValueError, match="whole"):
        dequantize_rows(torch.zeros(1, 35, dtype=torch.uint8), 8)
