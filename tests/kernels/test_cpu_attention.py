"""The native CPU paged-attention kernel (kernels/csrc/cpu_attention.c) vs the plain-torch
per-request reference, and the "cpu" backend inside the engine vs the "torch" backend.

Tolerances: fp32 atol=rtol=1e-5 (fp32 accumulation in both; only summation order and the
kernel's exp polynomial, relative error ~2e-7, differ). bf16/fp16: the reference's fp32 result
rounded to the storage dtype, atol=rtol one unit in the last place of that dtype (2**-7 bf16,
2**-10 fp16), since both round an fp32 value once. bf16 prefill tiles on the bf16 dot-product
path (AVX512-BF16 builds) also round the softmax weights to bf16: :func:`bf16_dot_bound`.
"""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvflow.kernels.attention_ref import paged_attention_ref
from kvflow.kernels.cpu_native import native_cpu_kernels
from tests.kernels.paged_batch import attention_f64, make_batch

KERNELS = native_cpu_kernels()
pytestmark = pytest.mark.skipif(KERNELS is None, reason="native CPU kernels could not be built")

TOL = {torch.float32: {"atol": 1e-5, "rtol": 1e-5},
       torch.bfloat16: {"atol": 2**-7, "rtol": 2**-7},
       torch.float16: {"atol": 2**-10, "rtol": 2**-10}}
# (cached prefix, query length): decodes, whole prompts, chunks after a cached prefix, a query
# ending mid-block, one spanning many blocks.
MIXED = [(0, 1), (17, 1), (0, 37), (20, 5), (0, 1), (63, 40), (100, 1), (3, 16)]


# prefill tiles: bf16 dot products where the build and dtype allow, the widening register
# tiles, the row-by-row path
PATHS = {"dot": {"tiled": True, "bf16_dot": True}, "tiled": {"tiled": True, "bf16_dot": False},
         "rows": {"tiled": False, "bf16_dot": False}}


def bf16_dot_bound(batch, ref: torch.Tensor) -> torch.Tensor:
    """Bound on |out - ref| of the bf16 dot-product path: the output's final rounding to bf16
    (2^-9 |out|) plus the softmax weights' rounding to bf16 (each weight moves by <= 2^-9 of
    itself, so the weighted mean by <= 2^-9 max |v| over the values it mixes; here the whole
    cache's max), products exact in fp32 (bf16 x bf16); fp32 sums add ~K 2^-24. Each term
    doubled for margin."""
    vmax = batch["kv_cache"][1].float().nan_to_num(0.0).abs().max()
    return 2**-8 * ref.float().abs() + 2**-8 * vmax + 1e-6


def check(batch, sliding_window=None, tiled=True, bf16_dot=True, kernels=None):
    kernels = kernels or KERNELS
    n_real = int(batch["query_start_loc"][-1])
    ref = paged_attention_ref(**batch, sliding_window=sliding_window)
    out = kernels.paged_attention(batch["q"], batch["kv_cache"], batch["query_start_loc"],
                                  batch["seq_lens"], batch["block_table"], batch["scale"],
                                  sliding_window, tiled=tiled, bf16_dot=bf16_dot)
    assert out.shape == batch["q"].shape and out.dtype == batch["q"].dtype
    if batch["q"].dtype == torch.bfloat16 and tiled and bf16_dot:
        ref = paged_attention_ref(**dict(batch, q=batch["q"].float(),
                                         kv_cache=batch["kv_cache"].float()),
                                  sliding_window=sliding_window)
        err = (out[:n_real].float() - ref[:n_real]).abs()
        assert bool((err <= bf16_dot_bound(batch, ref[:n_real])).all()), float(err.max())
    else:
        torch.testing.assert_close(out[:n_real], ref[:n_real], **TOL[batch["q"].dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(4, 4, 64), (9, 3, 64),
                                                               (8, 1, 128), (6, 2, 20)])
@pytest.mark.parametrize("path", list(PATHS))
def test_mixed_batch_matches_reference(dtype, num_heads, num_kv_heads, head_dim, path):
    """Prefill tiles through the register-tiled path (head_dim % 16 == 0; 20 takes the row
    path either way) and through the row-by-row path."""
    check(make_batch(MIXED, num_heads, num_kv_heads, head_dim, dtype=dtype), **PATHS[path])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (5, 1, 48),
                                                               (12, 2, 80)])
