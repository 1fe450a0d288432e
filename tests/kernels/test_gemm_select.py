"""Per-CPU GEMM kernel choice (``--cpu-gemm auto``): the choice rule on hand-made timings, the
timings cache (measured once, then read back), the dtype chosen for ``--dtype auto`` from the
model's GEMM shapes, and an engine whose every GEMM kernel was picked by timing still matching
HF transformers."""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import LlamaConfig, MixtralConfig

from kvflow import LLM, SamplingParams
from kvflow.config import EngineConfig, cpu_gemm_choice
from kvflow.kernels import gemm_select, gemm_timing
from kvflow.kernels.cpu_native import native_cpu_kernels
from kvflow.kernels.gemm import (
    NativePackedWeight,
    OneDnnPackedWeight,
    RowSplitWeight,
    prepack_gemm_weights,
)
from kvflow.kernels.gemm_select import (
    KernelSplit,
    best_candidate,
    candidates_for,
    choose,
    choose_dtype,
    graph_margin,
    graph_margins,
    graph_weighted,
    model_graph_margins,
    row_class_winners,
    split_candidate,
    transformer_gemm_shapes,
)
from kvflow.kernels.gemm_timing import ROW_CLASSES, GemmShape, row_classes, time_candidate
from kvflow.kernels.gemm_timing_cache import GemmTimings, gemm_timings

native = pytest.mark.skipif(native_cpu_kernels() is None, reason="no C compiler")


def test_best_candidate_sums_relative_times():
    # native: 2x faster at 1 row, 1.5x slower at 64 rows, level at 512 -> 1 + 1.5 + 1 = 3.5
    # vs 2 + 1 + 1 = 4; at 2.25x slower at 64 rows 1 + 2.25 + 1 = 4.25 vs 4
    fast = {"onednn": {1: 2.0, 64: 4.0, 512: 30.0}}
    assert best_candidate({"native": {1: 1.0, 64: 6.0, 512: 30.0}, **fast}) == "native"
    assert best_candidate({"native": {1: 1.0, 64: 9.0, 512: 30.0}, **fast}) == "onednn"
    # the prefill class counts as much: 2x faster at 1 row, level at 64, 2.5x slower at 512
    assert best_candidate({"native": {1: 1.0, 64: 4.0, 512: 75.0}, **fast}) == "onednn"


def test_split_where_the_fastest_changes_once():
    """native fastest at 1 and 64 rows, oneDNN at 512: split at sqrt(64 * 512) = 181 rows;
    a change between 1 and 64 splits at 8; one winner everywhere, or two changes, no split."""
    onednn = {1: 2.0, 64: 4.0, 512: 30.0}
    assert split_candidate({"native": {1: 1.0, 64: 3.0, 512: 40.0}, "onednn": onednn}) == \
        KernelSplit("native", "onednn", 181)
    assert split_candidate({"native": {1: 3.0, 64: 3.0, 512: 20.0}, "onednn": onednn}) == \
        KernelSplit("onednn", "native", 8)
    assert split_candidate({"native": {1: 1.0, 64: 3.0, 512: 20.0}, "onednn": onednn}) is None
    assert split_candidate({"native": {1: 1.0, 64: 5.0, 512: 20.0}, "onednn": onednn}) is None
    assert str(KernelSplit("native", "onednn", 181)) == "native<=181/onednn"


def test_a_near_tie_keeps_the_smaller_row_class_winner():
    """The EPYC's q/k/v timings (ms, one thread): native wins 1 row, oneDNN is 1.4% faster at
    64 (a tie within 10%): native keeps 64 rows, the split moves from 8 to 181 rows; 12%
    apart oneDNN takes 64 rows; a 2.5% lead at 512 (prefill) rows still goes to oneDNN."""
    onednn = {1: 0.120, 64: 0.354, 512: 2.917}
    tie = {"native": {1: 0.074, 64: 0.359, 512: 2.99}, "onednn": onednn}
    assert row_class_winners(tie) == ["native", "native", "onednn"]
    assert split_candidate(tie) == KernelSplit("native", "onednn", 181)
    apart = {"native": {1: 0.074, 64: 0.354 * 1.12, 512: 3.1}, "onednn": onednn}
    assert row_class_winners(apart) == ["native", "onednn", "onednn"]
    assert split_candidate(apart) == KernelSplit("native", "onednn", 8)


# the quiet Zen 5 EPYC's fp32 timings (ms, one thread, at 1 / 64 / 512 rows) of SmolLM2's
# gate_up 3072 x 576 (docs/benchmarks.md, session 35): oneDNN 1.12x faster at one row alone
ZEN5_GATE_UP = {"native": {1: 0.241, 64: 0.893, 512: 7.00},
                "onednn": {1: 0.215, 64: 0.999, 512: 7.01}}


def test_graph_margin_follows_from_the_measured_step_graph_saving():
    """Eager decode steps 10% longer than replayed ones, GEMMs 60% of an eager step: oneDNN
    must cut the decode GEMMs by more than 0.10 / (0.60 * 1.10) = 1/6.6, i.e. be faster by
    1 / (1 - 1/6.6) = 6.6 / 5.6 = 1.17857x."""
    assert gemm_select.GRAPH_MARGIN == pytest.approx(6.6 / 5.6 - 1, rel=1e-12)


def test_graph_weighted_charges_the_unreplayable_kernel_at_decode_rows():
    """oneDNN's times at 1 and 64 rows grow by 6.6/5.6 (0.215 -> 0.253393, 0.999 ->
    1.177393), its 512-row time and native's stay; with no replayable candidate nothing
    changes."""
    got = graph_weighted(ZEN5_GATE_UP)
    assert got["native"] == ZEN5_GATE_UP["native"]
    assert got["onednn"][1] == pytest.approx(0.215 * 6.6 / 5.6)
    assert got["onednn"][64] == pytest.approx(0.999 * 6.6 / 5.6)
    assert got["onednn"][512] == 7.01
    assert graph_weighted({"onednn": ZEN5_GATE_UP["onednn"]}) == \
        {"onednn": ZEN5_GATE_UP["onednn"]}


