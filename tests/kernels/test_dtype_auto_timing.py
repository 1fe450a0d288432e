"""``--dtype auto``'s first-start cost (issue 23): bf16 ruled out by the CPU's flags where it
has no bf16 units, the LM head counted at the rows it gets, compute-bound calls timed on a
column slice, and the timing passes stopping on a clear leader or once settled. Hand-made timings and a fake
clock: the expected choices and call counts are worked out in each test."""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import LlamaConfig

from kvflow.kernels import gemm_timing
from kvflow.kernels.cpu_native import native_cpu_kernels
from kvflow.kernels.gemm_select import choose_dtype, head_candidates, head_proxy
from kvflow.kernels.gemm_timing import GemmShape, clear_leader, settled
from kvflow.kernels.gemm_timing_cache import GemmTimings
from kvflow.platforms import cpu as cpu_platform
from kvflow.platforms.cpu import CpuPlatform, x86_lacks_bf16_units

ICE_LAKE = frozenset({"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"})
native = pytest.mark.skipif(native_cpu_kernels() is None, reason="no C compiler")


def test_bf16_units_from_the_cpu_flags():
    """Ice Lake's flags (AVX512 without AVX512-BF16): no bf16 units; AVX512-BF16 (Zen 4/5) or
    AMX-BF16 (Sapphire Rapids): units; off x86 or with no flags known, oneDNN's answer
    stands (nothing ruled out)."""
    assert x86_lacks_bf16_units(ICE_LAKE, "x86_64")
    assert not x86_lacks_bf16_units(ICE_LAKE | {"avx512_bf16"}, "x86_64")
    assert not x86_lacks_bf16_units(ICE_LAKE | {"amx_bf16", "amx_tile"}, "AMD64")
    assert not x86_lacks_bf16_units(frozenset({"asimd", "bf16"}), "aarch64")
    assert not x86_lacks_bf16_units(frozenset(), "x86_64")


def _no_bf16_units(monkeypatch, flags: frozenset[str] = ICE_LAKE) -> CpuPlatform:
    """A CPU platform whose oneDNN says bf16 (it does on any AVX512 core) and whose
    ``/proc/cpuinfo`` flags are ``flags`` (default Ice Lake's: no bf16 units)."""
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)
    monkeypatch.setattr(cpu_platform.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(cpu_platform, "cpu_features", lambda: flags)
    return CpuPlatform()


SMALL = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "vocab_size": 300}


def _timed(monkeypatch, factor: dict[int, float]) -> list[tuple[int, str, tuple[str, ...]]]:
    """``time_candidates`` and ``time_dtypes`` faked: fp32 takes 1 s x rows per column with
    either kernel, bf16 ``factor[rows]`` times that (kvflow's kernel; oneDNN's bf16, were it
    timed, 100x). Returns the (n, dtype, candidates) of each shape timed, and for a
    ``time_dtypes`` call the index of that call as a fourth item (-1 for ``time_candidates``):
    the dtypes of one call were timed together."""
    calls = []

    def per(shape, c, r):
        return (1.0 if shape.dtype == torch.float32 else
                factor[r] * (100 if c == "onednn" else 1)) * r * shape.n

    def fake(shape, cands, rows, kernels, call=-1):
        calls.append((shape.n, str(shape.dtype).removeprefix("torch."), tuple(cands), call))
        return {c: {r: per(shape, c, r) for r in rows} for c in cands}

    def fake_dtypes(by_shape, rows, kernels):
        call = len({i for *_, i in calls if i >= 0})
        return {s: fake(s, cands, rows, kernels, call) for s, cands in by_shape.items()}

    monkeypatch.setattr(gemm_timing, "time_candidates", fake)
    monkeypatch.setattr(gemm_timing, "time_dtypes", fake_dtypes)
    monkeypatch.setattr(gemm_timing, "time_candidate",
                        lambda shape, cand, rows, kernels: fake(shape, (cand,), rows, kernels)[cand])
    return calls


