"""The quantized KV store kernels as an NVIDIA GPU builds them, checked without a GPU
(tests/kernels/ptx_compile.py compiles them for sm_90 on the host).

The Triton store is bit-exact with the torch store in the interpreter
(tests/kernels/test_kv_quant.py), whose numpy division rounds correctly. On a GPU, Triton's
fp32 ``/`` compiles to ``div.full.f32``, an approximation up to 2 ulp off, while torch's CUDA
division is IEEE ``div.rn.f32``: a scale ``absmax / 127`` an ulp away, and values ``x / scale``
on the other side of a rounding tie, would differ from the torch backend's cache. So the
kernels must divide with ``div_rn`` and their PTX hold no approximate division."""

from __future__ import annotations

from tests.kernels.ptx_compile import GpuKernelSpec, compile_for_gpu

_STORE_SIG = dict(zip(
    ["k_ptr", "v_ptr", "k_cache_ptr", "v_cache_ptr", "k_scale_ptr", "v_scale_ptr", "slot_ptr",
     "stride_kt", "stride_kh", "stride_vt", "stride_vh", "stride_cb", "stride_cs", "stride_ch",
     "stride_sb", "stride_ss"],
    ["*bf16", "*bf16", "*i8", "*i8", "*fp32", "*fp32", "*i64"] + ["i32"] * 9))
_ROTARY_SIG = dict(zip(
    ["pos_ptr", "q_ptr", "k_ptr", "v_ptr", "cos_sin_ptr", "k_cache_ptr", "v_cache_ptr",
     "k_scale_ptr", "v_scale_ptr", "slot_ptr", "stride_qt", "stride_qh", "stride_kt",
     "stride_kh", "stride_vt", "stride_vh", "stride_cos", "stride_cb", "stride_cs", "stride_ch",
     "stride_sb", "stride_ss", "num_q_heads", "num_slots"],
    ["*i64", "*bf16", "*bf16", "*bf16", "*fp32", "*fp8e4nv", "*fp8e4nv", "*fp32", "*fp32",
     "*i64"] + ["i32"] * 14))


def test_quantized_store_kernels_divide_as_ieee_on_a_gpu():
    shapes = {"NUM_KV_HEADS": 8, "HEAD_DIM": 128, "KV_BLOCK_SIZE": 16, "BLOCK_H": 8,
              "BLOCK_D": 128}
    specs = [
        GpuKernelSpec("kvflow.kernels.kv_store", "_store_kvcache_quant_kernel", _STORE_SIG,
                      {**shapes, "QMAX": 127.0, "IS_FP8": False}),
        GpuKernelSpec("kvflow.kernels.kv_store", "_store_kvcache_quant_kernel",
                      {**_STORE_SIG, "k_cache_ptr": "*fp8e4nv", "v_cache_ptr": "*fp8e4nv"},
                      {**shapes, "QMAX": 448.0, "IS_FP8": True}),
        GpuKernelSpec("kvflow.kernels.rotary_kv_store", "_rotary_kv_store_kernel", _ROTARY_SIG,
                      {"NUM_KV_HEADS": 8, "HEAD_DIM": 128, "ROT_HALF": 64,
                       "KV_BLOCK_SIZE": 16, "IS_NEOX": True, "BLOCK_HQ": 32, "BLOCK_HK": 8,
                       "BLOCK_R": 64, "BLOCK_REST": 1, "BLOCK_D": 128, "HAS_REST": False,
                       "QUANT_KV": True, "QMAX": 448.0, "IS_FP8": True}),
    ]
    for spec, built in zip(specs, compile_for_gpu(specs), strict=True):
        name = f"{spec.kernel} {spec.constexprs.get('IS_FP8')}"
        assert "div.rn.f32" in built["ptx"], name  # the scales and the scaled values
        assert "div.full.f32" not in built["ptx"] and "div.approx.f32" not in built["ptx"], name