def test_a_near_tie_at_decode_rows_keeps_the_step_graph(tmp_path):
    """The Zen 5 gate_up timings: by time alone oneDNN wins (relative sums 1 + 1.1187 + 1.0014
    = 3.1201 against 1.1209 + 1 + 1 = 3.1209; split: oneDNN at 1 row, native from 64, a split
    at 8 rows), and either loses the step graph at the decode batches oneDNN takes. Weighted
    for graphs (oneDNN 0.2534 / 1.1774 / 7.01) native wins every class: no split, native."""
    shape = GemmShape(3072, 576, torch.float32)
    timings = _fake_timings(tmp_path, {shape.key(c, r): t for c, times in ZEN5_GATE_UP.items()
                                       for r, t in times.items()})
    cands = ("native", "onednn")
    assert choose(shape, cands, timings) == "onednn"
    assert choose(shape, cands, timings, split=True) == KernelSplit("onednn", "native", 8)
    assert choose(shape, cands, timings, graphs=True) == "native"
    assert choose(shape, cands, timings, split=True, graphs=True) == "native"
    assert choose(shape, ("onednn",), timings, split=True, graphs=True) == "onednn"


def test_a_clear_decode_win_still_goes_to_onednn():
    """The q/k/v "apart" timings of test_a_near_tie_keeps_the_smaller_row_class_winner: oneDNN
    1.12x faster at 64 rows takes them by time alone, but not for graphs (0.354 * 6.6/5.6 =
    0.4172 > 0.3965): the split moves to 181 rows. 1.4x faster it takes 64 rows for graphs
    too (native 0.4956 > 0.4172 * 1.1 = 0.4589: the decode tie margin applies on top)."""
    onednn = {1: 0.120, 64: 0.354, 512: 2.917}
    apart = {"native": {1: 0.074, 64: 0.354 * 1.12, 512: 3.1}, "onednn": onednn}
    assert split_candidate(graph_weighted(apart)) == KernelSplit("native", "onednn", 181)
    clear = {"native": {1: 0.074, 64: 0.354 * 1.4, 512: 3.1}, "onednn": onednn}
    assert row_class_winners(graph_weighted(clear)) == ["native", "onednn", "onednn"]
    assert split_candidate(graph_weighted(clear)) == KernelSplit("native", "onednn", 8)


def test_graph_margin_from_the_host_time_replay_saves():
    """margin = 1 / (1 - r) - 1 with r = host * threads / GEMM seconds (hand-computed: r = 0.1
    -> 1/9, r = 0.4 -> 2/3, r = 0.5 -> 1); from r = 1 nothing pays (infinite); the Zen 5
    constants' r = 1/6.6 gives GRAPH_MARGIN; bad input is a ValueError naming the function."""
    assert graph_margin(0.1, 1.0, 1) == pytest.approx(1 / 9)
    assert graph_margin(0.4, 1.0, 1) == pytest.approx(2 / 3)
    assert graph_margin(0.25, 1.0, 2) == pytest.approx(1.0)  # serial host work, 2 GEMM threads
    assert graph_margin(0.0, 1.0, 1) == 0.0
    assert graph_margin(1.0, 1.0, 1) == math.inf and graph_margin(0.6, 1.0, 2) == math.inf
    assert graph_margin(1 / 6.6, 1.0, 1) == pytest.approx(gemm_select.GRAPH_MARGIN)
    for bad in ((-0.1, 1.0, 1), (0.1, 0.0, 1), (0.1, 1.0, 0)):
        with pytest.raises(ValueError, match="graph_margin"):
            graph_margin(*bad)


def test_graph_margins_scale_this_cpus_eager_call_to_the_models_step():
    """121 GEMM modules x EAGER_CALLS_PER_GEMM (25) x 9.4 us = 28.435 ms of host work on 2
    threads: against 55 ms of GEMMs at one row r = 1.034 (infinite), against 153 ms at 64
    rows r = 0.3717 -> 1 / 0.6283 - 1 = 0.5916; the prefill class gets none."""
    assert gemm_select.EAGER_CALLS_PER_GEMM == 25
    got = graph_margins({1: 0.055, 64: 0.153, 2048: 4.0}, 121, 9.4e-6, 2)
    assert got.keys() == {1, 64}
    assert got[1] == math.inf
    assert got[64] == pytest.approx(1 / (1 - 121 * 25 * 9.4e-6 * 2 / 0.153) - 1)
    assert got[64] == pytest.approx(0.5916, abs=1e-4)
    with pytest.raises(ValueError, match="modules"):
        graph_margins({1: 0.055}, 0, 9.4e-6, 2)


# oneDNN 1.2x faster than native at the decode classes (ms per call), 1.03x at prefill rows
DECODE_LEAD = {"native": {1: 1.2e-3, 64: 2.4e-3, 512: 16.5e-3},
               "onednn": {1: 1.0e-3, 64: 2.0e-3, 512: 16e-3}}


@pytest.mark.parametrize(("host_share", "kernel", "split"), [
    (0.4, "native", KernelSplit("native", "onednn", 181)), (0.1, "onednn", "onednn")])
