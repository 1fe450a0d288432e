"""Batch invariance of the kernels ``--deterministic`` uses on CPU: a row's (a query token's)
result must be bitwise the same whatever else the call holds.

- kvflow's C GEMM: row i of ``x @ W.T`` for M = 1 .. 200 rows (M around the 6-row micro-kernel,
  the 96-row block, one and several K chunks of 256), fp32 and bf16 weights, vs the same row
  alone; each also within rounding of a float64 product (the oracle).
- The native paged attention with ``batch_invariant=True``: a request's tokens alone, beside
  other requests, split into chunks at several boundaries, or one token per call, all equal;
  and within tolerance of the plain-torch reference. The default (tiled) path is shown to
  differ for the same splits, so the comparison can fail.
"""

from __future__ import annotations

from itertools import pairwise

import pytest
import torch

from kvflow.kernels.attention_ref import paged_attention_ref
from kvflow.kernels.cpu_native import native_cpu_kernels
from kvflow.kernels.gemm import NativePackedWeight
from tests.kernels.paged_batch import make_batch

KERNELS = native_cpu_kernels()
pytestmark = pytest.mark.skipif(KERNELS is None, reason="native CPU kernels could not be built")

ROW_COUNTS = (1, 5, 6, 7, 64, 97, 200)


@pytest.fixture(autouse=True)
def _restore_threads():
    """The tests vary torch's thread count (results must not depend on it); restore it."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_gemm_row_is_batch_invariant(dtype):
    gen = torch.Generator().manual_seed(0)
    n, k = 100, 600  # an edge panel (100 % 32 != 0) and three K chunks of 256
    weight = torch.randn(n, k, generator=gen).to(dtype)
    x = torch.randn(max(ROW_COUNTS), k, generator=gen).to(dtype)
    packed = NativePackedWeight(weight, KERNELS)
    alone = torch.cat([packed(x[i:i + 1], None) for i in range(max(ROW_COUNTS))])
    exact = x.double() @ weight.double().T
    assert torch.allclose(alone.double(), exact, rtol=1e-5, atol=1e-4)
    for i, m in enumerate(ROW_COUNTS):
        torch.set_num_threads(1 + i % 2)  # and whatever the thread count
        rows = torch.randperm(max(ROW_COUNTS), generator=gen)[:m]
        out = packed(x[rows], None)
        assert torch.equal(out, alone[rows]), f"a row changed at M={m}"


def _request_view(batch, r: int, token_lo: int, token_hi: int):
    """Query tokens [token_lo, token_hi) of request r of ``batch`` as a one-request call whose
    context ends at the last of them."""
    qsl, seq_lens = batch["query_start_loc"], batch["seq_lens"]
    q0, qlen = int(qsl[r]), int(qsl[r + 1] - qsl[r])
    seq_len = int(seq_lens[r]) - qlen + token_hi
    return (batch["q"][q0 + token_lo:q0 + token_hi],
            torch.tensor([0, token_hi - token_lo], dtype=torch.int32),
            torch.tensor([seq_len], dtype=torch.int32), batch["block_table"][r:r + 1])


def _attend(batch, q, qsl, seq_lens, block_table, batch_invariant: bool, window=None):
    torch.set_num_threads(1 + q.shape[0] % 2)  # one or two threads, by the call's size
    return KERNELS.paged_attention(q, batch["kv_cache"], qsl, seq_lens, block_table,
                                   batch["scale"], window, batch_invariant=batch_invariant)


def _split(batch, r: int, qlen: int, cuts: list[int], batch_invariant: bool, window=None):
    """Request r's query tokens computed in chunks ending at ``cuts`` (then concatenated)."""
    bounds = [0, *cuts, qlen]
    return torch.cat([_attend(batch, *_request_view(batch, r, lo, hi), batch_invariant, window)
                      for lo, hi in pairwise(bounds) if hi > lo])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 8])
def test_attention_token_is_batch_and_chunk_invariant(dtype, window):
    # request 2 is the one watched: 20 cached tokens, then 37 new ones
    reqs = [(0, 1), (17, 1), (20, 37), (0, 40), (63, 5), (3, 16)]
    batch = make_batch(reqs, num_heads=4, num_kv_heads=2, head_dim=32, dtype=dtype, seed=1)
    r, qlen = 2, 37
    full = _attend(batch, batch["q"][:int(batch["query_start_loc"][-1])],
                   batch["query_start_loc"], batch["seq_lens"], batch["block_table"], True,
                   window)
    q0 = int(batch["query_start_loc"][r])
    in_batch = full[q0:q0 + qlen]
    ref = paged_attention_ref(**batch, sliding_window=window)[q0:q0 + qlen]
    tol = 1e-5 if dtype == torch.float32 else 2**-7
    assert torch.allclose(in_batch.float(), ref.float(), atol=tol, rtol=tol)
    alone = _split(batch, r, qlen, [], True, window)
    assert torch.equal(alone, in_batch)
    for cuts in ([1], [16], [5, 21], [36], list(range(1, qlen))):
        assert torch.equal(_split(batch, r, qlen, cuts, True, window), in_batch), cuts


def test_default_attention_depends_on_chunking():
    """Without batch invariance the same tokens come out differently when chunked otherwise
    (prefill tiles vs the decode path): what the invariant test above would catch."""
    batch = make_batch([(20, 37)], num_heads=4, num_kv_heads=2, head_dim=32, seed=1)
    whole = _split(batch, 0, 37, [], False)
    per_token = _split(batch, 0, 37, list(range(1, 37)), False)
    assert torch.allclose(whole, per_token, atol=1e-5, rtol=1e-5)
    assert not torch.equal(whole, per_token)
