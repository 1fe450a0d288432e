"""The GEMM entry point: packed fp32 weights (kvflow's C GEMM and oneDNN) and 16-bit products
widened to fp32 units.

Oracle: the float64 product of the same operands, rounded once to the output dtype. A correct
16-bit GEMM (fp32 accumulation) lands within a couple of output ulps of it; so must the widened
one, and both engines' greedy tokens on a tiny bf16 model must agree. fp32 products (and 16-bit
logits, which stay fp32) must lie within the worst-case fp32 summation error of it
(``fp32_error_bound``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kvflow import LLM, SamplingParams
from kvflow.kernels.cpu_native import native_cpu_kernels
from kvflow.kernels.gemm import (
    GemmWorkspace,
    NativePackedWeight,
    OneDnnPackedWeight,
    cpu_gemm_kernels,
    linear,
    pack_logits_head,
    pack_weight,
    prepack_gemm_weights,
)
from kvflow.platforms.cpu import CpuPlatform

# relative spacing of representable values: bf16 keeps 8 significant bits, fp16 11
ULP = {torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}


def _operands(dtype: torch.dtype, bias: bool):
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(33, 96, generator=gen).to(dtype)
    w = torch.randn(80, 96, generator=gen).to(dtype)
    b = torch.randn(80, generator=gen).to(dtype) if bias else None
    return x, w, b


def _oracle(x, w, b):
    y = x.double() @ w.double().T
    return (y if b is None else y + b.double()).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [False, True])
# 1 << 23: the whole weight at once; 96 * 7: 7 rows per chunk, the last chunk 3 rows short
@pytest.mark.parametrize("max_elements", [1 << 23, 96 * 7])
def test_widened_gemm_matches_float64_oracle(dtype, bias, max_elements):
    x, w, b = _operands(dtype, bias)
    ref = _oracle(x, w, b).float()
    got = linear(x, w, b, GemmWorkspace(max_elements))
    assert got.dtype == dtype and got.shape == (33, 80)
    # two roundings at most (fp32 sum, then to 16 bits): within 2 ulps of |y|, plus an
    # absolute floor for outputs near zero, where cancellation leaves only fp32 noise
    tol = 2 * ULP[dtype] * ref.abs() + 1e-3
    assert ((got.float() - ref).abs() <= tol).all()
    native = F.linear(x, w, b).float()  # torch's own 16-bit GEMM meets the same bound
    assert ((native - ref).abs() <= tol).all()


def test_float32_is_left_alone():
    x, w, b = (t.float() for t in _operands(torch.bfloat16, True))
    assert torch.equal(linear(x, w, b, GemmWorkspace()), F.linear(x, w, b))


def test_workspace_is_reused_and_bounded():
    ws = GemmWorkspace(max_elements=96 * 10)
    x, w, _ = _operands(torch.bfloat16, False)  # w: 80 x 96 -> 8 chunks of 10 rows
    first = linear(x, w, None, ws)
    buffer = ws._buffer
    assert buffer.numel() == 96 * 10
    second = linear(x, w, None, ws)
    assert ws._buffer is buffer and torch.equal(first, second)
    with pytest.raises(ValueError, match="max_elements"):
        GemmWorkspace(0)


def _greedy(tiny, monkeypatch, native: bool):
    monkeypatch.setattr(CpuPlatform, "has_native_matmul", lambda self, dtype: native)
    llm = LLM(model=tiny.path, dtype="bfloat16", device="cpu", num_kv_blocks=64)
    model = llm.engine.core.executor.runner.model
    gemms = [m for m in model.modules() if hasattr(m, "gemm_workspace")]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    outs = llm.generate([[5, 9, 23, 41, 7], [100, 3, 77]], params, use_tqdm=False)
    return gemms, outs


def test_bf16_model_without_native_matmul_runs_on_fp32_units(tiny_llama, monkeypatch,
                                                             cpu_kernels):
    """No bf16 matmul units: every GEMM runs on fp32 FMA units, as kvflow's C GEMM on bf16
    panels (native kernels) or through the widening workspace (without them)."""
    gemms, _ = _greedy(tiny_llama, monkeypatch, native=False)
    assert len(gemms) == 9  # 2 layers x (qkv, o, gate_up, down) + lm_head
    for m in gemms:
        if cpu_kernels == "native":
            assert isinstance(m.packed_weight, NativePackedWeight)
            assert m.packed_weight.packed.dtype == torch.bfloat16
        else:
            assert m.packed_weight is None or m is gemms[-1]  # the LM head: an fp32 copy
            assert m.gemm_workspace is not None


@pytest.mark.skipif(not CpuPlatform().prepacks_gemm_weights(torch.bfloat16),
                    reason="oneDNN cannot pack bf16 on this CPU (AVX2): no native bf16 path")
def test_bf16_on_fp32_units_matches_the_native_bf16_path(tiny_llama, monkeypatch,
                                                          cpu_kernels):
    """The greedy tokens of the fp32-unit path equal those of the native bf16 path (forced on
    where oneDNN packs bf16), logprobs within bf16 rounding. On a CPU without any bf16 path
    there is no oracle at this level: the tiny random model's next-token distributions are
    nearly flat, so transformers' bf16 rounding picks other tokens."""
    _, outs = _greedy(tiny_llama, monkeypatch, native=False)
    native_gemms, native_outs = _greedy(tiny_llama, monkeypatch, native=True)
    assert all(m.gemm_workspace is None for m in native_gemms)
    for got, ref in zip(outs, native_outs):
        assert got.outputs[0].token_ids == ref.outputs[0].token_ids
        for step_got, step_ref, tok in zip(got.outputs[0].logprobs, ref.outputs[0].logprobs,
                                           got.outputs[0].token_ids):
            assert abs(step_got[tok].logprob - step_ref[tok].logprob) < 0.05