def test_replay_saving_of_this_cpu_decides_a_decode_lead(tmp_path, host_share, kernel, split):
    """A model of 10 such GEMM modules, one thread: its one-row GEMMs take 12 ms. A CPU whose
    eager step spends 40% of that (4.8 ms: eager call 4.8 ms / (10 x 25) = 19.2 us) on host
    work a replayed step saves: r = 0.4 at 1 row (margin 2/3: oneDNN counts 1.667 > 1.2) and
    4.8 / 24 = 0.2 at 64 rows (margin 1/4: 2.5 > 2.4): native at the decode classes, the step
    graph kept (relative sums native 1 + 1 + 1.031 against 1.389 + 1.042 + 1; split: native
    up to sqrt(64 * 512) = 181 rows). A CPU where it spends 10% (1.2 ms, 4.8 us): margins
    1/9 (1.111 < 1.2) and 1/19 (2.105 < 2.4): oneDNN's lead pays for the lost graph
    (native 1.08 + 1.14 + 1.031 against 3), oneDNN at every class. The fixed GRAPH_MARGIN
    (1.18x) gave oneDNN both."""
    shape = GemmShape(3072, 576, torch.float32)
    call_s = host_share * 10 * 1.2e-3 / (10 * gemm_select.EAGER_CALLS_PER_GEMM)
    timings = _fake_timings(tmp_path, {
        gemm_timing.EAGER_CALL_KEY: call_s,
        **{shape.key(c, r): t for c, times in DECODE_LEAD.items() for r, t in times.items()}})
    cands = ("native", "onednn")
    margins = model_graph_margins([(shape, None)] * 10, cands, timings, threads=1)
    assert margins == pytest.approx({1: 1 / (1 - host_share) - 1,
                                     64: 1 / (1 - host_share / 2) - 1})
    assert choose(shape, cands, timings, graphs=True, margins=margins) == kernel
    assert choose(shape, cands, timings, split=True, graphs=True, margins=margins) == split
    assert choose(shape, cands, timings, graphs=True) == "onednn"  # GRAPH_MARGIN: 1.18x
    assert choose(shape, cands, timings, graphs=False, margins=margins) == "onednn"


def test_model_graph_margins_count_each_row_class_modules(tmp_path):
    """An LM head timed at one row only counts there: at 1 row 2 modules, 1 + 4 ms of GEMMs,
    host 2 x 25 x 20 us = 1 ms, r = 0.2 -> 0.25; at 64 rows only the layer (1 module,
    0.5 ms host, 10 ms): r = 0.05 -> 1/19. Nothing to weigh without native or a second
    candidate, or without modules: None."""
    layer, head = GemmShape(64, 64, torch.float32), GemmShape(8192, 64, torch.float32)
    secs = {gemm_timing.EAGER_CALL_KEY: 20e-6}
    for c in ("native", "onednn"):
        secs.update({layer.key(c, 1): 1e-3, layer.key(c, 64): 10e-3, layer.key(c, 512): 0.1,
                     head.key(c, 1): 4e-3})
    timings = _fake_timings(tmp_path, secs)
    cands = ("native", "onednn")
    got = model_graph_margins([(layer, None), (head, (1,))], cands, timings, threads=1)
    assert got == pytest.approx({1: 0.25, 64: 1 / 19})
    assert model_graph_margins([(layer, None)], ("onednn",), timings, 1) is None
    assert model_graph_margins([(layer, None)], ("native",), timings, 1) is None
    assert model_graph_margins([], cands, timings, 1) is None


@native
def test_eager_call_is_timed_once_then_cached(tmp_path, monkeypatch):
    """This CPU's eager tiny-GEMM call is measured (a positive CPU time under a millisecond:
    host work, the product is 2,048 FLOPs) on the first ask, saved with the GEMM timings and
    read back without measuring again; without kvflow's kernels it is a ValueError."""
    path = tmp_path / "t.json"
    timings = GemmTimings(path, native_cpu_kernels())
    first = timings.eager_call_seconds()
    assert 0 < first < 1e-3
    timings.save()
    assert json.loads(path.read_text())[gemm_timing.EAGER_CALL_KEY] == first
    monkeypatch.setattr(gemm_timing, "eager_call_seconds", lambda kernels: pytest.fail("timed"))
    assert GemmTimings(path, native_cpu_kernels()).eager_call_seconds() == first
    with pytest.raises(ValueError, match="native kernels"):
        GemmTimings(tmp_path / "none.json", None).eager_call_seconds()


def test_prefill_class_is_timed_at_the_engines_prefill_rows():
    """The prefill class is the step budget (max_num_batched_tokens, the rows of a prefill
    chunk) within [128, 2048]; unknown: the default 512."""
    assert row_classes(2048) == (1, 64, 2048)
    assert row_classes(1024) == (1, 64, 1024)
    assert row_classes(8192) == (1, 64, gemm_timing.PREFILL_ROWS_MAX) == (1, 64, 2048)
    assert row_classes(16) == (1, 64, gemm_timing.PREFILL_ROWS_MIN) == (1, 64, 128)
    assert row_classes(None) == ROW_CLASSES == (1, 64, 512)


# Session 50's Zen 5 bf16 q/k/v (960 x 576, 8-row micro-kernels, ms, one thread): the C GEMM
# 1.43 at 512 rows against oneDNN's 1.46, oneDNN 5.26 at 2,048 against the C GEMM's 5.69
ZEN5_QKV_BF16 = {"native": {1: 0.012, 64: 0.187, 512: 1.43, 2048: 5.69},
                 "onednn": {1: 0.015, 64: 0.205, 512: 1.46, 2048: 5.26}}


