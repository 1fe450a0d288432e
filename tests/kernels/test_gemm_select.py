"""Per-CPU GEMM kernel choice (``--cpu-gemm auto``): the choice rule on hand-made timings, the
timings cache (measured once, then read back), the dtype chosen for ``--dtype auto`` from the
model's GEMM shapes, and an engine whose every GEMM kernel was picked by timing still matching
HF transformers."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaConfig, MixtralConfig

from kvflow import LLM, SamplingParams
from kvflow.config import EngineConfig, cpu_gemm_choice
from kvflow.kernels import gemm_select
from kvflow.kernels.cpu_native import native_cpu_kernels
from kvflow.kernels.gemm import (
    NativePackedWeight,
    OneDnnPackedWeight,
    RowSplitWeight,
    prepack_gemm_weights,
)
from kvflow.kernels.gemm_select import (
    ROW_CLASSES,
    GemmShape,
    GemmTimings,
    KernelSplit,
    best_candidate,
    candidates_for,
    choose,
    choose_dtype,
    row_class_winners,
    split_candidate,
    time_candidate,
    transformer_gemm_shapes,
)

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
