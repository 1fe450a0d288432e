"""Paged attention on the GPU, kvflow's Triton backend (and its variants) vs FlashInfer's (``--attention-backend
flashinfer``), per shape class, for benchmarks/gpu_check.sh: both backends' ``forward`` (KV
store + attention, as one layer calls it) against the same plain-torch reference
(``paged_attention_ref``, fp32) and timed with CUDA events (median of ``--iters`` calls after
warm-up). FlashInfer plans once per step on the host (``prepare`` + the first call of a head
configuration); that cost is reported separately, per step (all layers share one plan).

Shape classes (Llama-3.1-8B attention: 32 query heads, 8 KV heads, head_dim 128, bf16, blocks
of 16 tokens; context lengths those of GPU-W1/W2): ``decode_b1`` (one request, 640 tokens of
context), ``decode_b256`` (256 requests, 576), ``prefill_32x512`` (a GPU-W1 prefill step) and
``mixed`` (a 2,048-token chunk beside 64 decodes).

Triton variants too (all against the same reference): for decode shapes the single-pass kernel
(``triton_1pass``: one launch instead of split-KV partials + merge) and the plan a CUDA graph
captures (``triton_graph_plan``: splits chosen for max_model_len 2048, not the step's context),
which say whether fewer attention launches pay at short contexts. FlashInfer is skipped with a
line when it is not importable: the GPU machine has no internet, so its wheel and
dependencies must be carried (docs/benchmarks.md). Prints ``RESULT {"phase": "attention",
...}``. Needs CUDA.

    python benchmarks/gpu_attention.py --iters 50
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics

import torch

from kvflow.attention.backend import AttentionMetadata
from kvflow.kernels.attention_ref import paged_attention_ref

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16
DEVICE = "cuda"
DTYPE = torch.bfloat16
GRAPH_MAX_SEQ_LEN = 2048  # gpu_bench.py's max_model_len: what the decode graphs plan for
ERROR_BOUND = 0.05  # bf16 outputs of O(1) values against an fp32 reference
SHAPES = {  # name -> [(cached prefix, query tokens)] per request
    "decode_b1": [(639, 1)],
    "decode_b256": [(575, 1)] * 256,
    "prefill_32x512": [(0, 512)] * 32,
    "mixed": [(0, 2048)] + [(575, 1)] * 64,
}


def make_step(reqs: list[tuple[int, int]], seed: int = 0):
    """A step on the GPU: (meta, q, k, v, kv_cache); the new tokens' K/V are already at their
    slots (the store rewrites them), every slot outside a context is NaN."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    seq_lens = [c + q for c, q in reqs]
    pages = [-(-s // BLOCK) for s in seq_lens]
    perm = torch.randperm(sum(pages) + 1, device=DEVICE, generator=gen)
    kv_cache = torch.full((2, sum(pages) + 1, BLOCK, KV_HEADS, HEAD_DIM), float("nan"),
                          dtype=DTYPE, device=DEVICE)
    table = torch.full((len(reqs), max(pages)), int(perm[-1]), dtype=torch.int32, device=DEVICE)
    slots, start = [], 0
    for i, (seq_len, n) in enumerate(zip(seq_lens, pages)):
        blocks = perm[start:start + n]
        start += n
        table[i, :n] = blocks.int()
        pos = torch.arange(seq_len, device=DEVICE)
        flat = blocks[pos // BLOCK] * BLOCK + pos % BLOCK
        kv_cache.view(2, -1, KV_HEADS, HEAD_DIM)[:, flat] = torch.randn(
            2, seq_len, KV_HEADS, HEAD_DIM, device=DEVICE, generator=gen, dtype=DTYPE)
        slots.append(flat[reqs[i][0]:])
    slot_mapping = torch.cat(slots)
    k = kv_cache.view(2, -1, KV_HEADS, HEAD_DIM)[0, slot_mapping].clone()
    v = kv_cache.view(2, -1, KV_HEADS, HEAD_DIM)[1, slot_mapping].clone()
    q_lens = [q for _, q in reqs]
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32,
                       device=DEVICE)
    q = torch.randn(sum(q_lens), HEADS, HEAD_DIM, device=DEVICE, generator=gen,
                    dtype=DTYPE)
    meta = AttentionMetadata(slot_mapping=slot_mapping, query_start_loc=qsl,
                             seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
                             block_table=table, max_query_len=max(q_lens),
                             max_seq_len=max(seq_lens), num_actual_tokens=sum(q_lens))
    return meta, q, k, v, kv_cache


def time_us(fn, iters: int) -> float:
    """Median microseconds of one ``fn()`` call (CUDA events, after 5 warm-up calls)."""
    for _ in range(5):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(True), torch.cuda.Event(True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def measure(name: str, backend, meta, q, k, v, kv_cache, want, iters: int) -> dict:
    """One backend on one step: max |error| vs the reference, per-call time, plan time."""
    scale = HEAD_DIM ** -0.5
    torch.cuda.synchronize()
    t0 = torch.cuda.Event(True)
    t1 = torch.cuda.Event(True)
    t0.record()
    backend.prepare(meta, BLOCK)
    got = backend.forward(q, k, v, kv_cache, meta, scale)
    t1.record()
    t1.synchronize()
    error = float((got.float() - want.float()).abs().max())
    call_us = time_us(lambda: backend.forward(q, k, v, kv_cache, meta, scale), iters)
    finite = bool(got.isfinite().all())
    return {"backend": name, "max_abs_error": error, "finite": finite,
            "matches_reference": finite and error <= ERROR_BOUND,
            "us_per_layer_call": call_us,
            "first_call_with_prepare_us": t0.elapsed_time(t1) * 1e3}


class ForcedSplits:
    """The Triton backend's store + attention with the split-KV count forced (1 = the
    single-pass kernel, one launch; the automatic rule splits all-decode steps of >= 512
    tokens into partials plus a merge launch)."""

    def __init__(self, num_splits: int) -> None:
        self.num_splits = num_splits

    def prepare(self, meta: AttentionMetadata, block_size: int) -> None:
        """Nothing to prepare."""

    def forward(self, q, k, v, kv_cache, meta, scale, sliding_window=None):
        from kvflow.kernels.kv_store import store_kvcache
        from kvflow.kernels.paged_attention import paged_attention

        store_kvcache(k, v, kv_cache, meta.slot_mapping)
        return paged_attention(q, kv_cache, meta.query_start_loc, meta.seq_lens,
                               meta.block_table, meta.max_query_len, meta.max_seq_len, scale,
                               num_splits=self.num_splits)


def variants(meta: AttentionMetadata, device: torch.device, flashinfer_ok: bool) -> dict:
    """name -> (backend, meta) for one shape: ``triton`` (the automatic plan from the step's
    own longest context); for decode steps also ``triton_1pass`` (no split-KV) and
    ``triton_graph_plan`` (the plan a CUDA graph captures: longest context = max_model_len
    2048); ``flashinfer`` when importable."""
    from kvflow.attention.triton_paged import TritonPagedAttentionBackend

    out = {"triton": (TritonPagedAttentionBackend(False), meta)}
    if meta.is_all_decode:
        out["triton_1pass"] = (ForcedSplits(1), meta)
        out["triton_graph_plan"] = (TritonPagedAttentionBackend(False),
                                    dataclasses.replace(meta, max_seq_len=GRAPH_MAX_SEQ_LEN))
    if flashinfer_ok:
        from kvflow.attention.flashinfer_paged import FlashInferPagedAttentionBackend

        out["flashinfer"] = (FlashInferPagedAttentionBackend(device), meta)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--iters", type=int, default=50)
    args = parser.parse_args()
    try:
        import flashinfer
        version = flashinfer.__version__
    except ImportError as exc:
        print(f"flashinfer not importable ({exc}): Triton variants only", flush=True)
        version = None
    results = {}
    for shape, reqs in SHAPES.items():
        meta, q, k, v, kv_cache = make_step(reqs)
        want = paged_attention_ref(q, kv_cache, meta.query_start_loc, meta.seq_lens,
                                   meta.block_table, meta.max_query_len, meta.max_seq_len,
                                   HEAD_DIM ** -0.5)
        rows = {name: measure(name, backend, step_meta, q, k, v, kv_cache, want, args.iters)
                for name, (backend, step_meta) in
                variants(meta, q.device, version is not None).items()}
        for row in rows.values():
            row["time_over_triton"] = row["us_per_layer_call"] / \
                rows["triton"]["us_per_layer_call"]
        results[shape] = rows
        print(shape, json.dumps(rows), flush=True)
    print("RESULT " + json.dumps({"phase": "attention", "shapes": results,
                                  "flashinfer": version}), flush=True)


if __name__ == "__main__":
    main()