@native
@pytest.mark.parametrize("factor, expected", [
    ({1: 0.5, 64: 0.5, 2048: 0.5}, torch.bfloat16),  # bf16 faster at every class
    ({1: 2.0, 64: 2.0, 2048: 2.0}, torch.float32),  # bf16 slower at every class
    # relative sums bf16 1 + 1.1 + 1.3 = 3.4 against fp32 2 + 1 + 1 = 4: bf16
    ({1: 0.5, 64: 1.1, 2048: 1.3}, torch.bfloat16),
    # bf16 1 + 1.3 + 1.3 = 3.6 against fp32 1.5 + 1 + 1 = 3.5: fp32
    ({1: 1 / 1.5, 64: 1.3, 2048: 1.3}, torch.float32),
])
def test_auto_dtype_times_kvflows_bf16_on_a_cpu_without_bf16_units(tmp_path, monkeypatch,
                                                                    caplog, factor, expected):
    """Ice Lake (no bf16 units), kvflow's kernels built: ``--dtype auto`` of a bf16 checkpoint
    times kvflow's bf16 GEMM (never oneDNN's emulated bf16, which would lose 100x here) against
    fp32 with both kernels, at the engine's rows (1, 64, 2,048), and takes the faster, logged as
    any timed choice. Every shape scales alike, so each row class's step ratio is ``factor``'s
    (the expected dtypes worked out beside the cases). The LM head (300 columns) is estimated
    from gate/up, never timed."""
    from kvflow.config import DeviceConfig
    from kvflow.core.engine_dtype import cpu_dtype_measure, resolve_dtype

    monkeypatch.setenv("KVFLOW_CACHE_DIR", str(tmp_path))
    platform = _no_bf16_units(monkeypatch)
    calls = _timed(monkeypatch, factor)
    cfg = LlamaConfig(**SMALL)
    cfg.dtype = "bfloat16"
    measure = cpu_dtype_measure(platform, DeviceConfig(device="cpu"), cfg, 2048, 64)
    with caplog.at_level(logging.INFO, logger="kvflow.kernels.gemm_select"):
        assert resolve_dtype("auto", cfg, platform, measure) == expected
    assert {(d, c) for _, d, c, _ in calls} == {("bfloat16", ("native",)),
                                               ("float32", ("native", "onednn"))}
    # o, down, q/k/v, gate/up; not the head's 300; each shape's dtypes in one alternating call
    assert sorted(n for n, d, _, _ in calls if d == "bfloat16") == [64, 64, 192, 256]
    assert [(n, i) for n, _, _, i in calls] == [
        (n, i) for i, n in enumerate((192, 64, 256, 64)) for _ in range(2)]
    said = [r.getMessage() for r in caplog.records if r.name == "kvflow.kernels.gemm_select"]
    assert said == [f"--dtype auto: {expected} (GEMMs timed in torch.bfloat16 and torch.float32)"]


@native
@pytest.mark.parametrize("how", ["KVFLOW_NATIVE_CPU=0", "--cpu-gemm onednn"])
def test_auto_dtype_without_kvflows_gemm_is_fp32_untimed(monkeypatch, caplog, how):
    """No bf16 units and kvflow's GEMM off (its kernels disabled, or oneDNN asked for): bf16
    would run oneDNN's emulation, so ``--dtype auto`` is fp32 with nothing timed, one INFO line
    saying so."""
    from kvflow.config import DeviceConfig
    from kvflow.core.engine_dtype import cpu_dtype_measure, resolve_dtype
    from kvflow.kernels import cpu_native

    platform = _no_bf16_units(monkeypatch)
    calls = _timed(monkeypatch, {1: 0.5, 64: 0.5, 2048: 0.5})  # bf16 would win if timed
    cfg = LlamaConfig(**SMALL)
    cfg.dtype = "bfloat16"
    device = DeviceConfig(device="cpu", cpu_gemm="onednn" if how.startswith("--") else None)
    try:
        if how.startswith("KVFLOW"):
            cpu_native.native_cpu_kernels.cache_clear()
            monkeypatch.setenv("KVFLOW_NATIVE_CPU", "0")
        measure = cpu_dtype_measure(platform, device, cfg, 2048, 64)
        with caplog.at_level(logging.INFO, logger="kvflow.core.engine_dtype"):
            assert resolve_dtype("auto", cfg, platform, measure) == torch.float32
    finally:  # the kernels loaded again from the usual cache, for the tests after this one
        monkeypatch.delenv("KVFLOW_NATIVE_CPU", raising=False)
        cpu_native.native_cpu_kernels.cache_clear()
        cpu_native.native_cpu_kernels()
    assert calls == []
    said = ("--dtype auto: torch.float32 (the checkpoint's torch.bfloat16 has no native matmul "
            "on this cpu, nor kvflow's own GEMM for it; nothing timed)")
    assert [r.getMessage() for r in caplog.records if r.name == "kvflow.core.engine_dtype"] \
        == [said]