def test_decode_batch_matches_reference(dtype, num_heads, num_kv_heads, head_dim):
    """A decode step of many requests (one query token each) through the vectorized decode
    path (head_dim % 16 == 0): contexts of 1-301 keys (four-key groups and their tails), GQA
    groups of 3, 5 (four heads, then one) and 6, head_dim 48 / 80 (16-column tails after 64)."""
    reqs = [(n, 1) for n in (0, 2, 3, 15, 16, 63, 128, 150, 191, 300)]
    check(make_batch(reqs, num_heads, num_kv_heads, head_dim, dtype=dtype, seed=3))


@pytest.mark.parametrize("window", [1, 5, 16, 33, 70])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("path", list(PATHS))
def test_sliding_window(window, dtype, path):
    reqs = [*MIXED, (90, 150)]  # a long chunk: windows inside and across 64-key super-blocks
    check(make_batch(reqs, 4, 2, 32, dtype=dtype, seed=1), sliding_window=window,
          **PATHS[path])


@pytest.mark.parametrize("block_size", [1, 3, 16, 32, 128])
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_sizes(block_size, path, dtype):
    """Super-blocks of the tiled path are whole blocks: 64 keys of 16-key blocks, 63 of 3-key
    ones (an odd count: the bf16 dot path's last key pair is padded), one 128-key block."""
    check(make_batch([*MIXED, (70, 100)], 4, 2, 16, block_size=block_size, dtype=dtype,
                     seed=2), **PATHS[path])


def test_bf16_dot_path_runs_where_the_build_has_it():
    """On the builds with AVX512-BF16 (avx512_bf16, amx_bf16) the dot-product tiles (bf16
    softmax weights) give other values than the widening tiles; every other build and dtype
    ignores ``bf16_dot``."""
    batch = make_batch([(0, 70), (40, 130)], 9, 3, 64, dtype=torch.bfloat16, seed=7)
    args = (batch["q"], batch["kv_cache"], batch["query_start_loc"], batch["seq_lens"],
            batch["block_table"], batch["scale"])
    dot = KERNELS.paged_attention(*args, bf16_dot=True)
    widened = KERNELS.paged_attention(*args, bf16_dot=False)
    assert torch.equal(dot, widened) == (KERNELS.isa not in ("avx512_bf16", "amx_bf16"))
    fp32 = {k: v.float() if v.is_floating_point() else v for k, v in batch.items()
            if isinstance(v, torch.Tensor)}
    args = (fp32["q"], fp32["kv_cache"], *args[2:])
    assert torch.equal(KERNELS.paged_attention(*args, bf16_dot=True),
                       KERNELS.paged_attention(*args, bf16_dot=False))


def test_bf16_dot_padding_keys_stay_hidden_under_a_window(kernels):
    """The bf16 dot-product tiles score keys 8 at a time, padding a super-block whose key count
    is not a multiple of 8 (here one 100-key block) with copies of its last key. Those copies
    were masked by their own positions, past the block: a query whose sliding window hides the
    block's last key (position 99 from the query at 109, window 10) still saw them, and that
    key's score (~40 |q|^2 / 8, hundreds above the query's visible scores) became its running
    max, so every weight underflowed and the output was 0 instead of its window's mean. Now
    padding keys are hidden from every row. At every ISA level (the dot tiles run in the
    avx512_bf16 build; other builds take the widening tiles), against the float64 oracle
    within :func:`bf16_dot_bound`."""
    batch = make_batch([(100, 16)], 2, 1, 64, block_size=100, dtype=torch.bfloat16, seed=11)
    phys = int(batch["block_table"][0, 0])  # the block of positions 0-99
    batch["kv_cache"][0, phys, 99, 0] = 40 * batch["q"][9, 0]  # the query at position 109
    ref = attention_f64(batch, sliding_window=10)
    out = kernels.paged_attention(batch["q"], batch["kv_cache"], batch["query_start_loc"],
                                  batch["seq_lens"], batch["block_table"], batch["scale"], 10,
                                  tiled=True, bf16_dot=True)
    err = (out.double() - ref).abs()
    assert bool((err <= bf16_dot_bound(batch, ref)).all()), float(err.max())


def test_padding_rows_and_strided_q():
    """q as a view of a wider qkv row (token stride > heads * head_dim), plus padding rows past
    the real tokens: the kernel reads only real rows through the stride."""
    batch = make_batch(MIXED, 4, 2, 16, extra_tokens=3, seed=3)
    qkv = torch.randn(batch["q"].shape[0], 4 * 16 + 2 * 2 * 16)
    qkv[:, :64] = batch["q"].reshape(-1, 64)
    batch["q"] = qkv[:, :64].view(-1, 4, 16)
    assert batch["q"].stride(0) == 128
    check(batch)