def test_prefill_class_goes_to_the_kernel_faster_at_the_engines_rows(tmp_path, monkeypatch):
    """With an injected timer holding ZEN5_QKV_BF16: timed at 512 rows the C GEMM wins every
    class (prefill too); timed at the engine's 2,048 rows oneDNN takes the prefill class, a
    split at sqrt(64 * 2048) = 362 rows. Only the engine's row classes are timed."""
    timed = []

    def fake(shape, cands, rows, kernels):
        timed.extend(rows)
        return {c: {r: ZEN5_QKV_BF16[c][r] for r in rows} for c in cands}

    monkeypatch.setattr(gemm_timing, "time_candidates", fake)
    shape, cands = GemmShape(960, 576, torch.bfloat16), ("native", "onednn")
    at_512 = GemmTimings(tmp_path / "a.json", None, row_classes(None))
    assert choose(shape, cands, at_512, split=True) == "native"
    at_engine = GemmTimings(tmp_path / "b.json", None, row_classes(2048))
    assert choose(shape, cands, at_engine, split=True) == KernelSplit("native", "onednn", 362)
    assert choose(shape, cands, at_engine, split=True, graphs=True) == \
        KernelSplit("native", "onednn", 362)
    assert timed == [1, 64, 512, 1, 64, 2048]


def test_timings_cache_key_changes_with_the_prefill_rows(tmp_path, monkeypatch):
    """Timings at another prefill class live in another file (and its own row classes)."""
    monkeypatch.setenv("KVFLOW_CACHE_DIR", str(tmp_path))
    paths = {rows: gemm_timings(None, row_classes(rows)).path for rows in (None, 1024, 2048)}
    assert len(set(paths.values())) == 3
    assert all(p.parent == tmp_path / "cpu_gemm" for p in paths.values())
    assert gemm_timings(None, row_classes(2048)).path == paths[2048]  # stable
    assert gemm_timings(None, row_classes(2048)).rows == (1, 64, 2048)


def test_step_graphs_expected_follows_the_config(monkeypatch):
    """Off with each setting under which make_graph_runner gives a CPU engine no step graph."""
    from kvflow.worker.step_graphs import cpu_step_graphs_expected

    # the configs are only built, never run: with KVFLOW_NATIVE_CPU=0 (the suite's other
    # mode) DeviceConfig would refuse cpu_gemm_pool=True before the function is asked
    monkeypatch.setenv("KVFLOW_NATIVE_CPU", "1")
    assert cpu_step_graphs_expected(EngineConfig.from_kwargs())
    for off in ({"enforce_eager": True}, {"cpu_gemm_pool": True}, {"kv_cache_dtype": "int8"}):
        assert not cpu_step_graphs_expected(EngineConfig.from_kwargs(**off)), off
    # LoRA replays with its native kernel (the default), not with the torch path
    assert cpu_step_graphs_expected(EngineConfig.from_kwargs(enable_lora=True))
    monkeypatch.setenv("KVFLOW_CPU_LORA", "torch")
    assert not cpu_step_graphs_expected(EngineConfig.from_kwargs(enable_lora=True))


def test_choose_splits_only_when_both_packings_are_affordable(tmp_path):
    shape = GemmShape(32, 16, torch.bfloat16)
    secs = {shape.key(c, r): t for c, times in {"native": (1.0, 3.0, 40.0),
                                                 "onednn": (2.0, 4.0, 30.0)}.items()
            for r, t in zip(ROW_CLASSES, times)}
    timings = _fake_timings(tmp_path, secs)
    cands = ("native", "onednn")
    assert choose(shape, cands, timings, split=True) == KernelSplit("native", "onednn", 181)
    # without the split: relative sums 1 + 1 + 1.33 vs 2 + 1.33 + 1
    assert choose(shape, cands, timings, split=False) == "native"
    assert choose(shape, ("onednn",), timings, split=True) == "onednn"


@native
@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN")
def test_row_split_weight_runs_each_kernel_on_its_rows():
    """Up to max_small_rows rows (counted over the leading dims) the small kernel's result,
    bit for bit; above, the large one's; prepacking with a KernelSplit packs both and the
    weight's bytes count both copies."""
    from torch import nn

    from kvflow.layers.linear import ReplicatedLinear
    from kvflow.quant.base import weight_bytes

    gen = torch.Generator().manual_seed(4)
    w, b = torch.randn(40, 64, generator=gen), torch.randn(40, generator=gen)
    small, large = NativePackedWeight(w, native_cpu_kernels()), OneDnnPackedWeight(w, 64)
    split = RowSplitWeight(small, large, 4)
    for shape in [(4, 64), (2, 2, 64), (5, 64), (3, 2, 64)]:
        x = torch.randn(*shape, generator=gen)
        want = (small if x.numel() // 64 <= 4 else large)(x, b)
        assert torch.equal(split(x, b), want)
        ref = x.double() @ w.double().T + b.double()
        assert torch.allclose(want.double(), ref, rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="max_small_rows"):
        RowSplitWeight(small, large, 0)
    model = nn.Sequential(ReplicatedLinear(64, 40))
    model[0].weight.data = w.clone()
    plain = weight_bytes(model)
    counts = prepack_gemm_weights(model, 64, native_cpu_kernels(),
                                  lambda _: KernelSplit("native", "onednn", 181))
    assert counts == {"native<=181/onednn": 1}
    packed = model[0].packed_weight
    assert isinstance(packed, RowSplitWeight) and packed.max_small_rows == 181
    assert isinstance(packed.small, NativePackedWeight)
    assert isinstance(packed.large, OneDnnPackedWeight)
    assert weight_bytes(model) >= plain + packed.small.packed.numel() * 4


def test_candidates_follow_the_choice_and_what_is_available():
    k = object()
    assert candidates_for(torch.float32, "auto", k, True) == ("native", "onednn")
    assert candidates_for(torch.float32, "onednn", k, True) == ("onednn",)
    assert candidates_for(torch.bfloat16, "auto", k, False) == ("native",)  # no bf16 units
    assert candidates_for(torch.float32, "native", None, True) == ("onednn",)  # no compiler
    assert candidates_for(torch.bfloat16, "auto", None, False) == ()


def test_cpu_gemm_flag_wins_over_the_environment(monkeypatch):
    monkeypatch.setenv("KVFLOW_CPU_GEMM", "native")
    assert cpu_gemm_choice("onednn") == "onednn"
    assert cpu_gemm_choice() == "native"
    monkeypatch.delenv("KVFLOW_CPU_GEMM")
    assert cpu_gemm_choice() == "auto"
    with pytest.raises(ValueError, match="cpu_gemm"):
        EngineConfig.from_kwargs(cpu_gemm="mkl")
    monkeypatch.setenv("KVFLOW_CPU_GEMM", "mkl")
    with pytest.raises(ValueError, match="KVFLOW_CPU_GEMM"):
        EngineConfig.from_kwargs()


def test_transformer_gemm_shapes():
    cfg = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, vocab_size=49152)
    assert transformer_gemm_shapes(cfg) == [(960, 576, 30), (576, 576, 30), (3072, 576, 30),
                                            (576, 1536, 30), (49152, 576, 1)]
    assert transformer_gemm_shapes(MixtralConfig()) is None


