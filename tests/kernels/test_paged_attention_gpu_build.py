"""The paged-attention kernel as an NVIDIA GPU builds it, checked without a GPU
(tests/kernels/ptx_compile.py compiles it on the host): the shared memory each launch plan
asks for fits the smallest per-block budget of the GPUs kvflow runs on, 99 KiB (101,376 bytes:
sm_86 / sm_89, A10, L4, L40S, RTX 30xx/40xx; A100 allows 163 KiB, H100/H200 227 KiB). A plan
over budget fails there at launch with Triton's ``OutOfResources``, which the interpreter never
shows. fp32 (a float32 checkpoint under ``--dtype auto``, or ``--dtype float32``) doubles
every tile's bytes: 64-key tiles at head dim 128 needed 112 KiB."""

from __future__ import annotations

import pytest

from kvflow.kernels.paged_attention_plan import plan_paged_attention
from tests.kernels.ptx_compile import GpuKernelSpec, compile_for_gpu

SM89_MAX_SHARED = 101_376
_POINTERS = ["q_ptr", "k_cache_ptr", "v_cache_ptr", "out_ptr", "part_acc_ptr", "part_ml_ptr",
             "k_scale_ptr", "v_scale_ptr", "query_start_loc_ptr", "seq_lens_ptr",
             "block_table_ptr"]
_SCALARS = ["qk_scale", "num_seqs", "num_tokens", "num_q_heads", "sliding_window",
            "softcap_log2", "stride_qt", "stride_qh", "stride_kb", "stride_ks", "stride_kh",
            "stride_ot", "stride_oh", "stride_bt", "stride_sb", "stride_ss"]
_TRITON_TYPES = {"float32": "fp32", "bfloat16": "bf16"}


def _spec(dtype: str, head_dim: int, elem_bytes: int) -> GpuKernelSpec:
    """The kernel build a prefill of 512 tokens (32 query heads, 8 KV heads) is launched with
    on sm_89, from the plan ``paged_attention`` makes for ``dtype``."""
    plan = plan_paged_attention(512, 32, 8, head_dim, 1, 512, 4096, 58,
                                elem_bytes=elem_bytes)
    t = _TRITON_TYPES[dtype]
    signature = dict(zip(_POINTERS, [f"*{t}"] * 4 + ["*fp32"] * 4 + ["*i32"] * 3))
    signature.update({name: "fp32" if name in ("qk_scale", "softcap_log2") else "i32"
                      for name in _SCALARS})
    constexprs = {"QPKV": plan.qpkv, "HEAD_DIM": head_dim, "KV_BLOCK_SIZE": 16,
                  "BLOCK_M": plan.block_m, "BLOCK_Q": plan.block_q, "TILE_N": plan.tile_n,
                  "BLOCK_D": plan.block_d, "NUM_SPLITS": plan.num_splits, "USE_WINDOW": True,
                  "DOT_PRECISION": "ieee" if dtype == "float32" else "tf32",
                  "QUANT_KV": False, "SOFTCAP": True}
    return GpuKernelSpec("kvflow.kernels.paged_attention_kernels", "paged_attention_kernel",
                         signature, constexprs, arch=89, num_warps=plan.num_warps,
                         num_stages=plan.num_stages)


def test_prefill_plans_fit_99_kib_of_shared_memory():
    cases = [("float32", 128, 4), ("float32", 256, 4), ("bfloat16", 256, 2)]
    built = compile_for_gpu([_spec(*case) for case in cases])
    shared = {case: b["shared"] for case, b in zip(cases, built, strict=True)}
    assert all(v <= SM89_MAX_SHARED for v in shared.values()), shared


def test_fp32_plans_use_smaller_tiles():
    """Hand-computed: fp32 halves the key tiles, and over head dims above 128 a prefill
    program holds 32 rows (8 tokens x 4 query heads) instead of 64; 16-bit plans unchanged."""
    bf16 = plan_paged_attention(512, 32, 8, 128, 1, 512, 4096, 58)
    assert (bf16.block_m, bf16.tile_n) == (64, 64)
    fp32 = plan_paged_attention(512, 32, 8, 128, 1, 512, 4096, 58, elem_bytes=4)
    assert (fp32.block_m, fp32.block_q, fp32.tile_n) == (64, 16, 32)
    fp32 = plan_paged_attention(512, 32, 8, 256, 1, 512, 4096, 58, elem_bytes=4)
    assert (fp32.block_m, fp32.block_q, fp32.tile_n, fp32.grid[0]) == (32, 8, 16, 512 // 8 + 1)
    fp32 = plan_paged_attention(4, 32, 8, 256, 4, 1, 4096, 58, elem_bytes=4)  # decode
    assert (fp32.block_m, fp32.tile_n) == (16, 16)


@pytest.mark.parametrize("head_dim", [128, 256])
def test_fp32_tiles_compute_the_same_attention(head_dim):
    """The fp32 plan's tiles (what the interpreter runs for fp32 q) against the float64
    oracle, prefill chunks after a cached prefix and decodes."""
    from kvflow.kernels.paged_attention import paged_attention
    from tests.kernels.paged_batch import attention_f64, make_batch

    batch = make_batch([(40, 30), (17, 1), (0, 9)], 8, 2, head_dim, seed=head_dim)
    out = paged_attention(**batch, sliding_window=33)
    ref = attention_f64(batch, sliding_window=33)
    assert (out[:40].double() - ref[:40]).abs().max().item() < 2e-6
