"""One kernel library per instruction-set level, chosen at run time: which levels a CPU runs
(from its feature flags), cache names that do not depend on the CPU (a shared cache directory
serves every CPU), ``KVFLOW_CPU_ISA`` forcing a lower level (the AVX2 path on an AVX512
machine), and every level this CPU runs checked against the float64 / plain-torch oracles:
GEMM (fp32, bf16, fp16 weights), paged attention (tiled and row paths), RMSNorm, GGUF GEMM,
quantized-cache attention."""

from __future__ import annotations

import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch

from kvflow.config.kernel_choices import native_cpu_choice
from kvflow.kernels import cpu_build, cpu_native
from kvflow.kernels.attention_ref import paged_attention_ref
from kvflow.kernels.cpu_attention_kvq import paged_attention_kvq
from kvflow.kernels.gguf_dequant import Q4_0, Q4_1, Q4_K, Q5_0, Q5_K, Q6_K, Q8_0
from kvflow.kernels.kv_quant import dequantize_kv, quantize_kv
from tests.kernels.paged_batch import make_batch
from tests.kernels.test_cpu_attention import bf16_dot_bound
from tests.kernels.test_gemm import fp32_error_bound

AVX2 = frozenset({"avx2", "fma", "f16c", "bmi2", "sse4_2"})
AVX512 = AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"}
LEVELS = [lv.name for lv in cpu_build.isa_levels_for_cpu()]


@pytest.fixture(scope="module", autouse=True)
def _every_level_built_side_by_side() -> None:
    """Load (building it where the cache lacks it) each level's library up front, two at a
    time: a build is one single-threaded compile of 10-17 s on a cold cache, and the tests
    below use every level. Only the order of the work changes: each test still loads its
    level's library through the same calls."""
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(cpu_native.native_cpu_kernels_for_isa, LEVELS))


def test_levels_follow_the_cpu_flags(monkeypatch):
    monkeypatch.setattr(cpu_build.platform, "machine", lambda: "x86_64")
    names = lambda features: [lv.name for lv in cpu_build.isa_levels_for_cpu(features)]
    assert names(AVX512 | {"avx512_bf16", "amx_tile", "amx_bf16"}) == [
        "amx_bf16", "avx512_bf16", "avx512", "avx2", "x86-64"]
    assert names(AVX512 | {"avx512_bf16", "amx_tile"}) == [
        "avx512_bf16", "avx512", "avx2", "x86-64"]
    assert names(AVX512 | {"avx512_bf16"}) == ["avx512_bf16", "avx512", "avx2", "x86-64"]
    assert names(AVX512) == ["avx512", "avx2", "x86-64"]
    assert names(AVX2) == ["avx2", "x86-64"]
    assert names(frozenset({"sse2"})) == ["x86-64"]
    monkeypatch.setattr(cpu_build.platform, "machine", lambda: "aarch64")
    assert names(frozenset({"asimd"})) == ["generic"]


def test_library_names_depend_on_level_not_on_the_cpu(monkeypatch, tmp_path):
    """No -march=native: two CPUs sharing a cache directory get the same file for a level,
    and each level its own file."""
    src = [Path(cpu_native.__file__).parent / "csrc" / s for s in cpu_build.SOURCES]
    levels = cpu_build.X86_LEVELS
    paths = [cpu_build.library_path("cc", src, str(tmp_path), lv) for lv in levels]
    monkeypatch.setattr(cpu_build, "cpu_fingerprint", lambda: "model name: another CPU")
    assert paths == [cpu_build.library_path("cc", src, str(tmp_path), lv) for lv in levels]
    assert len(set(paths)) == len(levels)
    assert all("-march=native" not in lv.flags for lv in levels)


def test_levels_pin_their_instruction_sets_whatever_the_compiler_defaults_to(tmp_path):
    """Each x86 level's flags decide its instruction sets, not the compiler's default target: a
    compiler configured for x86-64-v3 (here a wrapper adding -march=x86-64-v3 first, as some
    distributions' GCC defaults) built the "x86-64" baseline with AVX2, a library that dies
    with SIGILL on the CPUs the baseline serves (the level needs no CPU feature). Checked by
    the macros the compiler predefines with each level's flags, as the build passes them."""
    cc = cpu_native._compiler()
    if cc is None or cpu_build.platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("needs a C compiler on x86-64")
    wrapper = tmp_path / "cc"
    wrapper.write_text(f'#!/bin/sh\nexec "{cc}" -march=x86-64-v3 "$@"\n')
    wrapper.chmod(0o755)
    for level in cpu_build.X86_LEVELS:
        run = subprocess.run([str(wrapper), *cpu_build.FLAGS, *level.flags, "-dM", "-E", "-x",
                              "c", "-"], input="", capture_output=True, text=True, check=False)
        if run.returncode != 0:  # an older compiler without this level's flags
            continue
        macros = {line.split()[1] for line in run.stdout.splitlines()}
        assert ("__AVX2__" in macros) == (level.name != "x86-64"), level.name
        assert ("__AVX512F__" in macros) == level.name.startswith(("avx512", "amx")), level.name
        assert ("__SSE4_1__" in macros) == (level.name != "x86-64"), level.name