@native
def test_auto_dtype_with_bf16_units_times_both_kernels(tmp_path, monkeypatch):
    """AVX512-BF16 in the flags: bf16 is native, so it is timed with oneDNN too (here 100x
    slower than kvflow's, so kvflow's bf16 times decide: 0.5x fp32's, bf16), as before."""
    from kvflow.config import DeviceConfig
    from kvflow.core.engine_dtype import cpu_dtype_measure, resolve_dtype

    monkeypatch.setenv("KVFLOW_CACHE_DIR", str(tmp_path))
    platform = _no_bf16_units(monkeypatch, ICE_LAKE | {"avx512_bf16"})
    calls = _timed(monkeypatch, {1: 0.5, 64: 0.5, 2048: 0.5})
    cfg = LlamaConfig(**SMALL)
    cfg.dtype = "bfloat16"
    assert platform.default_dtype() == torch.bfloat16
    measure = cpu_dtype_measure(platform, DeviceConfig(device="cpu"), cfg, 2048, 64)
    assert resolve_dtype("auto", cfg, platform, measure) == torch.bfloat16
    assert {(d, c) for _, d, c, _ in calls} == {("bfloat16", ("native", "onednn")),
                                               ("float32", ("native", "onednn"))}


@native
def test_auto_dtype_cache_hit_times_nothing(tmp_path, monkeypatch):
    """The second start (timings cached in ``<cache_dir>/cpu_gemm``) times nothing and
    chooses the same; so does ``--cpu-gemm auto`` then, its bf16 layers having one kernel."""
    from kvflow.config import DeviceConfig
    from kvflow.core.engine_dtype import cpu_dtype_measure, resolve_dtype

    monkeypatch.setenv("KVFLOW_CACHE_DIR", str(tmp_path))
    platform = _no_bf16_units(monkeypatch)
    calls = _timed(monkeypatch, {1: 0.5, 64: 1.1, 2048: 1.3})
    cfg = LlamaConfig(**SMALL)
    cfg.dtype = "bfloat16"
    first = resolve_dtype("auto", cfg, platform,
                          cpu_dtype_measure(platform, DeviceConfig(device="cpu"), cfg, 2048, 64))
    assert first == torch.bfloat16 and len(calls) == 8  # 4 layer shapes x 2 dtypes
    calls.clear()
    again = resolve_dtype("auto", cfg, platform,
                          cpu_dtype_measure(platform, DeviceConfig(device="cpu"), cfg, 2048, 64))
    assert again == torch.bfloat16 and calls == []


def test_clear_leader():
    """1.4x ahead of the runner-up: clear at 1.3; 1.2x: not; the runner-up decides, not the
    slowest; one candidate, or a pass read as 0 s: never."""
    assert clear_leader({"native": 1.0, "onednn": 1.4})
    assert clear_leader({"native": 1.4, "onednn": 1.0})
    assert not clear_leader({"native": 1.0, "onednn": 1.2})
    assert clear_leader({"a": 1.0, "b": 1.31, "c": 5.0})
    assert not clear_leader({"a": 1.0, "b": 1.29, "c": 5.0})
    assert not clear_leader({"native": 1.0})
    assert not clear_leader({"native": 0.0, "onednn": 1.0})
    assert clear_leader({"native": 1.0, "onednn": 1.2}, ratio=1.1)