def test_bad_arguments_raise_value_error():
    batch = make_batch([(0, 3)], 4, 2, 16)
    good = {"q": batch["q"], "kv_cache": batch["kv_cache"],
            "query_start_loc": batch["query_start_loc"], "seq_lens": batch["seq_lens"],
            "block_table": batch["block_table"], "scale": 0.25}
    bad = [
        {"q": batch["q"].double()},                                      # dtype
        {"kv_cache": batch["kv_cache"].bfloat16()},                      # q/cache mismatch
        {"seq_lens": batch["seq_lens"].long()},                          # index dtype
        {"q": batch["q"].transpose(1, 2).contiguous().transpose(1, 2)},  # head_dim stride
        {"q": torch.randn(3, 3, 16)},                                    # 3 heads over 2 KV
        {"q": torch.randn(3, 4, 8)},                                     # head_dim mismatch
        {"query_start_loc": batch["query_start_loc"][:1]},               # too short
    ]
    for kwargs in bad:
        with pytest.raises(ValueError):
            KERNELS.paged_attention(**{**good, **kwargs})


def test_build_falls_back_when_disabled_or_no_compiler(monkeypatch, tmp_path):
    """KVFLOW_NATIVE_CPU=0 or a compiler that fails gives None (the torch backend is used)."""
    from kvflow.kernels import cpu_native
    from kvflow.worker.attention_backends import make_attention_backend

    monkeypatch.setenv("KVFLOW_CACHE_DIR", str(tmp_path))
    try:
        cpu_native.native_cpu_kernels.cache_clear()
        monkeypatch.setenv("KVFLOW_NATIVE_CPU", "0")
        assert cpu_native.native_cpu_kernels() is None
        assert make_attention_backend("cpu").name == "torch"
        cpu_native.native_cpu_kernels.cache_clear()
        monkeypatch.setenv("KVFLOW_NATIVE_CPU", "1")
        monkeypatch.setenv("CC", "/bin/false")
        assert cpu_native.native_cpu_kernels() is None
        assert not list(tmp_path.rglob("*.so"))
    finally:
        cpu_native.native_cpu_kernels.cache_clear()


@pytest.mark.parametrize("env, asked, off", [
    ({"KVFLOW_NATIVE_CPU": "1"}, "KVFLOW_NATIVE_CPU=1", ""),
    ({}, "KVFLOW_NATIVE_CPU unset (on by default)", ""),
    ({"KVFLOW_NATIVE_CPU": "1", "KVFLOW_CPU_ISA": "{level}", "KVFLOW_CPU_GEMM": "native"},
     "KVFLOW_NATIVE_CPU=1, KVFLOW_CPU_ISA={level}, KVFLOW_CPU_GEMM=native",
     (" (and unset KVFLOW_CPU_ISA, KVFLOW_CPU_GEMM, which need them), or unset "
      "KVFLOW_CPU_ISA to let kvflow try the other levels")),
], ids=["forced_on", "default", "level_and_gemm_forced"])
def test_a_failed_build_names_what_asked_for_it_and_how_to_turn_it_off(monkeypatch, caplog,
                                                                       tmp_path, env, asked,
                                                                       off):
    """The kernels forced on with a compiler that fails said only "native CPU kernels
    unavailable, using the torch backend": nothing named the variables that asked for them
    or how to run without them. Now the last warning names the compiler, the levels tried,
    each setting that asked (KVFLOW_NATIVE_CPU, a forced KVFLOW_CPU_ISA level, a kernel
    choice that needs them) and the switch that turns them off."""
    from kvflow.kernels import cpu_build, cpu_native

    level = cpu_build.isa_levels_for_cpu()[-1].name  # the baseline: one quick failed build
    monkeypatch.setenv("KVFLOW_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", "/bin/false")
    for name in ("KVFLOW_NATIVE_CPU", "KVFLOW_CPU_ISA", "KVFLOW_CPU_GEMM"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value.replace("{level}", level))
    levels = [level] if "KVFLOW_CPU_ISA" in env else \
        [lv.name for lv in cpu_build.isa_levels_for_cpu()]
    try:
        cpu_native.native_cpu_kernels.cache_clear()
        with caplog.at_level(logging.WARNING, logger="kvflow.kernels.cpu_native"):
            assert cpu_native.native_cpu_kernels() is None
    finally:
        cpu_native.native_cpu_kernels.cache_clear()
    assert caplog.records[-1].getMessage() == (
        f"kvflow's native CPU kernels did not build with /bin/false (for {', '.join(levels)}), "
        f"torch's kernels are used instead; asked for by {asked.replace('{level}', level)}: "
        f"set KVFLOW_NATIVE_CPU=0 to use torch's kernels without trying to build them{off}")


