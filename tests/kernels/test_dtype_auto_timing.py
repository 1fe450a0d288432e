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
from kvflow.kernels.gemm_select import choose_dtype, head_candidates
from kvflow.kernels.gemm_timing import GemmShape, GemmTimings, clear_leader, settled
from kvflow.platforms import cpu as cpu_platform
from kvflow.platforms.cpu import CpuPlatform, x86_lacks_bf16_units

ICE_LAKE = frozenset({"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"})


def test_bf16_units_from_the_cpu_flags():
    """Ice Lake's flags (AVX512 without AVX512-BF16): no bf16 units; AVX512-BF16 (Zen 4/5) or
    AMX-BF16 (Sapphire Rapids): units; off x86 or with no flags known, oneDNN's answer
    stands (nothing ruled out)."""
    assert x86_lacks_bf16_units(ICE_LAKE, "x86_64")
    assert not x86_lacks_bf16_units(ICE_LAKE | {"avx512_bf16"}, "x86_64")
    assert not x86_lacks_bf16_units(ICE_LAKE | {"amx_bf16", "amx_tile"}, "AMD64")
    assert not x86_lacks_bf16_units(frozenset({"asimd", "bf16"}), "aarch64")
    assert not x86_lacks_bf16_units(frozenset(), "x86_64")


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN")
def test_auto_dtype_skips_bf16_timing_on_a_cpu_without_bf16_units(monkeypatch, caplog):
    """oneDNN says bf16 (it does on any AVX512 core); the flags say no units: ``--dtype auto``
    of a bf16 checkpoint is fp32 without timing anything (one INFO line says so), and oneDNN
    packs no bf16 weight.
    With AVX512-BF16 in the flags the timing decides, as before."""
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)
    monkeypatch.setattr(cpu_platform.platform, "machine", lambda: "x86_64")
    from kvflow.core.engine_dtype import resolve_dtype

    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, vocab_size=300)
    cfg.dtype = "bfloat16"
    asked = []
    measure = lambda d: asked.append(d) or torch.bfloat16
    monkeypatch.setattr(cpu_platform, "cpu_features", lambda: ICE_LAKE)
    platform = CpuPlatform()
    assert platform.default_dtype() == torch.float32
    assert not platform.prepacks_gemm_weights(torch.bfloat16)
    with caplog.at_level(logging.INFO, logger="kvflow.core.engine_dtype"):
        assert resolve_dtype("auto", cfg, platform, measure) == torch.float32 and not asked
    said = ("--dtype auto: torch.float32 (the checkpoint's torch.bfloat16 has no native matmul "
            "on this cpu; nothing timed)")
    assert [r.getMessage() for r in caplog.records] == [said]
    monkeypatch.setattr(cpu_platform, "cpu_features", lambda: ICE_LAKE | {"avx512_bf16"})
    assert platform.default_dtype() == torch.bfloat16
    assert resolve_dtype("auto", cfg, platform, measure) == torch.bfloat16
    assert asked == [torch.bfloat16]


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


def test_dtype_choice_counts_the_lm_head_at_its_rows(tmp_path):
    """Layers (32 x 16, 2 of them): bf16 1 / 3 / 5 s at 1 / 64 / 512 rows, fp32 2 / 1 / 5.
    The head (20,000 x 16, timed on 8,192 columns: x 2.44140625): bf16 native 1 s at 1 and 64
    rows, 100 s at 512 (a row count it never runs); fp32 3 s at 1 and 64, 1 s at 512.

    At the head's rows (1, 64): bf16 steps 4.44 / 8.44 / 10, fp32 11.32 / 9.32 / 10; relative
    sums 3 vs 2.55 + 1.10 + 1 = 4.65: bf16. Counting the head at 512 rows as well (the old
    estimate): bf16's 512-row step is 10 + 244 = 254 against fp32's 12.4, sums 22.4 vs 4.65:
    fp32. bf16's oneDNN head is never asked for (a 16-bit head runs native)."""
    secs = {}
    for dtype, times in {"bfloat16": (1.0, 3.0, 5.0), "float32": (2.0, 1.0, 5.0)}.items():
        secs.update({f"{dtype}|32x16|{c}|{r}": t for r, t in zip((1, 64, 512), times)
                     for c in ("native", "onednn")})
    secs.update({"bfloat16|8192x16|native|1": 1.0, "bfloat16|8192x16|native|64": 1.0,
                 "bfloat16|8192x16|native|512": 100.0})
    secs.update({f"float32|8192x16|{c}|{r}": t for r, t in ((1, 3.0), (64, 3.0), (512, 1.0))
                 for c in ("native", "onednn")})
    shapes = [(32, 16, 2), (20000, 16, 1)]
    both = ("native", "onednn")
    cands = {torch.bfloat16: both, torch.float32: both}
    assert choose_dtype(shapes, cands, _timings(tmp_path, secs), head_rows=(1, 64)) \
        == torch.bfloat16
    secs.update({f"bfloat16|8192x16|onednn|{r}": 1000.0 for r in (1, 64, 512)})
    assert choose_dtype(shapes, cands, _timings(tmp_path, secs)) == torch.float32


def test_head_candidates():
    assert head_candidates(torch.bfloat16, ("native", "onednn")) == ("native",)
    assert head_candidates(torch.float16, ("native",)) == ("native",)
    assert head_candidates(torch.bfloat16, ("onednn",)) == ("onednn",)
    assert head_candidates(torch.float32, ("native", "onednn")) == ("native", "onednn")