class FakeClock:
    """``time.process_time`` (and ``perf_counter``) advanced by the fake kernels' calls."""

    def __init__(self) -> None:
        self.now = 0.0

    def process_time(self) -> float:
        return self.now

    perf_counter = process_time  # GemmTimings' wall seconds spent timing


def _fake_kernels(monkeypatch, per_column: dict[str, list[float]]) -> list[tuple[str, int, int]]:
    """Fake ``_pack`` whose i-th call of a candidate advances a fake clock by
    ``per_column[candidate][i]`` (the last one from then on) x the columns of the weight
    packed; returns the (candidate, rows, columns) of each call."""
    clock, calls = FakeClock(), []

    def pack(cand, weight, kernels, copies):
        def call(x, cols=weight.shape[0]):
            costs = per_column[cand]
            done = sum(1 for c, _, _ in calls if c == cand)
            calls.append((cand, x.shape[0], cols))
            clock.now += costs[min(done, len(costs) - 1)] * cols
        return [call] * copies

    monkeypatch.setattr(gemm_timing, "_pack", pack)
    monkeypatch.setattr(gemm_timing, "time", clock)
    monkeypatch.setattr(gemm_timing, "timing_pool_bytes", lambda *a: 5 * 64 * 32 * 4)
    return calls


def test_settled_passes():
    """Two passes within 3%: settled; 5% apart: not; the two fastest count (a slow pass
    between them does not stop it); every candidate must be; one pass or a 0 s pass: not."""
    assert settled({"native": [20.0, 20.4]})
    assert not settled({"native": [20.0, 21.0]})
    assert settled({"native": [20.0, 30.0, 20.5], "onednn": [10.0, 10.1]})
    assert not settled({"native": [20.0, 20.4], "onednn": [10.0, 11.0]})
    assert not settled({"native": [20.0]})
    assert not settled({"native": [0.0, 0.0]})


# per call of each candidate: the warm-up call, then two calls (the 64-row class's two weight
# copies) per pass; a pass's time is its calls' mean
STEADY, NOISY = [1.0], [1.0, 1.0, 1.0, 1.5, 1.5, 1.0, 1.0]
NEVER = [1.0, 1.0, 1.0, 1.5, 1.5, 1.2, 1.2, 1.4, 1.4]


@pytest.mark.parametrize("native, onednn, passes", [
    (STEADY, [1.25], 2),  # both settled after 2 passes (no clear leader: 1.25x)
    (NOISY, [2.0], 2),  # 1.0 / 1.5 apart, but oneDNN 2x slower: a clear leader
    (NOISY, [1.25], 3),  # passes 1.0, 1.5, 1.0: settled at the third
    (NEVER, [1.25], gemm_timing.REPEATS),  # 1.0, 1.5, 1.2, 1.4: all four
])
def test_passes_stop_early(monkeypatch, native, onednn, passes):
    """The passes stop once a leader is clear or every candidate's passes are settled, after 2
    at least, 4 (REPEATS) at most: calls per candidate = 1 (warm-up) + 2 x passes. The time
    kept is the fastest pass's, 1.0 s (native) and oneDNN's per column, x 64 columns."""
    calls = _fake_kernels(monkeypatch, {"native": native, "onednn": onednn})
    got = gemm_timing.time_candidates(GemmShape(64, 32, torch.float32), ("native", "onednn"),
                                      (64,), None)
    assert got == {"native": {64: 64.0}, "onednn": {64: 64 * onednn[0]}}
    per_candidate = {c: sum(1 for cand, _, _ in calls if cand == c) for c in got}
    assert per_candidate == {"native": 1 + 2 * passes, "onednn": 1 + 2 * passes}