_CHECK_NATIVE = """
import torch
from kvflow.kernels.cpu_native import native_cpu_kernels
k = native_cpu_kernels()
x, w = torch.randn(3, 16), torch.rand(16) + 0.5
ref = w * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6))
print("OK" if k is not None and torch.allclose(k.rms_norm(x, w, 1e-6), ref, atol=1e-5) else "NONE")
"""


def _start_fresh_process(cache: Path, cc: Path | None = None) -> subprocess.Popen:
    """Start loading the kernels in a new interpreter (the dynamic loader of this one has the
    library mapped already) with ``cache`` as KVFLOW_CACHE_DIR (and ``cc`` as CC when given);
    :func:`_kernels_worked` reads its verdict. Several run at once: each rebuild is one
    single-threaded compile."""
    env = {**os.environ, "KVFLOW_CACHE_DIR": str(cache), **({"CC": str(cc)} if cc else {})}
    return subprocess.Popen([sys.executable, "-c", _CHECK_NATIVE], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _kernels_worked(proc: subprocess.Popen) -> bool:
    """True when the process of :func:`_start_fresh_process` loaded the kernels and they
    computed."""
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr[-2000:]  # e.g. not killed by SIGBUS
    return stdout.strip().splitlines()[-1:] == ["OK"]


def _seed_cache(cache: Path) -> Path:
    """Copy the library this process loaded, with its recorded digest, into the empty cache
    dir ``cache`` at the path a build there would write (same sources, flags and compiler:
    the name is their hash). Returns the copy's path."""
    from kvflow.kernels import cpu_build

    built = Path(KERNELS.lib._name)
    lib = cache / "kernels" / built.name
    lib.parent.mkdir(parents=True)
    lib.write_bytes(built.read_bytes())
    cpu_build.digest_path(lib).write_bytes(cpu_build.digest_path(built).read_bytes())
    return lib


def _copying_compiler(folder: Path) -> Path:
    """A CC for the rebuild of a damaged library: ``--version`` is the real compiler's (so the
    library's cached name is the same), and a build copies the library this process loaded to
    the ``-o`` target and logs its command line in ``folder``/cc.log, instead of compiling it
    again (each real compile takes ~17 s of CPU)."""
    from kvflow.kernels import cpu_native

    script = folder / "copying-cc"
    script.write_text(f"""#!/bin/sh
[ "$1" = --version ] && exec '{cpu_native._compiler()}' --version
echo "$@" >> '{folder / "cc.log"}'
while [ $# -gt 1 ]; do [ "$1" = -o ] && cp '{KERNELS.lib._name}' "$2"; shift; done
""")
    script.chmod(0o755)
    return script


def test_damaged_cached_library_is_rebuilt(monkeypatch, tmp_path):
    """A truncated library (would SIGBUS the loader) and a foreign one that lacks kvflow's
    symbols are rebuilt; a compiler that writes nothing means the torch fallback. Three cache
    dirs, one fresh process each, run side by side. Both rebuilds copy the loaded library
    (:func:`_copying_compiler`, each logging to its own folder): the real compile is what the
    first build of every run does already (~17 s of CPU each)."""
    from kvflow.kernels import cpu_build, cpu_native

    intact, truncated, foreign = (_seed_cache(tmp_path / name)  # as a first build leaves it
                                  for name in ("intact", "truncated", "foreign"))
    truncated.write_bytes(truncated.read_bytes()[:20000])  # the digest no longer matches
    foreign_c = tmp_path / "foreign.c"  # loads, digest recorded, but no kvflow symbols
    foreign_c.write_text("int kvflow_unrelated(void) { return 1; }\n")
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(foreign), str(foreign_c)], check=True)
    cpu_build.digest_path(foreign).write_text(hashlib.sha256(foreign.read_bytes()).hexdigest())
    logs = {name: tmp_path / f"cc-{name}" for name in ("truncated", "foreign")}
    for folder in logs.values():
        folder.mkdir()
    procs = [_start_fresh_process(lib.parent.parent, cc) for lib, cc in
             ((intact, None), (truncated, _copying_compiler(logs["truncated"])),
              (foreign, _copying_compiler(logs["foreign"])))]
    monkeypatch.setenv("KVFLOW_CACHE_DIR", str(tmp_path / "empty"))
    monkeypatch.setenv("CC", "/bin/true")  # "succeeds" without writing a library
    try:
        cpu_native.native_cpu_kernels.cache_clear()
        assert cpu_native.native_cpu_kernels() is None
    finally:
        cpu_native.native_cpu_kernels.cache_clear()
    assert [_kernels_worked(proc) for proc in procs] == [True, True, True]
    assert list((tmp_path / "intact").rglob("*.so")) == [intact]  # loaded without a build
    assert cpu_build.intact(truncated) and cpu_build.intact(foreign)
    assert b"kvflow_paged_attention" in foreign.read_bytes()
    # each damaged library's rebuild linked (once) the library of the cached path's name
    for name, lib in (("truncated", truncated), ("foreign", foreign)):
        assert (logs[name] / "cc.log").read_text().count(f"/{lib.name} ") == 1


