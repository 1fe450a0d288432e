"""How a :func:`kvflow.kernels.paged_attention.paged_attention` call is launched: tile sizes,
the split-KV ("flash-decoding") choice and the grid, as pure arithmetic on the shapes."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton

# Split-KV heuristics (see choose_num_splits).
SPLIT_MIN_SEQ_LEN = 512  # below this context length a single pass is already short
SPLIT_MIN_TOKENS = 256  # each split should cover at least this many keys
MAX_SPLITS = 16
DEFAULT_NUM_SMS = 132  # used off-GPU (interpreter); H100/H200 value


def num_sms_of(device: torch.device) -> int:
    """The device's streaming multiprocessor count (``DEFAULT_NUM_SMS`` off-GPU)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return DEFAULT_NUM_SMS


def choose_num_splits(
    max_query_len: int, max_seq_len: int, num_reqs: int, num_kv_heads: int, num_sms: int
) -> int:
    """Pick the number of KV splits (1 = single-pass kernel).

    Rule: split only when the batch is all-decode (``max_query_len == 1``), the longest
    context is at least ``SPLIT_MIN_SEQ_LEN`` keys, and the single-pass grid
    (``num_reqs * num_kv_heads`` programs) would leave SMs idle (fewer programs than SMs).
    Then use enough splits for about two programs per SM, capped at ``MAX_SPLITS`` and at
    one split per ``SPLIT_MIN_TOKENS`` keys of the longest context.
    """
    work = num_reqs * num_kv_heads
    if max_query_len != 1 or max_seq_len < SPLIT_MIN_SEQ_LEN or work == 0 or work >= num_sms:
        return 1
    splits = min(
        MAX_SPLITS, math.ceil(2 * num_sms / work), math.ceil(max_seq_len / SPLIT_MIN_TOKENS)
    )
    return max(splits, 1)


def launch_config(max_query_len: int, qpkv: int, block_d: int,
                  elem_bytes: int = 2) -> tuple[int, int, int, int]:
    """(BLOCK_M, TILE_N, num_warps, num_stages) for the single/split-pass kernel.

    ``elem_bytes``: bytes per element of the compute dtype (``q``'s). With 4-byte (fp32)
    operands the key tiles hold half as many keys, and prefill row tiles over head dims above
    128 have 32 rows, so that a program's shared memory (Q tile, two pipeline stages of K and
    V tiles) fits the 99 KiB a block may use on sm_86 / sm_89 GPUs (A10, L4, L40S, RTX 30xx
    and 40xx). Triton 3.6's build for sm_89 of the 16-bit tiles in fp32 needs 112 KiB at head
    dim 128 and 136 KiB at 256, which such GPUs refuse at launch (``OutOfResources``); the
    fp32 tiles need 72 KiB and 66 KiB (tests/kernels/test_paged_attention_gpu_build.py).
    """
    if max_query_len * qpkv <= 16:  # decode-only or tiny chunks
        block_m = max(16, triton.next_power_of_2(qpkv))
    elif elem_bytes > 2 and block_d > 128:
        block_m = max(32, triton.next_power_of_2(qpkv))
    else:
        block_m = max(64, triton.next_power_of_2(qpkv))
    tile_n = 64 if block_d <= 128 else 32
    if elem_bytes > 2:
        tile_n //= 2
    num_warps = 4 if block_m <= 64 else 8
    return block_m, tile_n, num_warps, 2


class PagedAttentionPlan(NamedTuple):
    """How one :func:`paged_attention` call is launched (:func:`plan_paged_attention`)."""

    qpkv: int  # query heads per KV head (GQA group size)
    block_d: int  # head_dim padded to a power of two, at least 16
    block_m: int  # rows per program: BLOCK_Q query tokens x QPKV heads, padded
    block_q: int  # query tokens per program
    tile_n: int  # keys per inner-loop tile
    num_warps: int
    num_stages: int
    num_splits: int  # 1 = single pass; > 1 = split-KV partials plus the merge kernel
    grid: tuple[int, int, int]  # (q-blocks, KV heads, splits)


def plan_paged_attention(
    num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int, num_reqs: int,
    max_query_len: int, max_seq_len: int, num_sms: int, num_splits: int | None = None,
    batch_invariant: bool = False, elem_bytes: int = 2,
) -> PagedAttentionPlan:
    """Choose tile sizes, the split-KV path and the grid; pure arithmetic on the shapes.

    Tiles follow :func:`launch_config` (``max_query_len`` picks decode-sized or prefill-sized
    row tiles, ``elem_bytes`` the compute dtype's element size, 4 for fp32, smaller tiles). ``num_splits`` None applies :func:`choose_num_splits` with ``num_sms``;
    otherwise it is used as given. The grid has one program per q-block, KV head and split:
    ``num_tokens // BLOCK_Q + num_reqs`` q-blocks cover every request's blocks, partial last
    ones included, and surplus programs exit at once. So the grid depends only on token and
    request counts, never on lengths.

    ``batch_invariant`` (``--deterministic``): one launch configuration whatever the batch
    (decode-sized row tiles, one pass, ``num_splits`` ignored), so a query row always meets
    the same instructions over the same key tiles (aligned to absolute key positions; the
    extra fully masked tiles a longer q-block adds contribute exact zeros): its result then
    does not depend on the other requests or on where its chunk starts.
    """
    qpkv = num_heads // num_kv_heads
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_m, tile_n, num_warps, num_stages = launch_config(
        1 if batch_invariant else max_query_len, qpkv, block_d, elem_bytes)
    block_q = block_m // qpkv
    if batch_invariant:
        num_splits = 1
    if num_splits is None:
        num_splits = choose_num_splits(max_query_len, max_seq_len, num_reqs, num_kv_heads,
                                       num_sms)
    grid = (num_tokens // block_q + num_reqs, num_kv_heads, num_splits)
    return PagedAttentionPlan(qpkv, block_d, block_m, block_q, tile_n, num_warps, num_stages,
                              num_splits, grid)
