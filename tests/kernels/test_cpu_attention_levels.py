"""The native paged attention (``kernels/csrc/cpu_attention*.{c,h}``) at every ISA level this
CPU runs (the ``kernels`` fixture), against the float64 oracle
(:func:`tests.kernels.paged_batch.attention_f64`), over the shapes where its paths split: head
sizes 64/80/96/112/128/256 (multiples of 16 take the vector decode and the register tiles, of
32 up to 128 the bf16 decode; 80 and 112 leave 16-column tails), GQA ratios 1/2/4/8 and MQA,
block sizes 16/32/64/128 and odd ones (7; 100: one super-block of keys not a multiple of the bf16
dot tiles' 8), contexts of 1, block_size - 1, block_size, block_size + 1 and several blocks,
sliding windows and soft caps, each through every path (prefill by bf16 dot-product tiles,
widening register tiles or row by row; batch-invariant decode of every token).

The bound is the kernel's arithmetic, not another library's error: a score is an fp32 sum of D
exact products (16-bit inputs widen exactly), off by <= delta = (D + 2) 2^-24 |q|_1 max|k| scale
(plus the soft cap's tanh, <= 8 2^-24 cap, and the exp polynomial's 2e-7); scores off by delta
move the softmax weights by a relative 2 delta, so the output (a weighted mean of values) by
<= 4 delta max|v|; the weight sum and each output sum over S keys add 2 (S + 2) 2^-24 max|v|,
the final rounding to the output dtype half a unit, u |out|. The bf16 dot-product tiles round
the weights to bf16 too (2^-9 each, so <= 2^-8 max|v|). Every term is then doubled.
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.paged_batch import attention_f64, make_batch

PATHS = {"dot": {"tiled": True, "bf16_dot": True}, "tiled": {"tiled": True, "bf16_dot": False},
         "rows": {"tiled": False}, "batch_invariant": {"batch_invariant": True}}
UNIT = {torch.float32: 2**-24, torch.bfloat16: 2**-8, torch.float16: 2**-11}


def attention_bound(batch: dict, ref: torch.Tensor, path: str, softcap: float) -> torch.Tensor:
    """The module docstring's bound on |out - ref|, float64 [tokens, heads, head_dim]."""
    n = ref.shape[0]
    q = batch["q"][:n].double()
    cache = batch["kv_cache"].double().nan_to_num(0.0)
    kmax, vmax = cache[0].abs().max(), cache[1].abs().max()
    d, keys = q.shape[-1], int(batch["seq_lens"].max())
    delta = (d + 2) * 2**-24 * q.abs().sum(-1, keepdim=True) * kmax * batch["scale"] \
        + 8 * 2**-24 * softcap + 2e-7
    bound = 4 * delta * vmax + 2 * (keys + 2) * 2**-24 * vmax \
        + UNIT[batch["q"].dtype] * ref.abs()
    if path == "dot" and batch["q"].dtype == torch.bfloat16:
        bound = bound + 2**-8 * vmax
    return 2 * bound


def check_every_path(kernels, batch: dict, window: int | None = None,
                     softcap: float = 0.0) -> None:
    """Each path's output within :func:`attention_bound` of the float64 oracle."""
    n = int(batch["query_start_loc"][-1])
    ref = attention_f64(batch, window, softcap)[:n]
    for path, flags in PATHS.items():
        out = kernels.paged_attention(batch["q"], batch["kv_cache"], batch["query_start_loc"],
                                      batch["seq_lens"], batch["block_table"], batch["scale"],
                                      window, softcap=softcap, **flags)
        err = (out[:n].double() - ref).abs()
        over = err > attention_bound(batch, ref, path, softcap)
        assert not bool(over.any()), (path, window, softcap, float(err[over].max()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim, num_heads, num_kv_heads", [
    (64, 8, 8), (80, 8, 4), (96, 8, 2), (112, 8, 1), (128, 16, 2), (256, 4, 1)])
def test_head_sizes_and_gqa_ratios(kernels, dtype, head_dim, num_heads, num_kv_heads):
    """GQA ratios 1, 2, 4, 8 (and MQA at 8 and 4 query heads) over 16-key blocks: decodes at
    contexts 1, 15, 16, 17 and 101, prompts of 15 and 17 tokens, a 33-token chunk after 20
    cached."""
    reqs = [(0, 1), (14, 1), (15, 1), (16, 1), (100, 1), (0, 15), (0, 17), (20, 33)]
    check_every_path(kernels, make_batch(reqs, num_heads, num_kv_heads, head_dim, dtype=dtype,
                                         seed=head_dim))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 32, 64, 128, 7, 100])
def test_block_sizes_windows_and_soft_caps(kernels, dtype, block_size):
    """Contexts of 1, block_size - 2 .. block_size + 1 and 3 blocks + 5, prompts of one key
    less and more than a block, a chunk after a block and 3; whole context, a window of
    block_size + 1, and a window of 5 with a soft cap of 30."""
    bs = block_size
    reqs = [(0, 1), (bs - 2, 1), (bs - 1, 1), (bs, 1), (3 * bs + 5, 1), (0, bs - 1),
            (0, bs + 1), (bs + 3, 20)]
    batch = make_batch(reqs, 6, 2, 64, block_size=bs, dtype=dtype, seed=bs)
    for window, softcap in ((None, 0.0), (bs + 1, 0.0), (5, 30.0)):
        check_every_path(kernels, batch, window, softcap)