def test_unwritable_cache_builds_the_kernels_in_a_temporary_folder(tmp_path):
    """A KVFLOW_CACHE_DIR that cannot hold the kernels (here a file where the folder should
    be; a read-only home or container is the same OSError) made every level's build fail:
    torch's kernels ran, under a warning that blamed the compiler and said to set
    KVFLOW_NATIVE_CPU=0. Now the kernels build in a temporary folder of the process (one
    build, by the copying compiler), load and compute RMSNorm as the formula does; one
    warning names the cache and KVFLOW_CACHE_DIR, and the folder is removed at exit."""
    blocker = tmp_path / "cache"
    blocker.write_text("")
    log = tmp_path / "cc"
    log.mkdir()
    proc = _start_fresh_process(blocker, _copying_compiler(log))
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr[-2000:]
    assert stdout.strip().splitlines()[-1:] == ["OK"], stderr[-2000:]
    assert stderr.count("cannot write the kernel cache") == 1, stderr[-2000:]
    assert f"cannot write the kernel cache {blocker / 'kernels'} (" in stderr
    assert "point KVFLOW_CACHE_DIR at a writable folder" in stderr
    assert "did not build" not in stderr
    folder = stderr.split("kernels in ", 1)[1].split(" for this process only")[0]
    links = [line for line in (log / "cc.log").read_text().splitlines() if "-shared" in line]
    assert len(links) == 1 and f" -o {folder}/" in links[0]
    assert not Path(folder).exists() and blocker.read_text() == ""


PROMPTS = [[(5 * i + 11 * j) % 250 + 1 for j in range(n)] for i, n in enumerate((3, 9, 21, 34))]
PROMPTS.append(PROMPTS[3][:32] + [7, 8])  # shares two full blocks with prompt 3



