"""The part of the FlashInfer backend that is kvflow's, on CPU: converting block_table /
seq_lens into FlashInfer's CSR page table (kv_indptr, kv_indices, kv_last_page_len; NHD pages)
against a hand-computed example, and attention over the pages that table names (FlashInfer's
documented semantics in plain torch) against kvflow's paged-attention reference; the backend's
glue (store, one plan per step and head configuration, decode vs prefill wrapper, window,
padding rows) with a stand-in ``flashinfer`` module; and the refusals (CPU, package missing,
quantized KV). FlashInfer's kernels themselves run only on a GPU (benchmarks/gpu_check.sh)."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from kvflow.attention.backend import AttentionMetadata
from kvflow.attention.flashinfer_paged import FlashInferPagedAttentionBackend, paged_kv_layout
from kvflow.kernels.attention_ref import paged_attention_ref
from tests.kernels.paged_batch import make_batch


def test_layout_hand_computed():
    block_table = torch.tensor([[7, 3, 9, 0], [2, 0, 0, 0], [4, 6, 0, 0], [1, 5, 8, 0]],
                               dtype=torch.int32)
    seq_lens = torch.tensor([5, 1, 8, 12], dtype=torch.int32)
    layout = paged_kv_layout(block_table, seq_lens, block_size=4)
    assert layout.kv_indptr.tolist() == [0, 2, 3, 5, 8]  # pages 2, 1, 2, 3
    assert layout.kv_indices.tolist() == [7, 3, 2, 4, 6, 1, 5, 8]
    assert layout.kv_last_page_len.tolist() == [1, 1, 4, 4]
    assert all(t.dtype == torch.int32 for t in layout)


def test_layout_bad_seq_lens():
    block_table = torch.zeros(2, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="seq_lens"):
        paged_kv_layout(block_table, torch.tensor([0, 3], dtype=torch.int32), 4)
    with pytest.raises(ValueError, match="seq_lens"):
        paged_kv_layout(block_table, torch.tensor([9, 3], dtype=torch.int32), 4)


def flashinfer_semantics(q, k_pages, v_pages, qo_indptr, kv_indptr, kv_indices,
                         kv_last_page_len, sm_scale, window_left=-1, causal=True):
    """FlashInfer's batch paged attention (NHD, its docs' page-table tutorial), plain torch:
    request i's keys are its pages concatenated, the last one cut to kv_last_page_len[i]; its
    queries are the last rows of its context (causal mask aligned to the bottom right); a key
    is visible when ``q_pos - window_left <= k_pos <= q_pos`` (window_left -1 = no limit)."""
    out = torch.zeros(q.shape, dtype=torch.float32)
    page_size = k_pages.shape[1]
    for i in range(len(kv_indptr) - 1):
        pages = kv_indices[kv_indptr[i]:kv_indptr[i + 1]].long()
        kv_len = (len(pages) - 1) * page_size + int(kv_last_page_len[i])
        k = k_pages[pages].flatten(0, 1)[:kv_len].float()  # [kv_len, Hkv, D]
        v = v_pages[pages].flatten(0, 1)[:kv_len].float()
        qi = q[qo_indptr[i]:qo_indptr[i + 1]].float()
        group = qi.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", qi, k) * sm_scale
        q_pos = torch.arange(kv_len - qi.shape[0], kv_len)[:, None]
        k_pos = torch.arange(kv_len)[None, :]
        visible = k_pos <= q_pos if causal else torch.ones_like(k_pos <= q_pos)
        if window_left >= 0:
            visible &= k_pos >= q_pos - window_left
        probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), -1)
        out[qo_indptr[i]:qo_indptr[i + 1]] = torch.einsum("hqk,khd->qhd", probs, v)
    return out.to(q.dtype)


REQS = [(37, 5), (0, 9), (70, 1), (16, 16), (3, 1)]  # (cached prefix, query tokens)


@pytest.mark.parametrize("window", [None, 20])
def test_attention_over_layout_matches_reference(window):
    b = make_batch(REQS, num_heads=4, num_kv_heads=2, head_dim=32, block_size=16, seed=4)
    layout = paged_kv_layout(b["block_table"], b["seq_lens"], 16)
    got = flashinfer_semantics(b["q"], b["kv_cache"][0], b["kv_cache"][1],
                               b["query_start_loc"].tolist(), layout.kv_indptr.tolist(),
                               layout.kv_indices, layout.kv_last_page_len.tolist(), b["scale"],
                               window_left=window - 1 if window else -1)
    want = paged_attention_ref(b["q"], b["kv_cache"], b["query_start_loc"], b["seq_lens"],
                               b["block_table"], b["max_query_len"], b["max_seq_len"],
                               b["scale"], sliding_window=window)
    assert not got.isnan().any()  # no NaN-poisoned slot outside a context was read
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


class _FakeWrapper:
    """Stands in for FlashInfer's Batch{Decode,Prefill}WithPagedKVCacheWrapper: records plan()
    and computes run() with :func:`flashinfer_semantics` from the planned table."""

    def __init__(self, kind, log, workspace, layout, use_tensor_cores=False):
        assert layout == "NHD" and workspace.dtype == torch.uint8
        self.kind, self.log, self.use_tensor_cores = kind, log, use_tensor_cores

    def plan(self, *args, **kwargs):
        if self.kind == "decode":
            args = (None, *args)  # decode: one query per request, qo_indptr implied
        (self.qo_indptr, self.kv_indptr, self.kv_indices, self.last_page_len, heads,
         kv_heads, head_dim, page_size) = args
        self.kwargs = kwargs
        self.log.append((self.kind, heads, kv_heads, head_dim, page_size, kwargs))

    def run(self, q, kv):
        k_pages, v_pages = kv
        qo = list(range(q.shape[0] + 1)) if self.qo_indptr is None else \
            self.qo_indptr.tolist()
        return flashinfer_semantics(q, k_pages, v_pages, qo, self.kv_indptr.tolist(),
                                    self.kv_indices, self.last_page_len.tolist(),
                                    self.kwargs["sm_scale"], self.kwargs["window_left"],
                                    causal=self.kind == "decode" or self.kwargs["causal"])


@pytest.fixture()
def fake_flashinfer(monkeypatch):
    log: list = []
    module = types.SimpleNamespace(
        BatchDecodeWithPagedKVCacheWrapper=lambda *a, **k: _FakeWrapper("decode", log, *a, **k),
        BatchPrefillWithPagedKVCacheWrapper=lambda *a, **k: _FakeWrapper("prefill", log, *a,
                                                                          **k))
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    monkeypatch.setattr("kvflow.attention.flashinfer_paged.WORKSPACE_BYTES", 1024)
    return log


def _step(reqs, seed, window=None, extra_tokens=0):
    """A batch whose new K/V are not yet in the cache: (meta, q, k, v, cache, reference)."""
    pytest.importorskip("triton")  # the backend stores new K/V with the Triton store kernel
    b = make_batch(reqs, num_heads=8, num_kv_heads=2, head_dim=32, block_size=16, seed=seed,
                   extra_tokens=extra_tokens)
    want = paged_attention_ref(b["q"], b["kv_cache"], b["query_start_loc"], b["seq_lens"],
                               b["block_table"], b["max_query_len"], b["max_seq_len"],
                               b["scale"], sliding_window=window)
    cache = b["kv_cache"].clone()
    slots, ks, vs = [], [], []
    for i, (cached, q_len) in enumerate(reqs):  # take the new tokens' K/V out of the cache
        for pos in range(cached, cached + q_len):
            block, offset = int(b["block_table"][i, pos // 16]), pos % 16
            slots.append(block * 16 + offset)
            ks.append(cache[0, block, offset].clone())
            vs.append(cache[1, block, offset].clone())
            cache[:, block, offset] = float("nan")
    pad = [torch.zeros_like(ks[0])] * extra_tokens
    k, v = torch.stack(ks + pad), torch.stack(vs + pad)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots + [-1] * extra_tokens), query_start_loc=b["query_start_loc"],
        seq_lens=b["seq_lens"], block_table=b["block_table"], max_query_len=b["max_query_len"],
        max_seq_len=b["max_seq_len"], num_actual_tokens=len(slots))
    return meta, b["q"], k, v, cache, want, b["scale"]


@pytest.mark.parametrize("reqs,window,kind", [
    (REQS, None, "prefill"), (REQS, 24, "prefill"), ([(37, 1), (0, 1), (70, 1)], None, "decode"),
])
def test_backend_glue_with_stand_in_flashinfer(fake_flashinfer, reqs, window, kind):
    meta, q, k, v, cache, want, scale = _step(reqs, seed=len(reqs), window=window,
                                             extra_tokens=2)
    backend = FlashInferPagedAttentionBackend(torch.device("cuda"))
    backend.prepare(meta, 16)
    for _ in range(2):  # two layers of one step: one plan
        got = backend.forward(q, k, v, cache, meta, scale, window)
        torch.testing.assert_close(got[:meta.num_actual_tokens], want[:meta.num_actual_tokens],
                                   atol=1e-5, rtol=1e-5)
        assert got.shape == q.shape
    n = meta.num_actual_tokens  # the new K/V were stored at their slots
    stored = cache.flatten(1, 2)[:, meta.slot_mapping[:n]]
    assert torch.equal(stored[0], k[:n]) and torch.equal(stored[1], v[:n])
    assert len(fake_flashinfer) == 1 and fake_flashinfer[0][0] == kind
    _, heads, kv_heads, head_dim, page_size, kwargs = fake_flashinfer[0]
    assert (heads, kv_heads, head_dim, page_size) == (8, 2, 32, 16)
    assert kwargs["window_left"] == (window - 1 if window else -1)
    assert kwargs["sm_scale"] == scale and kwargs["q_data_type"] == torch.float32
    backend.prepare(meta, 16)  # the next step plans again
    backend.forward(q, k, v, cache, meta, scale, window)
    assert len(fake_flashinfer) == 2


def test_refusals(monkeypatch, fake_flashinfer):
    with pytest.raises(ValueError, match="CUDA"):
        FlashInferPagedAttentionBackend(torch.device("cpu"))
    backend = FlashInferPagedAttentionBackend(torch.device("cuda"))
    meta, q, k, v, cache, _, scale = _step([(3, 1)], seed=1)
    backend.prepare(meta, 16)
    with pytest.raises(ValueError, match="quantized"):
        backend.forward(q, k, v, cache, meta, scale, kv_scales=torch.zeros(cache.shape[:4]))
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # not installed
    with pytest.raises(ValueError, match="flashinfer-python"):
        FlashInferPagedAttentionBackend(torch.device("cuda"))


def test_engine_refuses_flashinfer_on_cpu(tiny_llama_path):
    from kvflow import LLM

    with pytest.raises(ValueError, match="CUDA devices only"):
        LLM(model=tiny_llama_path, dtype="float32", skip_tokenizer_init=True, num_kv_blocks=16,
            attention_backend="flashinfer", device="cpu")


def test_engine_with_stand_in_flashinfer_matches_torch_backend(tiny_llama_path, fake_flashinfer,
                                                               monkeypatch):
    """The whole engine on the FlashInfer backend (stand-in kernels): one page table and plan
    per step, chunked prefill, prefix-cache hits, decodes; greedy tokens equal the torch
    backend's."""
    pytest.importorskip("triton")
    from kvflow.worker import model_setup
    from tests.kernels.test_engine_triton_cpu import _greedy, _llm

    reference = _greedy(_llm(tiny_llama_path, "torch"))
    make = model_setup.make_attention_backend
    monkeypatch.setattr(model_setup, "make_attention_backend", lambda name, *a, **k: (
        FlashInferPagedAttentionBackend(torch.device("cuda")) if name == "flashinfer"
        else make(name, *a, **k)))  # past the CUDA check: the stand-in runs on CPU tensors
    assert _greedy(_llm(tiny_llama_path, "flashinfer")) == reference
    kinds = {entry[0] for entry in fake_flashinfer}
    assert kinds == {"decode", "prefill"}