def test_env_forces_a_lower_level(monkeypatch):
    """KVFLOW_CPU_ISA picks the level (here the lowest this CPU runs)."""
    if cpu_native.native_cpu_kernels() is None:
        pytest.skip("no C compiler")
    try:
        monkeypatch.setenv("KVFLOW_CPU_ISA", LEVELS[-1])
        cpu_native.native_cpu_kernels.cache_clear()
        assert cpu_native.native_cpu_kernels().isa == LEVELS[-1]
    finally:
        monkeypatch.delenv("KVFLOW_CPU_ISA")
        cpu_native.native_cpu_kernels.cache_clear()


@pytest.mark.parametrize("forced, why", [("avx512_vnni_imaginary", "is invalid"),
                                         ("generic" if LEVELS[-1] == "x86-64" else "x86-64",
                                          "is invalid"),
                                         ("amx_bf16", "is a level this CPU cannot run")])
def test_env_names_an_unknown_level(monkeypatch, forced, why):
    """An unknown KVFLOW_CPU_ISA, or a level this CPU cannot run, is a ValueError naming the
    levels it runs, from the engine config (before a model loads) and the kernel loader
    alike; it was a warning, the best level used instead."""
    from kvflow.config import EngineConfig

    if forced in LEVELS:
        pytest.skip(f"this CPU runs {forced}")
    monkeypatch.setenv("KVFLOW_CPU_ISA", forced)
    message = f"KVFLOW_CPU_ISA='{forced}' {why}; choose one of {LEVELS} (or leave it unset"
    with pytest.raises(ValueError) as exc:
        EngineConfig.from_kwargs(model="unused")
    assert str(exc.value).startswith(message), exc.value
    if not native_cpu_choice():  # KVFLOW_NATIVE_CPU=0: the loader never reads the level
        return
    cpu_native.native_cpu_kernels.cache_clear()
    try:
        with pytest.raises(ValueError) as exc:
            cpu_native.native_cpu_kernels()
        assert str(exc.value).startswith(message), exc.value
    finally:
        cpu_native.native_cpu_kernels.cache_clear()


@pytest.fixture(params=LEVELS)
def kernels(request):
    """The kernels of each ISA level this CPU runs."""
    k = cpu_native.native_cpu_kernels_for_isa(request.param)
    if k is None:
        pytest.skip(f"{request.param} kernels could not be built")
    assert k.isa == request.param
    return k


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,n,k", [(1, 33, 257), (7, 16, 3), (97, 70, 600), (45, 70, 96)])
def test_gemm_at_every_level(kernels, dtype, m, n, k):
    gen = torch.Generator().manual_seed(m + n + k)
    x = torch.randn(m, k, generator=gen).to(kernels.gemm_x_dtype(dtype))
    w, b = torch.randn(n, k, generator=gen).to(dtype), torch.randn(n, generator=gen)
    got = kernels.gemm(x, kernels.gemm_pack(w), n, b)
    ref = x.double() @ w.double().T + b.double()
    assert got.dtype == torch.float32
    assert ((got.double() - ref).abs() <= fp32_error_bound(x.float(), w.float(), b)).all()



# Every row count a block can have up to 40 (each micro-kernel row count, one pass of up to 8
# rows, balanced passes, 6-row passes), and two blocks (97 rows at k = 600: 96 + 1).
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemm_every_row_count_at_every_level(kernels, dtype):
    gen = torch.Generator().manual_seed(40)
    n, k = 70, 600  # an edge panel (70 = 2 x 32 + 6 columns) and k over three 256-chunks
    x = torch.randn(97, k, generator=gen).to(kernels.gemm_x_dtype(dtype))
    w, b = torch.randn(n, k, generator=gen).to(dtype), torch.randn(n, generator=gen)
    packed = kernels.gemm_pack(w)
    alone = torch.cat([kernels.gemm(x[i:i + 1], packed, n, b) for i in range(97)])
    ref = x.double() @ w.double().T + b.double()
    assert ((alone.double() - ref).abs() <= fp32_error_bound(x.float(), w.float(), b)).all()
    for m in [*range(2, 41), 64, 97]:
        # each row is the same sum in the same order whatever the rows around it: bit for bit
        assert torch.equal(kernels.gemm(x[:m], packed, n, b), alone[:m]), m

TOL = {torch.float32: 1e-5, torch.bfloat16: 2**-7}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tiled", [True, False])
def test_attention_at_every_level(kernels, dtype, tiled):
    reqs = [(0, 1), (0, 70), (40, 130), (100, 1), (5, 17)]
    for window in (None, 33):
        batch = make_batch(reqs, 9, 3, 64, dtype=dtype, seed=4)
        n = int(batch["query_start_loc"][-1])
        ref = paged_attention_ref(**batch, sliding_window=window)
        out = kernels.paged_attention(batch["q"], batch["kv_cache"], batch["query_start_loc"],
                                      batch["seq_lens"], batch["block_table"], batch["scale"],
                                      window, tiled=tiled)
        if dtype == torch.bfloat16 and tiled:  # the bf16 dot-product tiles, where built
            ref = paged_attention_ref(**dict(batch, q=batch["q"].float(),
                                             kv_cache=batch["kv_cache"].float()),
                                      sliding_window=window)
            err = (out[:n].float() - ref[:n]).abs()
            assert bool((err <= bf16_dot_bound(batch, ref[:n])).all())
        else:
            torch.testing.assert_close(out[:n], ref[:n], atol=TOL[dtype], rtol=TOL[dtype])


