"""Soft-capped attention scores (Gemma 2's ``attn_logit_softcapping``) in the Triton paged
attention kernel (kernels/paged_attention_kernels.py, ``softcap``) vs the plain-torch
per-request reference with the same cap; and Gemma 2 on the triton backend inside the engine
vs transformers. On CPU in Triton's interpreter (tests/kernels/conftest.py), fp32.

Scores are made large (``scale`` 1, unit-normal q and K of head_dim 64: |q.k| ~ 8) and the cap
small (2), so the cap moves the result by O(1) (asserted). Tolerance as
tests/kernels/test_paged_attention.py on CPU: 1e-4.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kvflow.kernels.kv_quant import dequantize_kv, quantize_kv
from kvflow.kernels.paged_attention import paged_attention, paged_attention_ref
from tests.kernels.paged_batch import make_batch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {"atol": 1e-4, "rtol": 1e-4}
MIXED = [(0, 5), (33, 1), (10, 20), (0, 1), (47, 17), (15, 1)]
CAP = 2.0


def _check(batch, ref_batch=None, window=None, **kwargs):
    ref_batch = ref_batch or batch
    n = int(batch["query_start_loc"][-1])
    ref = paged_attention_ref(**ref_batch, sliding_window=window, softcap=CAP)
    plain = paged_attention_ref(**ref_batch, sliding_window=window)
    assert (ref[:n] - plain[:n]).abs().max() > 0.1  # the cap matters for these scores
    out = paged_attention(**batch, sliding_window=window, softcap=CAP, **kwargs)
    torch.testing.assert_close(out[:n].float(), ref[:n].float(), **TOL)


def _batch(num_heads=6, num_kv_heads=2, head_dim=64):
    batch = make_batch(MIXED, num_heads, num_kv_heads, head_dim, device=DEVICE)
    batch["scale"] = 1.0
    return batch


@pytest.mark.parametrize("kwargs", [{"num_splits": 1}, {"num_splits": 3},
                                    {"batch_invariant": True}],
                         ids=["single_pass", "split_kv", "batch_invariant"])
@pytest.mark.parametrize("window", [None, 7])
def test_triton_kernel_soft_caps_like_the_reference(kwargs, window):
    _check(_batch(), window=window, **kwargs)


def test_head_dim_not_a_power_of_two():
    _check(_batch(num_heads=4, num_kv_heads=4, head_dim=48), num_splits=1)


def test_quantized_cache():
    batch = _batch()
    q_cache, scales = quantize_kv(batch["kv_cache"], torch.int8)
    ref_batch = dict(batch, kv_cache=dequantize_kv(q_cache, scales, torch.float32))
    _check(dict(batch, kv_cache=q_cache), ref_batch, kv_scales=scales, num_splits=1)


@pytest.mark.parametrize("bad", [-2.0, float("nan")])
def test_bad_softcap_raises(bad):
    with pytest.raises(ValueError, match="softcap must be a finite number >= 0"):
        paged_attention(**_batch(), softcap=bad)


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused_rotary"])
def test_gemma2_on_triton_matches_transformers(tiny_model_factory, monkeypatch, fused):
    """Greedy tokens and their logprobs of the capped tiny Gemma 2 on the triton backend
    (chunked prefill with a 16-token budget, then decodes; with and without the fused
    rotary + KV-store kernel) equal transformers' ``generate``."""
    from kvflow import LLM, SamplingParams
    from tests.models.test_parity import assert_matches_hf

    monkeypatch.setenv("KVFLOW_FUSED_KERNELS", "1" if fused else "0")
    tiny = tiny_model_factory("gemma2")
    llm = LLM(model=tiny.path, dtype="float32", device=DEVICE, num_kv_blocks=64, block_size=4,
              max_num_batched_tokens=16, max_num_seqs=4, attention_backend="triton")
    backend = llm.engine.core.executor.runner.attn_ctx.backend
    assert backend.name == "triton" and backend.fuse_rotary == fused
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(2, tiny.vocab_size, (n,), generator=gen).tolist() for n in (7, 23)]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=1)
    for out in llm.generate(prompts, params, use_tqdm=False):
        assert_matches_hf(tiny, out, max_new_tokens=4)