def _fake_timings(tmp_path, seconds: dict[str, float]) -> GemmTimings:
    timings = GemmTimings(tmp_path / "t.json", None)
    timings.seconds = dict(seconds)
    return timings


def test_dtype_follows_the_timed_forward_pass(tmp_path):
    """bf16 twice as fast at one row, fp32 three times as fast at 64 rows, level at 512: the
    sum of relative step times (1 + 3 + 1 vs 2 + 1 + 1) picks fp32; at equal speed the first
    (the default) stays."""
    shapes = [(32, 16, 2), (20000, 16, 1)]  # the wide one is timed on an 8192-column slice
    secs = {}
    for n in (32, 8192):
        for dtype, times in {"bfloat16": (1.0, 3.0, 5.0), "float32": (2.0, 1.0, 5.0)}.items():
            secs.update({f"{dtype}|{n}x16|native|{r}": t for r, t in zip(ROW_CLASSES, times)})
    cands = {torch.bfloat16: ("native",), torch.float32: ("native",)}
    assert choose_dtype(shapes, cands, _fake_timings(tmp_path, secs)) == torch.float32
    even = {key: 1.0 for key in secs}
    assert choose_dtype(shapes, cands, _fake_timings(tmp_path, even)) == torch.bfloat16


@native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_timing_measures_each_row_class(dtype):
    got = time_candidate(GemmShape(48, 32, dtype), "native", ROW_CLASSES, native_cpu_kernels())
    assert set(got) == set(ROW_CLASSES) and all(0 < s < 1 for s in got.values())


def _sysfs_cache(root, sizes):
    for i, size in enumerate(sizes):
        (root / f"index{i}").mkdir(parents=True)
        (root / f"index{i}" / "size").write_text(size + "\n")
    return str(root)


def test_timing_pool_is_twice_the_largest_cache(tmp_path):
    """Hand-computed: L1 32K, L2 1024K, L3 32768K -> 2 x 32 MiB; clamped to [32, 256] MiB; no
    readable size (another OS, a container hiding sysfs) -> POOL_BYTES; entries that are not
    sizes are skipped."""
    zen4 = _sysfs_cache(tmp_path / "zen4", ["32K", "32K", "1024K", "32768K"])
    assert gemm_timing.timing_pool_bytes(zen4) == 64 << 20
    xeon = _sysfs_cache(tmp_path / "xeon", ["48K", "2048K", "107520K"])  # 105 MiB L3
    assert gemm_timing.timing_pool_bytes(xeon) == 2 * 107520 * 1024
    big = _sysfs_cache(tmp_path / "big", ["48K", "2048K", "384M"])
    assert gemm_timing.timing_pool_bytes(big) == gemm_timing.POOL_MAX_BYTES == 256 << 20
    small = _sysfs_cache(tmp_path / "small", ["32K", "512K", "8M"])
    assert gemm_timing.timing_pool_bytes(small) == gemm_timing.POOL_MIN_BYTES == 32 << 20
    odd = _sysfs_cache(tmp_path / "odd", ["?", "12345"])  # bytes without a unit
    assert gemm_timing.timing_pool_bytes(odd) == gemm_timing.POOL_MIN_BYTES
    assert gemm_timing.timing_pool_bytes(str(tmp_path / "none")) == gemm_timing.POOL_BYTES
    assert gemm_timing.timing_method(64 << 20) != gemm_timing.timing_method(32 << 20)


@pytest.mark.parametrize("candidate", ["native", "onednn"])
def test_timing_copies_are_distinct_and_compute_the_product(candidate):
    """Each copy a one-row timing cycles through is its own memory (a byte copy of one
    packing) and multiplies like the weight: oracle, a float64 matmul of the same bf16 values
    (bound: the bf16 result's rounding, unit roundoff 2^-8 of each value, plus 1e-4 for the
    fp32 sums of 64 products)."""
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(40, 64, generator=gen).bfloat16()
    x = torch.randn(3, 64, generator=gen).bfloat16()
    kernels = native_cpu_kernels() if candidate == "native" else None
    if candidate == "native" and kernels is None:
        pytest.skip("native CPU kernels not built here")
    fns = gemm_timing._pack(candidate, weight, kernels, 3)
    want = x.double() @ weight.double().T
    outs = [fn(x) for fn in fns]
    for out in outs:
        assert out.shape == (3, 40)
        assert ((out.double() - want).abs() <= 2.0 ** -8 * want.abs() + 1e-4).all()
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    cells = [fn.__defaults__[0].packed for fn in fns]
    ptrs = {c.data_ptr() if c.layout == torch.strided else id(c) for c in cells}
    assert len(ptrs) == 3