def test_compute_bound_calls_are_timed_on_a_column_slice(tmp_path, monkeypatch):
    """A 2,048 x 32 weight: at 64 rows timed on all 2,048 columns, at 1,024 rows on a
    512-column slice (COMPUTE_N) and scaled back by 2,048 / 512, so the seconds per call
    match the full weight's (2,048 columns x 1 s); the cache keys name the columns timed."""
    calls = _fake_kernels(monkeypatch, {"native": [1.0], "onednn": [1.0]})
    timings = GemmTimings(tmp_path / "t.json", None, (64, 1024))
    got = timings.get_all(GemmShape(2048, 32, torch.float32), ("native", "onednn"))
    assert got == {c: {64: 2048.0, 1024: 2048.0} for c in ("native", "onednn")}
    assert {cols for _, rows, cols in calls if rows == 1024} == {512}
    assert {cols for _, rows, cols in calls if rows == 64} == {2048}
    assert sorted(timings.seconds) == ["float32|2048x32|native|64", "float32|2048x32|onednn|64",
                                       "float32|512x32|native|1024", "float32|512x32|onednn|1024"]
    assert "512 columns from 1024 rows" in gemm_timing.timing_method(1 << 20, (64, 1024))


def _timings(tmp_path, seconds: dict[str, float]) -> GemmTimings:
    """Timings of ``seconds`` that refuse to measure anything else."""
    timings = GemmTimings(tmp_path / "t.json", None)
    timings.seconds = dict(seconds)
    timings.get = lambda shape, cand, rows=None: {
        r: timings.seconds[shape.key(cand, r)] * shape.n / shape.timed_cols(r)
        for r in (timings.rows if rows is None else rows)}
    return timings


def test_dtype_choice_counts_the_lm_head_at_its_rows_per_gate_up_column(tmp_path):
    """Layers (32 x 16, 2 of them): bf16 1 / 1.5 / 5 s at 1 / 64 / 512 rows, fp32 2 / 1 / 5.
    The head (20,000 x 16) has timings of its own (8,192-column slice, x 2.44140625): bf16
    1,000 s everywhere, fp32 1 s.

    At the head's rows (1, 64) its time is the layer's per column (same k: head_proxy) x 625:
    bf16 steps 2 + 625 = 627 / 3 + 937.5 = 940.5 / 10, fp32 4 + 1,250 = 1,254 / 2 + 625 = 627
    / 10; relative sums 1 + 1.5 + 1 = 3.5 against 2 + 1 + 1 = 4: bf16. Its own timings, were
    they read, give bf16 2 + 2,441 against fp32 4 + 2.44 at one row: fp32. Without head rows
    the head counts as a layer, with its own timings, at every class: bf16's 512-row step
    10 + 2,441 against fp32's 12.4, fp32 (per gate/up column it would be 3,135 both, and bf16
    3.5 against 4)."""
    secs = {}
    for dtype, times in {"bfloat16": (1.0, 1.5, 5.0), "float32": (2.0, 1.0, 5.0)}.items():
        secs.update({f"{dtype}|32x16|{c}|{r}": t for r, t in zip((1, 64, 512), times)
                     for c in ("native", "onednn")})
        secs.update({f"{dtype}|8192x16|{c}|{r}": 1000.0 if dtype == "bfloat16" else 1.0
                     for r in (1, 64, 512) for c in ("native", "onednn")})
    shapes = [(32, 16, 2), (20000, 16, 1)]
    assert head_proxy(shapes) == (32, 16)
    both = ("native", "onednn")
    cands = {torch.bfloat16: both, torch.float32: both}
    timings = _timings(tmp_path, secs)
    asked = []
    get_all = timings.get_all
    timings.get_all = lambda shape, *a: asked.append(shape.n) or get_all(shape, *a)
    assert choose_dtype(shapes, cands, timings, head_rows=(1, 64)) == torch.bfloat16
    assert set(asked) == {32}  # the head's own timings never read
    assert choose_dtype(shapes, cands, _timings(tmp_path, secs)) == torch.float32


def test_head_proxy_is_the_widest_layer_of_the_heads_k():
    """gate/up (3,072 x 576) for SmolLM2's head (k 576), not down (k 1,536); none of the k:
    None (the head is then timed itself)."""
    smollm2 = [(960, 576, 30), (576, 576, 30), (3072, 576, 30), (576, 1536, 30),
               (49152, 576, 1)]
    assert head_proxy(smollm2) == (3072, 576)
    assert head_proxy([(576, 1536, 30), (49152, 576, 1)]) is None


