"""``KVFLOW_CPU_LORA=auto`` (kvflow/lora/cpu_kernel_choice.py): the CPU LoRA kernel timed per
CPU and shape, the faster picked (``torch`` charged this CPU's margin, ``lora_graph_margins``,
where it would cost the decode steps' replay), the timings cached per shape; ``native`` / ``torch`` forced by the
variable without timing; any other value a ValueError naming it. The timer is injected (a fake
``measure`` with set seconds), so the choice is checked against hand-computed sums.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from kvflow.kernels.cpu_native import native_cpu_kernels
from kvflow.kernels.gemm_select import GRAPH_MARGIN
from kvflow.lora import cpu_kernel_choice as choice_mod
from kvflow.lora.cpu_kernel_choice import (
    EAGER_ROWS,
    ROW_CLASSES,
    TIMED_ROWS,
    LoRAShape,
    LoRATimings,
    choose,
    choose_eager,
    eager_kernel,
    layer_shapes,
    resolve_cpu_lora,
    resolve_eager_cpu_lora,
    time_lora,
)

KERNELS = object()  # stands for the native kernels: the fake timer never calls them


def _layer(in_features: int, out: int, rank: int, max_loras: int = 2) -> SimpleNamespace:
    """A LoRALinear's slots as the choice reads them (B as the CPU layer keeps it)."""
    return SimpleNamespace(lora_a=torch.zeros(max_loras, rank, in_features),
                           lora_b=torch.zeros(max_loras, rank, out).transpose(1, 2))


LAYERS = [_layer(64, 96, 8), _layer(64, 96, 8), _layer(160, 64, 8)]  # two shapes, 2 + 1 layers


class FakeTimer:
    """``measure`` returning ``seconds[candidate] * rows`` per call, counting its calls."""

    def __init__(self, native: float, torch_: float) -> None:
        self.seconds, self.calls = {"native": native, "torch": torch_}, []

    def __call__(self, shape: LoRAShape, rows: int, kernels) -> dict[str, float]:
        self.calls.append((shape, rows))
        return {c: s * rows for c, s in self.seconds.items()}


def _resolve(tmp_path, timer: FakeTimer, graphs: bool, eager_call_s: float = 0.0) -> str:
    """resolve_cpu_lora of LAYERS with ``timer``'s times and an eager GEMM call of
    ``eager_call_s`` seconds (0: an eager step costs no host work)."""
    timings = LoRATimings(tmp_path / "lora.json", None, timer, lambda kernels: eager_call_s)
    return resolve_cpu_lora(LAYERS, torch.bfloat16, KERNELS, graphs, timings)


def test_layer_shapes_count_layers_per_shape():
    assert layer_shapes(LAYERS, torch.float32) == {
        LoRAShape(64, 96, 8, torch.float32): 2, LoRAShape(160, 64, 8, torch.float32): 1}


@pytest.mark.parametrize("native,torch_,graphs,eager_call_s,picked", [
    (1.0, 2.0, False, 1.0, "native"),
    (2.0, 1.0, False, 1.0, "torch"),  # no step graphs at stake: the eager call not weighed
    # with step graphs the margin is this CPU's (lora_graph_margins), not GRAPH_MARGIN's 1.18x:
    # no host work to lose (0 s an eager call): margin 0, torch 1.1x faster wins
    (1.1, 1.0, True, 0.0, "torch"),
    # 3 layers x 25 x 1 s of host work against the LoRA layers' 4.5 / 72 / 288 s at 1 / 16 /
    # 64 rows (1.5 s a row a call x 3 layers): infinite at 1 and 16 rows, so torch, 1.5x
    # faster, never pays (before: charged 1.18x, torch)
    (1.5, 1.0, True, 1.0, "native"),
    (1.0, 1.0, False, 0.0, "native"),  # a tie keeps native
])
def test_auto_picks_what_the_timer_says_is_faster(tmp_path, monkeypatch, native, torch_,
                                                   graphs, eager_call_s, picked):
    monkeypatch.delenv("KVFLOW_CPU_LORA", raising=False)  # auto, the default
    timer = FakeTimer(native, torch_)
    assert _resolve(tmp_path, timer, graphs, eager_call_s) == picked
    # each shape timed once at every row class (the eager steps' too), nothing more
    assert sorted(rows for _, rows in timer.calls) == sorted(TIMED_ROWS * 2)