def test_rms_norm_at_every_level(kernels):
    gen = torch.Generator().manual_seed(1)
    x, w = torch.randn(5, 96, generator=gen), torch.rand(96, generator=gen) + 0.5
    ref = w * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6))
    torch.testing.assert_close(kernels.rms_norm(x, w, 1e-6), ref, atol=1e-5, rtol=1e-5)


GGML_TYPES = [Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K]


@pytest.mark.parametrize("ggml_type", GGML_TYPES)
@pytest.mark.parametrize("m", [1, 15])  # one row; passes of 8, 4, 2 and 1 rows
def test_gguf_gemm_at_every_level(kernels, ggml_type, m):
    """cpu_gguf.c built at each level (its vector width follows the ISA): the fused
    dequantize-and-multiply against gguf.quants.dequantize + a float64 matmul, within Higham's
    fp32 bound K * eps * sum|x w|; its dequantization alone equal to gguf's (1 ulp)."""
    from tests.kernels.test_cpu_gguf import _case
    raw, ref = _case(ggml_type, 21, seed=ggml_type)
    torch.testing.assert_close(kernels.gguf_dequantize(raw, ggml_type, ref.shape[1]), ref,
                               atol=1e-6, rtol=1e-6)
    x = torch.randn(m, ref.shape[1], generator=torch.Generator().manual_seed(3))
    got = kernels.gguf_gemm(x, raw, ggml_type, ref.shape[1])
    want = x.double() @ ref.double().T
    bound = ref.shape[1] * 2 ** -24 * (x.abs().double() @ ref.abs().double().T)
    assert bool(((got.double() - want).abs() <= bound + 1e-6).all())


@pytest.mark.parametrize("blocks, n, m", [(1, 1, 1), (3, 9, 5), (5, 3, 16)])
def test_gguf_q8_0_odd_shapes_at_every_level(kernels, blocks, n, m):
    """Q8_0 (int8 quants, sign-extended in the kernel) at K of 1, 3 and 5 blocks, N not a
    multiple of the 8-row tile, M of 1, 5 (passes of 4 and 1) and 16 (two passes of 8); the
    first weight row's first block holds the extreme quants -128 and 127. Checked against
    gguf.quants.dequantize + a float64 matmul within Higham's fp32 bound K * eps * sum|x w|
    (the products d * q are exact in fp32: an fp16 scale times an 8-bit integer)."""
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize

    from tests.kernels.test_cpu_gguf import random_blocks
    raw = random_blocks(Q8_0, n, blocks, seed=blocks)
    raw[0, 2:18], raw[0, 18:34] = 0x80, 0x7F  # int8 -128 and 127
    ref = torch.from_numpy(dequantize(raw, GGMLQuantizationType.Q8_0).astype(np.float32))
    d = float(raw[0, :2].view(np.float16)[0])
    assert ref[0, 0] == -128 * d and ref[0, 31] == 127 * d
    raw = torch.from_numpy(raw)
    torch.testing.assert_close(kernels.gguf_dequantize(raw, Q8_0, 32 * blocks), ref,
                               atol=0, rtol=0)
    x = torch.randn(m, 32 * blocks, generator=torch.Generator().manual_seed(m))
    got = kernels.gguf_gemm(x, raw, Q8_0, 32 * blocks)
    want = x.double() @ ref.double().T
    bound = ref.shape[1] * 2 ** -24 * (x.abs().double() @ ref.abs().double().T)
    assert bool(((got.double() - want).abs() <= bound).all())


@pytest.mark.parametrize("cache", ["int8", "fp8_e4m3"])
def test_quantized_cache_attention_at_every_level(kernels, cache):
    """cpu_attention_kvq.c built at each level against the reference over the dequantized
    cache (fp32 summation-order differences only)."""
    from tests.kernels.test_cpu_attention_kvq import CACHE, MIXED
    batch = make_batch(MIXED, 9, 3, 64, seed=5)
    q_cache, scales = quantize_kv(batch["kv_cache"].float(), CACHE[cache])
    n = int(batch["query_start_loc"][-1])
    ref = paged_attention_ref(**dict(batch, kv_cache=dequantize_kv(q_cache, scales,
                                                                   torch.float32)))
    out = paged_attention_kvq(kernels, batch["q"], q_cache, scales, batch["query_start_loc"],
                              batch["seq_lens"], batch["block_table"], batch["scale"])
    torch.testing.assert_close(out[:n], ref[:n], atol=1e-5, rtol=1e-5)