def test_candidates_are_timed_alternately(tmp_path, monkeypatch):
    """Each candidate's passes alternate with the others' (A, B, A, B per row class), and the
    timings of all of them land in the cache at once: a load change between candidates cannot
    favour the one timed in the quieter moment (timings are kept for good)."""
    order = []
    monkeypatch.setattr(gemm_timing, "_pack", lambda cand, weight, kernels, copies: [
        lambda x: order.append((cand, x.shape[0]))] * copies)
    # the fake calls' times are noise: no early stop on a "clear leader" among them
    monkeypatch.setattr(gemm_timing, "EARLY_STOP_PASSES", gemm_timing.REPEATS + 1)
    timings = GemmTimings(tmp_path / "t.json", None)
    shape = GemmShape(64, 32, torch.float32)
    got = timings.get_all(shape, ("native", "onednn"))
    assert set(got) == {"native", "onednn"} and all(set(t) == set(ROW_CLASSES)
                                                    for t in got.values())
    passes = [cand for cand, rows in order if rows == 64][2 * 1:]  # after each warm-up call
    assert passes == ["native", "native", "onednn", "onednn"] * gemm_timing.REPEATS
    assert len(json.loads(json.dumps(timings.seconds))) == 2 * len(ROW_CLASSES)


def test_prefill_rows_from_1024_time_one_weight_copy_per_pass(tmp_path, monkeypatch):
    """A 2,048-row pass ran two weight copies, as a 64-row one does: compute-bound, the
    second copy only doubled the prefill class's cost (most of a first start's timing, 1.20-
    1.28 CPU s for SmolLM2 bf16 in session 50). Now each pass from 1,024 rows runs one copy:
    one call per candidate per pass (after its warm-up), two at 64 rows, the whole pool at one
    row; the timing method (cache key) names the rule."""
    calls = []
    monkeypatch.setattr(gemm_timing, "_pack", lambda cand, weight, kernels, copies: [
        lambda x: calls.append((cand, x.shape[0]))] * copies)
    # two candidates' pools of 5 copies of the 64 x 32 fp32 weight each (pool_copies)
    monkeypatch.setattr(gemm_timing, "timing_pool_bytes", lambda *a: 2 * 5 * 64 * 32 * 4)
    monkeypatch.setattr(gemm_timing, "EARLY_STOP_PASSES", gemm_timing.REPEATS + 1)  # as above
    rows = (1, 64, 1024, 2048)
    GemmTimings(tmp_path / "t.json", None, rows).get_all(GemmShape(64, 32, torch.float32),
                                                          ("native", "onednn"))
    per_candidate = {r: sum(1 for c, n in calls if n == r and c == "native") for r in rows}
    warm_up = 1
    # from 1,024 rows no warm-up and LARGE_REPEATS passes (gemm_timing.repeats_at)
    assert per_candidate == {1: warm_up + 5 * gemm_timing.REPEATS,
                             64: warm_up + 2 * gemm_timing.REPEATS,
                             1024: gemm_timing.LARGE_REPEATS,
                             2048: gemm_timing.LARGE_REPEATS}
    assert [gemm_timing.pass_copies(r, 5) for r in (1, 64, 512, 1023, 1024, 2048)] == \
        [5, 2, 2, 2, 1, 1]
    assert "one copy from 1024 rows" in gemm_timing.timing_method(1 << 20, rows)


def test_damaged_timings_are_measured_again_not_a_crash(tmp_path, monkeypatch, caplog):
    """A cache file whose times are 0 (or null, or a string) made ``choose`` divide by zero
    (or fail on the type) and the engine start die with a traceback. Now those entries are
    dropped with a warning, measured again (here: hand-set fake times, native 1 ms, oneDNN
    2 ms at every row class, so native wins), and the file is rewritten with the new times
    only."""
    shape = GemmShape(64, 32, torch.float32)
    cands = ("native", "onednn")
    damaged = {shape.key(c, r): 0 for c in cands for r in ROW_CLASSES}
    damaged[shape.key("onednn", 1)] = None
    damaged[shape.key("native", 64)] = "fast"
    path = tmp_path / "t.json"
    path.write_text(json.dumps(damaged))
    fake = {"native": 1e-3, "onednn": 2e-3}
    monkeypatch.setattr(gemm_timing, "time_candidates", lambda shape, candidates, rows, k: {
        c: {r: fake[c] for r in rows} for c in candidates})
    timings = GemmTimings(path, None)
    assert choose(shape, cands, timings) == "native"
    timings.save()
    assert json.loads(path.read_text()) == {shape.key(c, r): fake[c] for c in cands
                                            for r in ROW_CLASSES}
    assert "ignoring 6 of 6 entries" in caplog.text


@native
def test_timings_are_measured_once_then_read_back(tmp_path, monkeypatch):
    calls = []
    real = gemm_timing.time_candidate

    def counting(*args):
        calls.append(args[:2])
        return real(*args)

    monkeypatch.setattr(gemm_timing, "time_candidate", counting)
    shape = GemmShape(20000, 16, torch.float32)  # timed as 8192 columns, scaled by 20000/8192
    first = GemmTimings(tmp_path / "t.json", native_cpu_kernels())
    got = first.get(shape, "native")
    first.save()
    assert calls == [(shape, "native")]
    stored = json.loads((tmp_path / "t.json").read_text())
    assert set(stored) == {f"float32|8192x16|native|{r}" for r in ROW_CLASSES}
    again = GemmTimings(tmp_path / "t.json", native_cpu_kernels()).get(shape, "native")
    assert len(calls) == 1 and again == got
    assert got[1] == pytest.approx(stored["float32|8192x16|native|1"] * 20000 / 8192)


