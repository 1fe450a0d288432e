"""``--deterministic``'s CUDA kernels, checked in Triton's interpreter (CPU; no GPU here):

- :func:`~kvflow.kernels.batch_invariant_gemm.batch_invariant_linear`: a row's result is
  bitwise the same for M = 1 .. 130 rows (one and three row tiles, partial tiles), and within
  rounding of a float64 product; fp32 (bf16 only on a GPU: the interpreter's bf16 dots are
  wrong);
- the Triton paged attention with ``batch_invariant=True``: a request's tokens alone, beside
  decodes and other prefills (which change ``max_query_len`` and so, by default, the tiles),
  or split into chunks, all equal, and close to the plain-torch reference;
- the engine with the Triton attention backend and ``deterministic=True``: a prompt's greedy
  tokens and logprobs alone equal those inside a batch and with a smaller chunk budget (with
  ``KVFLOW_NATIVE_CPU=0`` the engine refuses to start: its CPU GEMMs are the native ones).

What the interpreter cannot show: that the GPU compiles each fixed configuration to one
instruction sequence per row (the premise of the design; see the kernels' docstrings). The
interpreter's ``tl.dot`` is numpy's ``matmul``, which does not sum every row alike: OpenBLAS's
AVX2 kernels (Zen 3) sum the rows at a tile's edges in another order than the rest, so a row
that moves inside its tile changes its last bits there, while an MMA tile on a GPU is one
instruction sequence for every row. These tests therefore run with a ``tl.dot`` that
multiplies each row on its own (:func:`_rows_alike_dot`): what they check is the kernels' own
code, that no loop bound, tile or split depends on the batch.
"""

from __future__ import annotations

import os
from itertools import pairwise

import pytest
import torch

pytest.importorskip("triton")

from kvflow.kernels.attention_ref import paged_attention_ref
from kvflow.kernels.batch_invariant_gemm import batch_invariant_linear
from kvflow.kernels.cpu_native import native_cpu_kernels
from kvflow.kernels.paged_attention import paged_attention
from tests.kernels.paged_batch import make_batch

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
BF16 = pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    INTERPRETED, reason=("Triton 3.6's interpreter computes bf16 tl.dot wrongly (|error| ~1e10 "
                         "on a 16x16 product of N(0,1) values); needs a GPU")))