def test_choose_sums_relative_times_over_row_classes():
    """Hand-computed: native wins at 1 row by 2x, loses at 16 and 64 rows by 1.25x each:
    native 1 + 1.25 + 1.25 = 3.5, torch 2 + 1 + 1 = 4 -> native; at 1.6x it loses (4.2)."""
    torch_times = {1: 2.0, 16: 4.0, 64: 8.0}
    native = {1: 1.0, 16: 5.0, 64: 10.0}
    assert choose({"native": native, "torch": torch_times}, graphs=False) == "native"
    native = {1: 1.0, 16: 6.4, 64: 12.8}
    assert choose({"native": native, "torch": torch_times}, graphs=False) == "torch"
    # with graphs torch's times count 1 + GRAPH_MARGIN (1.18x): torch 2.36 + 1 + 1 = 4.36,
    # native 1 + 2 * 6.4 / (4 * 1.18) = 3.71 -> native kept
    assert round(GRAPH_MARGIN, 2) == 0.18
    assert choose({"native": native, "torch": torch_times}, graphs=True) == "native"


def test_measured_margins_replace_the_fixed_one():
    """lora_graph_margins = gemm_select.graph_margins of the LoRA layers' native seconds:
    2 layers x 25 x 1 ms = 50 ms of host work, 1 thread, against native 25 / 100 / 200 ms at
    1 / 16 / 64 rows: r = 2, 0.5, 0.25: infinite, 1.0, 1/3. ``choose`` charges torch by them:
    torch 0.5x native's time at every class is still slower at 1 row (infinite) and 16 rows
    (x 2 = native's, a tie) but faster at 64 (0.5 x 4/3 = 0.667): native 1 + 1 + 1.5 = 3.5,
    torch inf: native. Where the margins are all 0.2, torch (0.6x) wins every class: torch.
    The eager call is timed once and cached with the LoRA timings."""
    from kvflow.lora.cpu_kernel_choice import lora_graph_margins

    native = {1: 0.025, 16: 0.100, 64: 0.200, EAGER_ROWS: 1.0}
    margins = lora_graph_margins(native, 2, 1e-3, 1)
    assert margins[1] == float("inf")
    assert margins[16] == pytest.approx(1.0) and margins[64] == pytest.approx(1 / 3)
    torch_times = {n: 0.5 * s for n, s in native.items()}
    assert choose({"native": native, "torch": torch_times}, True, margins) == "native"
    assert choose({"native": native, "torch": torch_times}, True,
                  dict.fromkeys(ROW_CLASSES, 0.2)) == "torch"
    with pytest.raises(ValueError, match="modules >= 1"):
        lora_graph_margins(native, 0, 1e-3, 1)


def test_eager_call_is_timed_once_and_cached(tmp_path):
    timed = []
    timings = LoRATimings(tmp_path / "lora.json", None, FakeTimer(1.0, 1.0),
                          lambda kernels: timed.append(kernels) or 2e-5)
    assert timings.eager_call_seconds(KERNELS) == 2e-5 and timed == [KERNELS]
    again = LoRATimings(tmp_path / "lora.json", None, FakeTimer(1.0, 1.0),
                        lambda kernels: pytest.fail("timed again"))
    assert again.eager_call_seconds(KERNELS) == 2e-5


def test_timings_are_cached_per_shape(tmp_path, monkeypatch):
    monkeypatch.delenv("KVFLOW_CPU_LORA", raising=False)
    first = FakeTimer(2.0, 1.0)
    assert _resolve(tmp_path, first, graphs=False) == "torch"
    again = FakeTimer(1.0, 2.0)  # another start on this CPU: read from the file, not timed
    assert _resolve(tmp_path, again, graphs=False) == "torch" and again.calls == []
    # a new shape is timed alone
    timings = LoRATimings(tmp_path / "lora.json", None, again)
    resolve_cpu_lora([*LAYERS, _layer(32, 32, 4)], torch.bfloat16, KERNELS, False, timings)
    assert [shape for shape, _ in again.calls] == [LoRAShape(32, 32, 4, torch.bfloat16)] * 4
    # another dtype is another shape
    assert LoRAShape(32, 32, 4, torch.float32).key("native", 1) != \
        LoRAShape(32, 32, 4, torch.bfloat16).key("native", 1)


class RowsTimer(FakeTimer):
    """``FakeTimer`` whose torch takes ``torch_at_eager`` seconds a row at ``EAGER_ROWS``."""

    def __init__(self, native: float, torch_: float, torch_at_eager: float) -> None:
        super().__init__(native, torch_)
        self.torch_at_eager = torch_at_eager

    def __call__(self, shape: LoRAShape, rows: int, kernels) -> dict[str, float]:
        seconds = super().__call__(shape, rows, kernels)
        return {**seconds, "torch": self.torch_at_eager * rows} if rows == EAGER_ROWS \
            else seconds