@native
def test_engine_with_timed_kernel_choice_matches_hf(tiny_llama, tmp_path, monkeypatch):
    """--cpu-gemm auto: every fp32 GEMM packed for the kernel its timing picked (recorded in
    the cache; both, split by rows, where the fastest changes along the row classes: the tiny
    model's weights are far below SPLIT_MAX_BYTES), and one greedy step's logprob equals
    HF's."""
    monkeypatch.setenv("KVFLOW_CACHE_DIR", str(tmp_path))
    llm = LLM(model=tiny_llama.path, dtype="float32", device="cpu", num_kv_blocks=64,
              cpu_gemm="auto")
    model = llm.engine.core.executor.runner.model
    kinds = {type(m.packed_weight) for m in model.modules() if hasattr(m, "packed_weight")}
    assert kinds <= {NativePackedWeight, OneDnnPackedWeight, RowSplitWeight} and kinds
    (cache,) = (tmp_path / "cpu_gemm").glob("*.json")
    assert any(key.startswith("float32|") for key in json.loads(cache.read_text()))
    prompt = [5, 9, 23, 41, 7]
    (out,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, logprobs=0),
                          use_tqdm=False)
    with torch.no_grad():
        hf_logits = tiny_llama.hf_model(torch.tensor([prompt])).logits[0, -1]
    token = out.outputs[0].token_ids[0]
    assert token == int(hf_logits.argmax())
    hf_logprob = torch.log_softmax(hf_logits.double(), -1)[token].item()
    assert abs(out.outputs[0].logprobs[0][token].logprob - hf_logprob) < 1e-4


def _fake_gemm_timing(monkeypatch, fake) -> None:
    """Every GEMM timing faked by ``fake(shape, candidates, rows, kernels)`` (candidate ->
    rows -> seconds): ``time_candidates``, ``time_candidate`` and ``time_dtypes`` (a shape's
    dtypes timed together, as ``--dtype auto`` times them)."""
    monkeypatch.setattr(gemm_timing, "time_candidates", fake)
    monkeypatch.setattr(gemm_timing, "time_candidate",
                        lambda shape, cand, rows, kernels: fake(shape, (cand,), rows, kernels)[cand])
    monkeypatch.setattr(gemm_timing, "time_dtypes", lambda by_shape, rows, kernels: {
        shape: fake(shape, cands, rows, kernels) for shape, cands in by_shape.items()})


@native
@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN")
def test_engine_keeps_native_decode_gemms_where_step_graphs_replay(tiny_llama, tmp_path,
                                                                   monkeypatch):
    """Timings faked: oneDNN 1.12x faster at 1 and 64 rows, 1.05x at the prefill class (the
    CPU's 2,048-token step budget), and this CPU's eager call 1 s (an eager step's host work,
    25 such calls per GEMM module, outweighs the 1.12 s GEMMs: infinite margins). With step
    graphs (the default) oneDNN loses the decode rows: every GEMM is split
    native<=362/oneDNN (sqrt(64 * 2048)) but the fp32 LM head (timed at its sampled rows, 1
    and 64: native) and decode steps replay; with ``enforce_eager`` oneDNN wins every class
    (no split) and takes every GEMM."""
    monkeypatch.setenv("KVFLOW_CACHE_DIR", str(tmp_path))
    _fake_gemm_timer(monkeypatch, eager_call_s=1.0)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    for eager in (False, True):
        llm = LLM(model=tiny_llama.path, dtype="float32", device="cpu", num_kv_blocks=64,
                  cpu_gemm="auto", enforce_eager=eager)
        runner = llm.engine.core.executor.runner
        packed = [m.packed_weight for m in runner.model.modules()
                  if getattr(m, "packed_weight", None) is not None]
        assert packed
        if eager:
            assert all(isinstance(p, OneDnnPackedWeight) for p in packed)
            assert runner.graph_runner is None
            continue
        head = runner.model.lm_head.packed_weight
        assert isinstance(head, NativePackedWeight)  # timed at 1 and 64 rows only: native
        assert all(isinstance(p, RowSplitWeight) and p.max_small_rows == 362
                   and isinstance(p.small, NativePackedWeight) for p in packed if p is not head)
        llm.generate([[5, 9, 23], [7, 41]], params, use_tqdm=False)
        assert runner.graph_runner.replayed_steps > 0


def _fake_gemm_timer(monkeypatch, eager_call_s: float) -> None:
    """GEMM timings faked as in test_engine_keeps_native_decode_gemms_where_step_graphs_replay
    (seconds per call: native 1.12 at 1 and 64 rows, 1.05 at 2,048; oneDNN 1.0), this CPU's
    eager call ``eager_call_s``."""
    secs = {"native": {1: 1.12, 64: 1.12, 2048: 1.05}, "onednn": {1: 1.0, 64: 1.0, 2048: 1.0}}
    fake = lambda shape, cands, rows, kernels: {c: {r: secs[c][r] for r in rows} for c in cands}
    _fake_gemm_timing(monkeypatch, fake)
    monkeypatch.setattr(gemm_timing, "eager_call_seconds", lambda kernels: eager_call_s)


@native
@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN")
def test_engine_on_a_fast_host_gives_a_decode_lead_to_onednn(tiny_llama, tmp_path, monkeypatch):
    """The same timings on a CPU whose eager call takes 1 ns (host work 25 ns per module
    against 1.12 s GEMMs: margins ~0): with step graphs on, oneDNN's 1.12x lead at decode
    rows pays, so it takes every GEMM (the LM head too, timed at 1 and 64 rows) and no decode
    step replays (a oneDNN GEMM is a torch operator). The fixed 1.18x margin kept them
    native."""
    monkeypatch.setenv("KVFLOW_CACHE_DIR", str(tmp_path))
    _fake_gemm_timer(monkeypatch, eager_call_s=1e-9)
    llm = LLM(model=tiny_llama.path, dtype="float32", device="cpu", num_kv_blocks=64,
              cpu_gemm="auto")
    runner = llm.engine.core.executor.runner
    packed = [m.packed_weight for m in runner.model.modules()
              if getattr(m, "packed_weight", None) is not None]
    assert packed and all(isinstance(p, OneDnnPackedWeight) for p in packed)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    llm.generate([[5, 9, 23], [7, 41]], params, use_tqdm=False)
    assert getattr(runner.graph_runner, "replayed_steps", 0) == 0