def test_dtype_choice_weighs_step_graphs_as_the_kernel_choice_does(tmp_path):
    """One layer (32 x 16; the head 64 x 16 at one row, per layer column: x 2). fp32: kvflow
    1.1 s at 1 and 64 rows, oneDNN 0.98 (1.12x faster, under GRAPH_MARGIN's 1.18x), both 1.0 at
    512; bf16 (kvflow only) 1.05 / 1.05 / 1.0.

    Without graphs fp32 takes oneDNN's 0.98: steps fp32 2.94 / 0.98 / 1 against bf16 3.15 /
    1.05 / 1, relative sums 3 against 3.14: fp32. With graphs oneDNN counts 0.98 x 1.179 =
    1.156 > 1.1 at decode rows (--cpu-gemm auto would give fp32 kvflow's GEMM): fp32 3.3 /
    1.1 / 1 against bf16 3.15 / 1.05 / 1, sums 3.095 against 3: bf16."""
    secs = {"float32|32x16|native|1": 1.1, "float32|32x16|native|64": 1.1,
            "float32|32x16|onednn|1": 0.98, "float32|32x16|onednn|64": 0.98,
            "float32|32x16|native|512": 1.0, "float32|32x16|onednn|512": 1.0,
            "bfloat16|32x16|native|1": 1.05, "bfloat16|32x16|native|64": 1.05,
            "bfloat16|32x16|native|512": 1.0}
    shapes = [(32, 16, 1), (64, 16, 1)]
    cands = {torch.bfloat16: ("native",), torch.float32: ("native", "onednn")}
    assert choose_dtype(shapes, cands, _timings(tmp_path, secs), (1,)) == torch.float32
    assert choose_dtype(shapes, cands, _timings(tmp_path, secs), (1,), graphs=True) \
        == torch.bfloat16


def test_candidates_timed_together_share_the_one_row_pool():
    """A 96 MiB pool (twice a 48 MiB L3): SmolLM2's 960 x 576 fp32 weight (2,211,840 bytes)
    has 45 copies for one kernel, 22 each for two (their passes alternate, so a copy's reuse
    distance is still 96 MiB), 15 for three; 2 at least, MAX_COPIES at most; the timing method
    (the cache key) says so."""
    pool, weight = 96 << 20, 960 * 576 * 4
    assert [gemm_timing.pool_copies(pool, weight, c) for c in (1, 2, 3)] == [45, 22, 15]
    assert gemm_timing.pool_copies(pool, 60 << 20, 2) == 2
    assert gemm_timing.pool_copies(pool, 1024, 1) == gemm_timing.MAX_COPIES
    assert "pool shared" in gemm_timing.timing_method(pool)


def test_get_all_times_only_the_rows_missing(tmp_path, monkeypatch):
    """At 1,024 rows 2,048 x 32 and 1,024 x 32 are both timed on the same 512-column slice
    (one key): the second shape is timed at 64 rows only."""
    timed = []

    def fake(shape, cands, rows, kernels):
        timed.append((shape.n, tuple(rows)))
        return {c: {r: 1.0 for r in rows} for c in cands}

    monkeypatch.setattr(gemm_timing, "time_candidates", fake)
    timings = GemmTimings(tmp_path / "t.json", None, (64, 1024))
    for n in (2048, 1024):
        got = timings.get_all(GemmShape(n, 32, torch.float32), ("native", "onednn"))
        assert got == {c: {64: 1.0, 1024: n / 512} for c in ("native", "onednn")}
    assert timed == [(2048, (64, 1024)), (1024, (64,))]


def test_head_candidates():
    assert head_candidates(torch.bfloat16, ("native", "onednn")) == ("native",)
    assert head_candidates(torch.float16, ("native",)) == ("native",)
    assert head_candidates(torch.bfloat16, ("onednn",)) == ("onednn",)
    assert head_candidates(torch.float32, ("native", "onednn")) == ("native", "onednn")