def _greedy_logprobs(path: str, backend: str):
    """Greedy tokens and their logprobs with chunked prefill (24-token budget: prefill chunks
    mixed with decodes) and a prefix-cache hit."""
    from kvflow import LLM, SamplingParams

    llm = LLM(model=path, dtype="float32", skip_tokenizer_init=True, num_kv_blocks=64,
              max_num_batched_tokens=24, max_num_seqs=8, attention_backend=backend,
              device="cpu")
    assert llm.engine.core.executor.runner.attn_ctx.backend.name == backend
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                                logprobs=0), use_tqdm=False)
    kv = llm.engine.core.kv_cache_manager
    kv.pool.check_invariants()
    assert kv.num_free_blocks == llm.engine.core.num_blocks - 1
    tokens = [o.outputs[0].token_ids for o in outs]
    logprobs = [[lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
                for o in outs]
    return tokens, torch.tensor(logprobs)


def test_engine_cpu_backend_matches_torch_backend(tiny_llama_path):
    tokens, logprobs = _greedy_logprobs(tiny_llama_path, "cpu")
    ref_tokens, ref_logprobs = _greedy_logprobs(tiny_llama_path, "torch")
    assert tokens == ref_tokens
    torch.testing.assert_close(logprobs, ref_logprobs, atol=1e-4, rtol=1e-4)


def test_cpu_defaults_native_backend_and_2048_token_budget(tiny_llama_path):
    """With nothing requested, a CPU engine picks the native backend and the CPU platform's
    2,048-token step budget; an explicit budget is kept."""
    from kvflow import LLM

    llm = LLM(model=tiny_llama_path, dtype="float32", skip_tokenizer_init=True, num_kv_blocks=16,
              device="cpu")
    assert llm.engine.core.executor.runner.attn_ctx.backend.name == "cpu"
    assert llm.engine.core.config.scheduler_config.max_num_batched_tokens == 2048
    llm = LLM(model=tiny_llama_path, dtype="float32", skip_tokenizer_init=True, num_kv_blocks=16,
              device="cpu", max_num_batched_tokens=100)
    assert llm.engine.core.config.scheduler_config.max_num_batched_tokens == 100


def test_out_of_range_indices_raise_instead_of_reading_outside():
    batch = make_batch([(0, 3), (5, 2)], 4, 2, 16)
    num_blocks = batch["kv_cache"].shape[1]
    cases = [
        ("block_table", batch["block_table"].clone().fill_(num_blocks)),     # id past the cache
        ("block_table", batch["block_table"].clone().fill_(-1)),             # negative id
        ("block_table", batch["block_table"][:, :0]),                        # row too short
        ("seq_lens", torch.tensor([2, 7], dtype=torch.int32)),               # query > context
        ("query_start_loc", torch.tensor([0, 3, 9], dtype=torch.int32)),     # past num_tokens
        ("query_start_loc", torch.tensor([1, 3, 5], dtype=torch.int32)),     # not from 0
    ]
    for name, value in cases:
        args = {**batch, name: value}
        with pytest.raises(ValueError):
            KERNELS.paged_attention(args["q"], args["kv_cache"], args["query_start_loc"],
                                    args["seq_lens"], args["block_table"], args["scale"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_store_kv_writes_what_index_copy_writes(kernels, dtype):
    """The C K/V store equals torch's index_copy_ through the slots, bitwise: k/v as views of a
    fused qkv row (token stride > Hkv * D), padding slots (-1) skipped, rows past num_tokens
    untouched; a slot past the cache raises and writes nothing. At every ISA level."""
    gen = torch.Generator().manual_seed(5)
    num_blocks, block_size, hkv, d, tokens = 6, 4, 3, 16, 9
    qkv = torch.randn(tokens + 2, (5 + 2 * hkv) * d, generator=gen).to(dtype)
    k = qkv[:, 5 * d:(5 + hkv) * d].view(-1, hkv, d)
    v = qkv[:, (5 + hkv) * d:].view(-1, hkv, d)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens + 2]
    slots[3] = -1
    cache = torch.randn(2, num_blocks, block_size, hkv, d, generator=gen).to(dtype)
    ref = cache.clone()
    keep = slots[:tokens] >= 0
    for i, x in enumerate((k, v)):
        ref[i].view(-1, hkv, d).index_copy_(0, slots[:tokens][keep], x[:tokens][keep])
    kernels.store_kv(k, v, cache, slots, tokens)
    assert torch.equal(cache, ref)
    bad = slots.clone()
    bad[5] = num_blocks * block_size
    before = cache.clone()
    with pytest.raises(ValueError, match="slots must lie below"):
        kernels.store_kv(k, v, cache, bad, tokens)
    assert torch.equal(cache, before)
    with pytest.raises(ValueError):
        kernels.store_kv(k.float() if dtype != torch.float32 else k.half(), v, cache, slots,
                         tokens)


def test_native_kernels_turned_off_choose_torch_without_a_warning(monkeypatch, caplog):
    """``KVFLOW_NATIVE_CPU=0`` asks for torch's kernels: the "cpu" backend falls back to
    the torch one with an INFO line naming the setting, not the warning a failed build gets
    (a newcomer read "unavailable" as a fault)."""
    import logging

    from kvflow.attention.torch_paged import TorchPagedAttentionBackend
    from kvflow.kernels.cpu_native import native_cpu_kernels
    from kvflow.worker.attention_backends import make_attention_backend

    monkeypatch.setenv("KVFLOW_NATIVE_CPU", "0")
    native_cpu_kernels.cache_clear()
    try:
        with caplog.at_level(logging.INFO, logger="kvflow.worker.attention_backends"):
            backend = make_attention_backend("cpu")
    finally:
        monkeypatch.delenv("KVFLOW_NATIVE_CPU")
        native_cpu_kernels.cache_clear()
    assert isinstance(backend, TorchPagedAttentionBackend)
    records = [(r.levelname, r.getMessage()) for r in caplog.records
               if r.name == "kvflow.worker.attention_backends"]
    expected = ("attention backend 'torch' (KVFLOW_NATIVE_CPU=0 turns kvflow's native CPU "
                "kernels off)")
    assert records == [("INFO", expected)]