mkldnn = pytest.mark.skipif(not CpuPlatform().prepacks_gemm_weights(torch.float32),
                            reason="torch built without oneDNN")


native = pytest.mark.skipif(native_cpu_kernels() is None, reason="no C compiler")
PACKERS = [pytest.param("onednn", marks=mkldnn), pytest.param("native", marks=native)]


def _pack(w: torch.Tensor, packer: str):
    return pack_weight(w, batch_hint=64,
                       kernels=native_cpu_kernels() if packer == "native" else None)


def fp32_error_bound(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """The worst-case error of ``x @ w.T + b`` summed in fp32 in any order (with or without
    FMA), elementwise: gamma_(K+1) * (|x| @ |w|.T + |b|), gamma_n = n u / (1 - n u), u = 2^-24
    (Higham, "Accuracy and Stability of Numerical Algorithms", 2nd ed., section 3.1). It comes
    from the arithmetic alone (K and the operands' magnitudes), not from another library's
    error on one CPU; a product accumulated in 16 bits or a wrong element exceeds it."""
    n = x.shape[-1] + 1
    gamma = n * 2.0 ** -24 / (1 - n * 2.0 ** -24)
    mags = x.double().abs() @ w.double().abs().T + (0 if b is None else b.double().abs())
    return gamma * mags


def _fp32_oracle_check(got: torch.Tensor, x, w, b) -> None:
    """``got`` is within the fp32 error bound of the float64 product of the same operands (16-bit
    ones widened exactly), and of the right shape and dtype."""
    ref = x.double() @ w.double().T + (0 if b is None else b.double())
    assert got.shape == ref.shape and got.dtype == torch.float32
    assert ((got.double() - ref).abs() <= fp32_error_bound(x, w, b)).all()


@pytest.mark.parametrize("packer", PACKERS)
@pytest.mark.parametrize("shape", [(1, 96), (37, 96), (300, 96), (2, 5, 96)])
def test_packed_gemm_matches_float64_oracle(shape, packer):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(*shape, generator=gen)
    w, b = torch.randn(80, 96, generator=gen), torch.randn(80, generator=gen)
    _fp32_oracle_check(linear(x, w.new_empty(0, 96), b, packed=_pack(w, packer)), x, w, b)


# kvflow's GEMM tiles: up to 6 (AVX2) or 8 (AVX512) rows x 16 or 32 columns, k in chunks of
# 256, x in blocks of up to 96 rows (fewer when k is large). These cover every edge: m, n not
# multiples of the tile, k over one and over several chunks, several row blocks, k = 1, and an
# empty k (the bias alone).
@native
@pytest.mark.parametrize("m,n,k", [(1, 1, 1), (5, 17, 3), (6, 16, 256), (7, 33, 257),
                                   (97, 48, 600), (200, 70, 1536), (13, 5, 0)])
@pytest.mark.parametrize("bias", [False, True])
def test_native_gemm_tiles_and_edges(m, n, k, bias):
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    x, w = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    got = NativePackedWeight(w, native_cpu_kernels())(x, b)
    if k == 0:
        assert torch.equal(got, torch.zeros(m, n) if b is None else b.expand(m, n))
    else:
        _fp32_oracle_check(got, x, w, b)


@native
def test_native_gemm_reads_strided_rows_and_ignores_thread_count():
    gen = torch.Generator().manual_seed(11)
    wide = torch.randn(250, 700, generator=gen)
    x = wide[:, 100:400]  # row stride 700: the kernel reads in place (three 96-row blocks)
    w = torch.randn(200, 320, generator=gen)[:, 20:]  # row stride 320: packed from in place
    packed = NativePackedWeight(w, native_cpu_kernels())
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = packed(x, None)
        # More threads than cores: threads get preempted and take items from each other's
        # shares, so outputs are computed by whichever thread claims them.
        runs = []
        for num_threads in (2, 3, 7):
            torch.set_num_threads(num_threads)
            runs += [packed(x, None) for _ in range(3)]
    finally:
        torch.set_num_threads(threads)
    for other in runs:  # each output summed by one thread in one k order
        assert torch.equal(one, other)
    _fp32_oracle_check(one, x, w, None)
    xt = torch.randn(300, 9, generator=gen).t()  # unit stride along rows, not along k
    _fp32_oracle_check(packed(xt, None), xt, w, None)


@native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_gemm_packs_into_an_arena_bit_for_bit(dtype):
    from kvflow.platforms.cpu_memory import HugePageArena

    gen = torch.Generator().manual_seed(5)
    kernels = native_cpu_kernels()
    arena = HugePageArena(segment_bytes=1 << 20)
    weights = [torch.randn(n, 96, generator=gen).to(dtype) for n in (70, 33, 128)]
    x = torch.randn(9, 96, generator=gen).to(dtype)
    for w in weights:
        alone = NativePackedWeight(w, kernels)
        placed = NativePackedWeight(w, kernels, arena)
        assert placed.packed.numel() == kernels.gemm_packed_numel(*w.shape, dtype)
        assert torch.equal(placed.packed, alone.packed)
        assert torch.equal(placed(x, None), alone(x, None))
        _fp32_oracle_check(placed(x, None), x, w, None)
    with pytest.raises(ValueError, match="out must be"):
        kernels.gemm_pack(weights[0], torch.empty(5, dtype=dtype))
    with pytest.raises(ValueError, match="out must be"):
        numel = kernels.gemm_packed_numel(*weights[0].shape, dtype)
        kernels.gemm_pack(weights[0], torch.empty(numel, dtype=torch.float16))


@native
def test_native_gemm_rejects_bad_operands():
    kernels = native_cpu_kernels()
    with pytest.raises(ValueError, match="float32"):
        kernels.gemm_pack(torch.randn(4, 8).double())
    with pytest.raises(ValueError, match="unit-stride"):
        kernels.gemm_pack(torch.randn(8, 4).t())
    packed = kernels.gemm_pack(torch.randn(4, 8))
    with pytest.raises(ValueError, match="matching"):
        kernels.gemm(torch.randn(3, 9), packed, 4)  # K 9 vs 8
    with pytest.raises(ValueError, match="matching"):
        kernels.gemm(torch.randn(3, 8, dtype=torch.float64).int(), packed, 4)
    with pytest.raises(ValueError, match="bias"):
        kernels.gemm(torch.randn(3, 8), packed, 4, torch.randn(5))


@native
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,n,k", [(1, 1, 1), (7, 33, 257), (97, 48, 600)])
def test_native_gemm_16_bit_weights_widen_exactly(dtype, m, n, k):
    """16-bit weights packed as they are, widened in registers (or, bf16 on AVX512-BF16,
    multiplied with bf16 activations by dot-product instructions): the fp32 result is within
    the fp32 bound of the float64 product of the operands the kernel takes (never rounded to
    16 bits)."""
    kernels = native_cpu_kernels()
    gen = torch.Generator().manual_seed(m + n + k)
    x = torch.randn(m, k, generator=gen).to(kernels.gemm_x_dtype(dtype))
    w, b = torch.randn(n, k, generator=gen).to(dtype), torch.randn(n, generator=gen)
    packed = NativePackedWeight(w, kernels)
    assert packed.packed.dtype == dtype
    _fp32_oracle_check(packed(x, b), x.float(), w.float(), b)



# rows x 576: 1 and 7 rows widen x on the stack; 64 and 200 each thread, block by block, in
# its own scratch
@native
@pytest.mark.parametrize("m", [1, 7, 64, 200])
def test_native_gemm_takes_bf16_activations_on_every_build(m):
    """bf16 weights take bf16 x on every build (kvflow_gemm_x_dtype): widened panels (no
    AVX512-BF16) widen x inside the call, so a bf16 model's GEMMs run with no torch conversion
    between native calls (which made its decode steps unreplayable as CPU step graphs). Rows
    of a wider tensor (x row stride > K): the fp32 result is within the fp32 bound of the
    float64 product, bit for bit the same on 1 and 2 threads."""
    kernels = native_cpu_kernels()
    assert kernels.gemm_x_dtype(torch.bfloat16) == torch.bfloat16
    assert kernels.gemm_x_dtype(torch.float32) == torch.float32
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, 600, generator=gen).to(torch.bfloat16)[:, :576]
    w = torch.randn(70, 576, generator=gen).to(torch.bfloat16)
    packed = NativePackedWeight(w, kernels)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = packed(x, None)
        torch.set_num_threads(2)
        two = packed(x, None)
    finally:
        torch.set_num_threads(threads)
    _fp32_oracle_check(one, x.float(), w.float(), None)
    assert torch.equal(one, two)