@native
@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN")
@pytest.mark.parametrize("max_num_seqs", [8, 256])
def test_fp32_lm_head_is_timed_at_the_rows_it_gets(tiny_llama, tmp_path, monkeypatch,
                                                   max_num_seqs):
    """An fp32 LM head only gets the sampled rows (at most max_num_seqs), yet it was timed at
    the prefill class too (2,048 rows of a LARGE_N-column slice: more than all the other
    shapes together). Now an injected timer sees the head's shape at the row classes up to
    max_num_seqs (1 for 8 sequences, 1 and 64 for 256) and every other shape at 1, 64 and
    the 2,048-row step budget."""
    from transformers import AutoConfig

    monkeypatch.setenv("KVFLOW_CACHE_DIR", str(tmp_path))
    timed: dict[int, set[int]] = {}

    def fake(shape, cands, rows, kernels):
        timed.setdefault(shape.n, set()).update(rows)
        return {c: {r: float(r) for r in rows} for c in cands}

    _fake_gemm_timing(monkeypatch, fake)
    LLM(model=tiny_llama.path, dtype="float32", device="cpu", num_kv_blocks=64,
        cpu_gemm="auto", max_num_seqs=max_num_seqs, max_num_batched_tokens=2048)
    vocab = AutoConfig.from_pretrained(tiny_llama.path).vocab_size
    assert timed.pop(vocab) == ({1} if max_num_seqs == 8 else {1, 64})
    assert timed and all(rows == {1, 64, 2048} for rows in timed.values())


@native
@pytest.mark.parametrize("faster", [torch.float32, torch.bfloat16])
def test_auto_dtype_is_the_faster_one_by_timing(faster, tmp_path, monkeypatch):
    """measure_cpu_dtype follows the timings (faked here: ``faster`` takes half the time of
    the other dtype at every shape and row count) and caches them; resolve_dtype asks it only
    when the checkpoint's dtype is 16-bit."""
    from kvflow.core.engine_dtype import resolve_dtype
    from kvflow.platforms.cpu import CpuPlatform

    monkeypatch.setenv("KVFLOW_CACHE_DIR", str(tmp_path))
    fake = lambda shape, cands, rows, kernels: {
        c: {r: (1.0 if shape.dtype == faster else 2.0) * r for r in rows} for c in cands}
    _fake_gemm_timing(monkeypatch, fake)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, vocab_size=300)
    got = gemm_select.measure_cpu_dtype(cfg, torch.bfloat16, "auto", lambda d: True)
    assert got == faster
    assert list((tmp_path / "cpu_gemm").glob("*.json"))
    monkeypatch.setattr(CpuPlatform, "has_native_matmul", lambda self, dtype: True)
    asked = []
    measure = lambda d: asked.append(d) or faster
    cfg.dtype = "bfloat16"
    assert resolve_dtype("auto", cfg, CpuPlatform(), measure) == faster and asked
    cfg.dtype, asked[:] = "float32", []
    assert resolve_dtype("auto", cfg, CpuPlatform(), measure) == torch.float32 and not asked


@native
def test_auto_dtype_times_at_the_engines_rows_into_the_gemm_choices_file(tmp_path, monkeypatch):
    """--dtype auto times the engine's row classes (prefill at its step budget) into the very
    file --cpu-gemm auto then reads: timed at 1, 64 and 1,024 rows, never 512, and the file is
    gemm_timings(kernels, row_classes(1024))'s."""
    from kvflow.config import DeviceConfig
    from kvflow.core.engine_dtype import cpu_dtype_measure
    from kvflow.platforms.cpu import CpuPlatform

    monkeypatch.setenv("KVFLOW_CACHE_DIR", str(tmp_path))
    timed = set()

    def fake(shape, cands, rows, kernels):
        timed.update(rows)
        return {c: {r: float(r) for r in rows} for c in cands}

    _fake_gemm_timing(monkeypatch, fake)
    monkeypatch.setattr(CpuPlatform, "has_native_matmul", lambda self, dtype: True)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, vocab_size=300)
    measure = cpu_dtype_measure(CpuPlatform(), DeviceConfig(device="cpu"), cfg, 1024)
    measure(torch.bfloat16)
    assert timed == {1, 64, 1024}
    (cache,) = (tmp_path / "cpu_gemm").glob("*.json")
    assert cache == gemm_timings(native_cpu_kernels(), row_classes(1024)).path


def test_cpu_gemm_that_takes_no_layer_is_warned_about(tiny_llama, caplog):
    """With every linear quantized no layer is packed for kvflow's GEMM: an explicit
    ``--cpu-gemm`` is then said to take no layer (``auto`` is not)."""

    message = "--cpu-gemm onednn (or KVFLOW_CPU_GEMM) took no layer"
    with caplog.at_level("WARNING", logger="kvflow.worker.cpu_setup"):
        LLM(model=tiny_llama.path, quantization="int8", cpu_gemm="onednn", dtype="float32",
            device="cpu", num_kv_blocks=16)
    assert message in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="kvflow.worker.cpu_setup"):
        LLM(model=tiny_llama.path, cpu_gemm="onednn", dtype="float32", device="cpu",
            num_kv_blocks=16)
    assert "took no layer" not in caplog.text