@pytest.fixture(autouse=True)
def _rows_alike_dot(monkeypatch: pytest.MonkeyPatch) -> None:
    """In the interpreter, ``tl.dot`` of an [M, K] by [K, N] tile computed as M products of one
    row each (the same numpy call for every row, wherever it sits in the tile); see the
    module doc. Batched (3-D) dots are left as they are."""
    if not INTERPRETED:
        return
    import numpy as np
    from triton.runtime.interpreter import InterpreterBuilder, TensorHandle

    whole_tile = InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, *args):
        if a.data.ndim != 2:
            return whole_tile(self, a, b, d, *args)
        rows = [whole_tile(self, TensorHandle(a.data[i:i + 1], a.dtype), b,
                           TensorHandle(d.data[i:i + 1], d.dtype), *args).data
                for i in range(a.data.shape[0])]
        return TensorHandle(np.concatenate(rows), d.dtype)

    monkeypatch.setattr(InterpreterBuilder, "create_dot", create_dot)


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_triton_gemm_row_is_batch_invariant(dtype):
    gen = torch.Generator().manual_seed(0)
    n, k = 80, 100  # partial N tile and a partial last K step
    weight = torch.randn(n, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen)
    x = torch.randn(130, k, generator=gen).to(dtype)
    watched = 12  # rows computed alone (each call is slow in the interpreter)
    alone = torch.cat([batch_invariant_linear(x[i:i + 1], weight, bias) for i in range(watched)])
    exact = x[:watched].double() @ weight.double().T + bias.double()
    assert torch.allclose(alone.double(), exact, rtol=1e-5, atol=1e-4)
    for m in (5, 64, 130):
        rows = torch.randperm(130, generator=gen)[:m]
        rows[m // 2] = m % watched  # at least one watched row, at another position each time
        out = batch_invariant_linear(x[rows], weight, bias)
        seen = rows < watched
        assert torch.equal(out[seen], alone[rows[seen]]), m


def _attend(batch, q, qsl, seq_lens, block_table, **kw):
    return paged_attention(q, batch["kv_cache"], qsl, seq_lens, block_table,
                           int((qsl[1:] - qsl[:-1]).max()), int(seq_lens.max()),
                           batch["scale"], **kw)


def _chunk(batch, r: int, lo: int, hi: int, **kw):
    """Query tokens [lo, hi) of request r alone, its context ending at token hi."""
    qsl, seq_lens = batch["query_start_loc"], batch["seq_lens"]
    q0, qlen = int(qsl[r]), int(qsl[r + 1] - qsl[r])
    return _attend(batch, batch["q"][q0 + lo:q0 + hi],
                   torch.tensor([0, hi - lo], dtype=torch.int32),
                   torch.tensor([int(seq_lens[r]) - qlen + hi], dtype=torch.int32),
                   batch["block_table"][r:r + 1], **kw)


@pytest.mark.parametrize("window", [None, 8])
def test_triton_attention_token_is_batch_and_chunk_invariant(window):
    reqs = [(0, 1), (40, 1), (20, 23), (0, 30), (9, 4)]  # request 2 is the one watched
    batch = make_batch(reqs, num_heads=4, num_kv_heads=2, head_dim=32, seed=3)
    n = int(batch["query_start_loc"][-1])
    full = _attend(batch, batch["q"][:n], batch["query_start_loc"], batch["seq_lens"],
                   batch["block_table"], sliding_window=window, batch_invariant=True)
    q0 = int(batch["query_start_loc"][2])
    watched = full[q0:q0 + 23]
    ref = paged_attention_ref(**batch, sliding_window=window)[q0:q0 + 23]
    assert torch.allclose(watched, ref, atol=1e-4, rtol=1e-4)
    for cuts in ([], [1], [7, 16], [22]):
        bounds = [0, *cuts, 23]
        parts = [_chunk(batch, 2, lo, hi, sliding_window=window, batch_invariant=True)
                 for lo, hi in pairwise(bounds)]
        assert torch.equal(torch.cat(parts), watched), cuts


def test_batch_invariant_plan_is_one_launch_configuration():
    """The launch a batch gets: without ``batch_invariant`` the row tile follows
    ``max_query_len`` and decode batches may split the keys; with it, one configuration (what
    the interpreted test above cannot see, its rows being multiplied alike)."""
    from kvflow.kernels.paged_attention_plan import plan_paged_attention

    batches = [(1, 1, 1), (23, 1, 23), (59, 5, 30), (4, 4, 1)]  # tokens, requests, max q len

    def configs(**kw):
        return {plan_paged_attention(t, 4, 2, 32, r, q, 4096, 132, **kw)[2:8]
                for t, r, q in batches}

    assert len(configs()) > 1
    assert len(configs(batch_invariant=True)) == 1


def test_triton_engine_deterministic(tiny_llama_path):
    from kvflow import LLM, SamplingParams

    target = [(7 * j) % 250 + 3 for j in range(19)]
    others = [[(5 * i + 11 * j) % 250 + 1 for j in range(n)] for i, n in enumerate((3, 9, 26))]
    params = SamplingParams(temperature=0, max_tokens=3, logprobs=2, ignore_eos=True)

    def run(llm, batch):
        prompts = [{"prompt_token_ids": p} for p in batch]
        prompts.insert(1, {"prompt_token_ids": target})
        out = llm.generate(prompts, params, use_tqdm=False)[1].outputs[0]
        return out.token_ids, [sorted((t, lp.logprob) for t, lp in d.items())
                               for d in out.logprobs]

    # an 8-token budget: the prompt's chunks start elsewhere when others share the steps
    options = {"model": tiny_llama_path, "dtype": "float32", "deterministic": True,
               "device": "cpu", "attention_backend": "triton", "num_kv_blocks": 64,
               "max_num_batched_tokens": 8, "enable_prefix_caching": False,
               "skip_tokenizer_init": True}
    if native_cpu_kernels() is None:  # KVFLOW_NATIVE_CPU=0: the CPU GEMMs have no such mode
        with pytest.raises(ValueError, match="native CPU kernels off"):
            LLM(**options)
        return
    llm = LLM(**options)
    assert run(llm, others) == run(llm, others[:1])