# bf16 x of widened panels past 4,096 values is widened by each thread, block by block, into
# its own scratch: packed k-major (Ice Lake, blocks of more than 8 rows) or row-major. The
# blocks: 96 + 5 rows (k = 576: the 5-row tail row-major everywhere), 42 + 3 (k = 1536), 96 +
# 34 (k = 257: the 34-row tail packed on Ice Lake). 3 threads take items from each other's
# shares, moving between blocks (and re-widening).
@native
@pytest.mark.parametrize("m,k", [(101, 576), (45, 1536), (130, 257)])
def test_native_gemm_widens_bf16_x_block_by_block(m, k):
    """Every row of a bf16 x (row stride > K) widened block by block is within the fp32 bound
    of the float64 product, bit for bit the same on 1, 2 and 3 threads and as the row computed
    alone (one row: widened on the stack, read in place)."""
    kernels = native_cpu_kernels()
    gen = torch.Generator().manual_seed(m + k)
    x = torch.randn(m, k + 40, generator=gen).to(torch.bfloat16)[:, 20:20 + k]
    w, b = torch.randn(70, k, generator=gen).to(torch.bfloat16), torch.randn(70, generator=gen)
    packed = NativePackedWeight(w, kernels)
    threads = torch.get_num_threads()
    try:
        runs = []
        for num_threads in (1, 2, 3):
            torch.set_num_threads(num_threads)
            runs.append(packed(x, b))
    finally:
        torch.set_num_threads(threads)
    _fp32_oracle_check(runs[0], x.float(), w.float(), b)
    for other in runs[1:]:
        assert torch.equal(other, runs[0])
    for i in (0, 41, 42, 95, 96, m - 1):
        assert torch.equal(packed(x[i:i + 1], b), runs[0][i:i + 1])