def test_eager_steps_pick_per_row_class_from_the_same_timings(tmp_path, monkeypatch):
    """Native 1 s a row, torch 2 at decode rows but 0.5 at the eager class: decode (graphs
    or not) keeps native, eager steps of EAGER_ROWS rows or more run torch, fewer native;
    the eager choice times nothing the decode one did not."""
    monkeypatch.delenv("KVFLOW_CPU_LORA", raising=False)
    timer = RowsTimer(1.0, 2.0, 0.5)
    timings = LoRATimings(tmp_path / "lora.json", None, timer)
    assert resolve_cpu_lora(LAYERS, torch.bfloat16, KERNELS, False, timings) == "native"
    calls = len(timer.calls)
    by_rows = resolve_eager_cpu_lora(LAYERS, torch.bfloat16, KERNELS, timings)
    assert len(timer.calls) == calls == 2 * len(TIMED_ROWS)
    assert by_rows == {**dict.fromkeys(ROW_CLASSES, "native"), EAGER_ROWS: "torch"}
    assert [eager_kernel(by_rows, n) for n in (1, 15, 16, 127, 128, 2048)] == \
        ["native"] * 4 + ["torch"] * 2
    # a tie keeps native; below the smallest class, the smallest class's
    times = {"native": dict.fromkeys(TIMED_ROWS, 1.0), "torch": dict.fromkeys(TIMED_ROWS, 1.0)}
    assert set(choose_eager(times).values()) == {"native"}
    assert eager_kernel({4: "torch", 8: "native"}, 0) == "torch"


@pytest.mark.parametrize("forced", ["native", "torch"])
def test_env_forces_the_eager_kernel_too(tmp_path, monkeypatch, forced):
    monkeypatch.setenv("KVFLOW_CPU_LORA", forced)
    timer = FakeTimer(1.0, 1.0)
    timings = LoRATimings(tmp_path / "lora.json", None, timer)
    assert resolve_eager_cpu_lora(LAYERS, torch.bfloat16, KERNELS, timings) == \
        dict.fromkeys(TIMED_ROWS, forced)
    assert timer.calls == []
    # without native kernels torch, whatever the variable says
    assert set(resolve_eager_cpu_lora(LAYERS, torch.bfloat16, None, timings).values()) == \
        {"torch"}


@pytest.mark.parametrize("forced", ["native", "torch"])
def test_env_forces_a_kernel_without_timing(tmp_path, monkeypatch, forced):
    monkeypatch.setenv("KVFLOW_CPU_LORA", forced)
    timer = FakeTimer(1.0, 1.0)
    assert _resolve(tmp_path, timer, graphs=True) == forced and timer.calls == []


def test_bad_value_raises_naming_the_variable(tmp_path, monkeypatch):
    monkeypatch.setenv("KVFLOW_CPU_LORA", "fastest")
    with pytest.raises(ValueError, match="KVFLOW_CPU_LORA='fastest' is invalid"):
        _resolve(tmp_path, FakeTimer(1.0, 1.0), graphs=True)


def test_without_native_kernels_torch(tmp_path, monkeypatch):
    monkeypatch.delenv("KVFLOW_CPU_LORA", raising=False)
    timer = FakeTimer(1.0, 9.0)
    timings = LoRATimings(tmp_path / "lora.json", None, timer)
    assert resolve_cpu_lora(LAYERS, torch.float32, None, True, timings) == "torch"
    assert timer.calls == []


def test_auto_logs_its_choice_once(tmp_path, monkeypatch, caplog):
    monkeypatch.delenv("KVFLOW_CPU_LORA", raising=False)
    with caplog.at_level(logging.INFO, logger=choice_mod.__name__):
        _resolve(tmp_path, FakeTimer(1e-6, 2e-6), graphs=True)
    lines = [r.getMessage() for r in caplog.records if r.name == choice_mod.__name__]
    assert len(lines) == 1 and lines[0].startswith("LoRA kernel on CPU (KVFLOW_CPU_LORA=auto): "
                                                   "native;"), lines


def test_real_timer_times_both_kernels():
    """The real measure on a small shape: a positive time per call for each candidate."""
    kernels = native_cpu_kernels()
    if kernels is None:
        pytest.skip("no C compiler")
    threads = torch.get_num_threads()
    seconds = time_lora(LoRAShape(40, 24, 3, torch.bfloat16), 5, kernels)
    assert set(seconds) == {"native", "torch"} and all(s > 0 for s in seconds.values())
    assert torch.get_num_threads() == threads  # one thread while timing, restored after