def test_dtypes_of_one_shape_alternate_in_one_call(monkeypatch):
    """bf16 (kvflow's GEMM) and fp32 (kvflow's, oneDNN's) of one 64 x 32 weight timed by one
    ``time_dtypes`` call: the warm-up calls, then each pass of each (dtype, kernel) pair in
    turn (bf16, fp32 kvflow, fp32 oneDNN, bf16, ...), two weight copies a pass at 64 rows,
    each pair's calls on its own dtype's operand. Fake clock: bf16 0.5 s per column, fp32 1.0
    (kvflow) and 2.0 (oneDNN): a clear leader after two passes."""
    calls = _fake_kernels(monkeypatch, {"native": [1.0], "onednn": [2.0]})
    clock = gemm_timing.time
    order = []
    real_pack = gemm_timing._pack

    def pack(cand, weight, kernels, copies):
        fns = real_pack(cand, weight, kernels, copies)
        half = weight.dtype == torch.bfloat16
        dtype = str(weight.dtype).removeprefix("torch.")

        def call(x, fn=fns[0]):
            assert x.dtype == weight.dtype
            order.append((dtype, cand))
            before = clock.now
            fn(x)
            clock.now = before + (clock.now - before) * (0.5 if half else 1.0)
        return [call] * copies

    monkeypatch.setattr(gemm_timing, "_pack", pack)
    bf16, fp32 = GemmShape(64, 32, torch.bfloat16), GemmShape(64, 32, torch.float32)
    got = gemm_timing.time_dtypes({bf16: ("native",), fp32: ("native", "onednn")}, (64,), None)
    assert got == {bf16: {"native": {64: 32.0}}, fp32: {"native": {64: 64.0},
                                                        "onednn": {64: 128.0}}}
    turn = [("bfloat16", "native"), ("float32", "native"), ("float32", "onednn")]
    assert order == turn + [p for p in turn for _ in range(2)] * 2
    assert {cols for _, _, cols in calls} == {64}
    # one row: one pool for the three pairs, 5 x 64 x 32 x 4 bytes (the faked pool) over
    # 64 x 32 x (2 + 4 + 4) bytes = 2 copies each (bf16's own pool would hold 10): a warm-up
    # and two passes of 2 calls
    order.clear()
    gemm_timing.time_dtypes({bf16: ("native",), fp32: ("native", "onednn")}, (1,), None)
    assert {p: order.count(p) for p in turn} == dict.fromkeys(turn, 1 + 2 * 2)
    with pytest.raises(ValueError, match="one n x k"):
        gemm_timing.time_dtypes({bf16: ("native",), GemmShape(32, 32, torch.float32):
                                 ("native",)}, (64,), None)


def test_large_calls_run_two_passes_without_a_warm_up(monkeypatch):
    """From ONE_COPY_MIN_ROWS rows: no warm-up call and two passes (LARGE_REPEATS) of one
    call, even when they neither settle nor show a clear leader (1.0 / 1.5 s per column:
    before, a warm-up and four passes); the fastest pass is kept. Below, the warm-up and
    passes of before (64 rows: the noisy passes settle at the third, 1 + 2 x 3 calls)."""
    noisy = [1.5, 1.0, 1.0, 1.0, 1.5, 1.5, 1.0]
    calls = _fake_kernels(monkeypatch, {"native": noisy, "onednn": [1.25]})
    shape = GemmShape(64, 32, torch.float32)
    got = gemm_timing.time_candidates(shape, ("native", "onednn"), (1024,), None)
    assert got == {"native": {1024: 64.0}, "onednn": {1024: 80.0}}
    assert [(c, rows) for c, rows, _ in calls] == [
        ("native", 1024), ("onednn", 1024), ("native", 1024), ("onednn", 1024)]
    assert gemm_timing.repeats_at(1024) == (False, 2) and gemm_timing.repeats_at(64) == (True, 4)
    assert "2 passes, no warm-up from 1024 rows" in gemm_timing.timing_method(1 << 20)