def _cpuinfo_fields() -> dict[str, str]:
    """The first CPU's ``key: value`` lines of /proc/cpuinfo (empty where it cannot be read)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    fields = dict(line.split(":", 1) for line in info.split("\n\n")[0].splitlines() if ":" in line)
    return {key.strip(): value.strip() for key, value in fields.items()}


def _zen5_or_later_amd() -> bool:
    """/proc/cpuinfo names an AMD CPU of family 26 (Zen 5) or later."""
    fields = _cpuinfo_fields()
    return fields.get("vendor_id") == "AuthenticAMD" and int(fields.get("cpu family", 0)) >= 26


@native
def test_rows_per_micro_kernel_follow_the_cpu():
    """Blocks of more than 32 rows of k-paired bf16 weights run 8-row micro-kernels on Zen 5
    and later AMD cores (AVX512-BF16 builds), 6-row ones elsewhere (cpu_gemm.c,
    kvflow_gemm_full_rows)."""
    kernels = native_cpu_kernels()
    paired = kernels.gemm_x_dtype(torch.bfloat16) == torch.bfloat16
    assert kernels.lib.kvflow_gemm_full_rows() == (8 if paired and _zen5_or_later_amd() else 6)


def _intel_icelake_server() -> bool:
    """/proc/cpuinfo names an Intel CPU of family 6, model 106 or 108 (Ice Lake server)."""
    fields = _cpuinfo_fields()
    return (fields.get("vendor_id") == "GenuineIntel" and fields.get("cpu family") == "6"
            and fields.get("model") in ("106", "108"))


@native
def test_x_packing_follows_the_cpu():
    """Blocks of more than 8 (16-bit weights) or 32 (fp32 weights) rows of fp32 x are packed
    k-major for micro-kernels of up to 12 rows on Ice Lake server cores in AVX512 builds only (cpu_gemm.c, kvflow_gemm_x_packed)."""
    kernels = native_cpu_kernels()
    avx512 = kernels.lib.kvflow_gemm_panel_width() == 32
    assert kernels.lib.kvflow_gemm_x_packed() == int(avx512 and _intel_icelake_server())


@native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_gemm_rows_do_not_depend_on_the_row_count(dtype):
    """Each output is one fixed sum whatever the call's rows: a row computed alone, in a block
    of up to 8 rows (one micro-kernel, x read in place) or in a larger block (x packed for
    12-row micro-kernels on Ice Lake, 6-row ones elsewhere) comes out bit for bit the same (the
    batch invariance the deterministic mode relies on; k = 600 spans three k chunks)."""
    kernels = native_cpu_kernels()
    gen = torch.Generator().manual_seed(23)
    x = torch.randn(200, 600, generator=gen).to(kernels.gemm_x_dtype(dtype))
    w, b = torch.randn(70, 600, generator=gen).to(dtype), torch.randn(70, generator=gen)
    packed = NativePackedWeight(w, kernels)
    whole = packed(x, b)
    for m in (1, 5, 8, 9, 13, 64):
        assert torch.equal(packed(x[:m], b), whole[:m])
        assert torch.equal(packed(x[100:100 + m], b), whole[100:100 + m])


# Blocks of more than 32 rows (AVX512 builds) split into 6- or 8-row micro-kernels (8 for
# k-paired bf16 on Zen 5) and a shorter last one; k = 1536 makes 40- or 42-row blocks, 576 and
# 257 blocks of 96. Where fp32 x is packed (kvflow_gemm_x_packed; fp32 weights from 33 rows,
# widened bf16 from 9), blocks split into equal shares of at most 12 rows (9: one of 9; 13: 7 + 6; 23: 12 + 11; 65: five of 11
# and one of 10).
@native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [9, 13, 23, 33, 40, 42, 47, 64, 65, 96, 181])
@pytest.mark.parametrize("k", [257, 576, 1536])
def test_native_gemm_blocks_of_many_rows(dtype, m, k):
    kernels = native_cpu_kernels()
    gen = torch.Generator().manual_seed(m * 10 + k)
    x = torch.randn(m, k, generator=gen).to(kernels.gemm_x_dtype(dtype))
    w, b = torch.randn(70, k, generator=gen).to(dtype), torch.randn(70, generator=gen)
    _fp32_oracle_check(NativePackedWeight(w, kernels)(x, b), x.float(), w.float(), b)


HEAD_PATHS = [pytest.param("native", marks=native), pytest.param("onednn", marks=mkldnn),
              "fallback"]


@pytest.mark.parametrize("path", HEAD_PATHS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_lm_head_gives_fp32_logits(path, dtype):
    """A 16-bit LM head's logits are the fp32 accumulation itself: within the fp32 bound of the
    float64 product, so they are not rounded to 16 bits (most logits of a 256-deep product are
    not 16-bit values)."""
    from kvflow.layers.embedding import ParallelLMHead

    gen = torch.Generator().manual_seed(5)
    head = ParallelLMHead(300, 256)
    head.weight.data = torch.randn(300, 256, generator=gen).to(dtype)
    hidden = torch.randn(9, 256, generator=gen).to(dtype)
    kernels = native_cpu_kernels() if path == "native" else None
    packed = None if path == "fallback" else pack_logits_head(head, 16, kernels)
    assert (packed is None) == (path == "fallback")
    logits = head.compute_logits(hidden)
    assert logits.dtype == torch.float32
    _fp32_oracle_check(logits, hidden.float(), head.weight.float(), None)
    assert (logits != logits.to(dtype).float()).float().mean() > 0.9


def test_cpu_gemm_choice(monkeypatch):
    monkeypatch.setenv("KVFLOW_CPU_GEMM", "onednn")
    assert cpu_gemm_kernels() is None
    monkeypatch.setenv("KVFLOW_CPU_GEMM", "native")
    assert cpu_gemm_kernels() is native_cpu_kernels()
    monkeypatch.setenv("KVFLOW_CPU_GEMM", "mkl")
    with pytest.raises(ValueError, match="KVFLOW_CPU_GEMM"):
        cpu_gemm_kernels()
    with pytest.raises(ValueError, match="KVFLOW_CPU_GEMM"):  # before loading, any dtype
        LLM(model="/nonexistent", dtype="bfloat16", device="cpu")


@pytest.mark.parametrize("packer", PACKERS)
@pytest.mark.parametrize("name", ["llama", "llama_tied"])
def test_engine_packs_fp32_weights_and_frees_the_plain_copies(tiny_model_factory, name, packer,
                                                              monkeypatch):
    monkeypatch.setenv("KVFLOW_CPU_GEMM", packer)
    kind = NativePackedWeight if packer == "native" else OneDnnPackedWeight
    tiny = tiny_model_factory(name)
    llm = LLM(model=tiny.path, dtype="float32", device="cpu", num_kv_blocks=64)
    model = llm.engine.core.executor.runner.model
    layer = model.model.layers[0]
    for proj in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                 layer.mlp.down_proj):
        assert isinstance(proj.packed_weight, kind)
        assert proj.weight.shape == (0, proj.weight.shape[1])
    assert isinstance(model.lm_head.packed_weight, kind)
    embed = model.model.embed_tokens
    if name == "llama_tied" and packer == "native":  # one table: the head's packed copy
        assert model.lm_head.weight.numel() == 0 and embed.weight.numel() == 0
        assert embed.packed_weight is model.lm_head.packed_weight
        ids = torch.arange(tiny.hf_model.config.vocab_size)
        assert torch.equal(embed.packed_weight.rows(ids), tiny.hf_model.model.embed_tokens.weight)
    elif name == "llama_tied":  # oneDNN's packed copy is opaque: the embedding keeps its table
        assert model.lm_head.weight is embed.weight
        assert torch.equal(embed.weight, tiny.hf_model.model.embed_tokens.weight)
    else:
        assert model.lm_head.weight.numel() == 0
    # the packed model's logits equal HF's for one forward (greedy path, logprobs)
    prompt = [5, 9, 23, 41, 7]
    (out,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, logprobs=0),
                          use_tqdm=False)
    with torch.no_grad():
        hf_logits = tiny.hf_model(torch.tensor([prompt])).logits[0, -1]
    token = out.outputs[0].token_ids[0]
    assert token == int(hf_logits.argmax())
    hf_logprob = torch.log_softmax(hf_logits.double(), -1)[token].item()
    assert abs(out.outputs[0].logprobs[0][token].logprob - hf_logprob) < 1e-4


def test_prepack_skips_16_bit_and_non_gemm_modules():
    from torch import nn

    from kvflow.layers.linear import ReplicatedLinear

    model = nn.Sequential(ReplicatedLinear(8, 4), nn.LayerNorm(4))
    model[0].weight.data = torch.randn(4, 8).bfloat16()
    assert sum(prepack_gemm_weights(model, batch_hint=8).values()) == 0
    assert model[0].packed_weight is None and model[0].weight.shape == (4, 8)
