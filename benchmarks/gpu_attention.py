"""Paged attention on the GPU, kvflow's Triton backend vs FlashInfer's (``--attention-backend
flashinfer``), per shape class, for benchmarks/gpu_check.sh: both backends' ``forward`` (KV
store + attention, as one layer calls it) against the same plain-torch reference
(``paged_attention_ref``, fp32) and timed with CUDA events (median of ``--iters`` calls after
warm-up). FlashInfer plans once per step on the host (``prepare`` + the first call of a head
configuration); that cost is reported separately, per step (all layers share one plan).

Shape classes (Llama-3.1-8B attention: 32 query heads, 8 KV heads, head_dim 128, bf16, blocks
of 16 tokens; context lengths those of GPU-W1/W2): ``decode_b1`` (one request, 640 tokens of
context), ``decode_b256`` (256 requests, 576), ``prefill_32x512`` (a GPU-W1 prefill step) and
``mixed`` (a 2,048-token chunk beside 64 decodes).

Skipped with a line (exit 0) when flashinfer is not importable: the GPU machine has no
internet, so its wheel and dependencies must be carried (docs/benchmarks.md). Prints
``RESULT {"phase": "attention", ...}``. Needs CUDA.

    python benchmarks/gpu_attention.py --iters 50
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from kvflow.attention.backend import AttentionMetadata
from kvflow.kernels.attention_ref import paged_attention_ref

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16
DEVICE = "cuda"
DTYPE = torch.bfloat16
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--iters", type=int, default=50)
    args = parser.parse_args()
    try:
        import flashinfer
    except ImportError as exc:
        print(f"flashinfer not importable ({exc}): FlashInfer comparison skipped", flush=True)
        return
    from kvflow.attention.flashinfer_paged import FlashInferPagedAttentionBackend
    from kvflow.attention.triton_paged import TritonPagedAttentionBackend

    results = {}
    for shape, reqs in SHAPES.items():
        meta, q, k, v, kv_cache = make_step(reqs)
        want = paged_attention_ref(q, kv_cache, meta.query_start_loc, meta.seq_lens,
                                   meta.block_table, meta.max_query_len, meta.max_seq_len,
                                   HEAD_DIM ** -0.5)
        rows = [measure("triton", TritonPagedAttentionBackend(False), meta, q, k, v, kv_cache,
                        want, args.iters),
                measure("flashinfer", FlashInferPagedAttentionBackend(q.device), meta, q, k, v,
                        kv_cache, want, args.iters)]
        rows[1]["time_over_triton"] = rows[1]["us_per_layer_call"] / rows[0]["us_per_layer_call"]
        results[shape] = rows
        print(shape, json.dumps(rows), flush=True)
    print("RESULT " + json.dumps({"phase": "attention", "shapes": results,
                                  "flashinfer": flashinfer.__version__}), flush=True)


if __name__ == "__main__":
    main()
