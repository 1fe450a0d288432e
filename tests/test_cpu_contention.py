"""Adaptive CPU thread count (``--cpu-adaptive-threads``): the runqueue-wait signal read from
the kernel's scheduler statistics (fake /proc trees with hand-written numbers, and the real
kernel beside a busy process pinned to the same CPU), the governor's decisions on hand-made
windows, and the thread count it applies to torch."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from kvflow.kernels.cpu_native import native_cpu_kernels
from kvflow.kernels.cpu_threads import AdaptiveThreads
from kvflow.platforms.cpu_contention import GovernorSettings, ThreadGovernor, runqueue_wait_ns

HAVE_SCHEDSTAT = runqueue_wait_ns() is not None
S = GovernorSettings(window_s=0.25, high=0.15, strikes=2, probe_s=1.0, max_probe_s=4.0)


def test_runqueue_wait_sums_the_second_field_of_every_task(tmp_path):
    for tid, text in {"10": "5000 700 3\n", "11": "9 300 1\n", "12": "1 0 0\n"}.items():
        (tmp_path / tid).mkdir()
        (tmp_path / tid / "schedstat").write_text(text)
    (tmp_path / "13").mkdir()  # a thread that exited before its file was read
    assert runqueue_wait_ns(str(tmp_path)) == 700 + 300 + 0
    assert runqueue_wait_ns(str(tmp_path / "missing")) is None


@pytest.mark.skipif(not HAVE_SCHEDSTAT, reason="no /proc/<pid>/task/<tid>/schedstat here")
def test_runqueue_wait_grows_beside_a_busy_process_on_the_same_cpu():
    """Two busy tasks pinned to one CPU: each waits for the other's slices, so over 0.6 s of
    spinning this process waits at least a fifth of the time (half, on an idle CPU)."""
    script = textwrap.dedent("""
        import os, subprocess, sys, time
        from kvflow.platforms.cpu_contention import runqueue_wait_ns
        cpu = min(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpu})
        busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        time.sleep(0.2)
        w0, t0 = runqueue_wait_ns(), time.monotonic()
        while time.monotonic() - t0 < 0.6:
            pass
        print((runqueue_wait_ns() - w0) / 1e9, time.monotonic() - t0)
        busy.kill()
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True, timeout=60).stdout.split()
    waited, wall = float(out[0]), float(out[1])
    assert waited > 0.2 * wall


def _feed(gov: ThreadGovernor, windows: list[tuple[float, float]]) -> list[int | None]:
    """Feed windows of (seconds, wait fraction at the current count); returns the decisions."""
    now, wait, decisions = 0.0, 0, []
    if gov._start is None:
        gov.observe(now, wait)
    else:
        now, wait = gov._start
    for length, frac in windows:
        wait += int(frac * length * gov.threads * 1e9)
        now += length
        decisions.append(gov.observe(now, wait))
    return decisions


def test_governor_keeps_every_thread_on_a_quiet_machine():
    gov = ThreadGovernor(2, S)
    decisions = _feed(gov, [(0.25, 0.02)] * 50)
    assert decisions == [None] * 50 and gov.threads == 2 and gov.switches == 0


def test_governor_drops_a_thread_after_two_contended_windows_and_probes_back():
    gov = ThreadGovernor(2, S)
    # one contended window alone (a blip) changes nothing; two in a row drop to 1 thread
    decisions = _feed(gov, [(0.25, 0.4), (0.25, 0.0), (0.25, 0.35), (0.25, 0.35)])
    assert decisions == [None, None, None, 1] and gov.threads == 1
    # at 1 thread no wait (the neighbour has the other core): stay until the probe is due
    decisions = _feed(gov, [(0.25, 0.0)] * 4)
    assert decisions == [None, None, None, 2]  # probe 1.0 s after the drop
    # the probe window is contended again: back to 1, next probe after 2 s
    decisions = _feed(gov, [(0.25, 0.33)])
    assert decisions == [1] and gov.probe_s == 2.0
    decisions = _feed(gov, [(0.25, 0.0)] * 8)
    assert decisions == [None] * 7 + [2]
    # the neighbour left: the probe window is quiet, stay at 2, back-off reset
    decisions = _feed(gov, [(0.25, 0.01)] * 20)
    assert decisions == [None] * 20 and gov.threads == 2 and gov.probe_s == 1.0


def test_governor_back_off_is_capped():
    gov = ThreadGovernor(2, S)
    _feed(gov, [(0.25, 0.4)] * 2)
    intervals = []
    for _ in range(5):
        windows = 1
        while _feed(gov, [(0.25, 0.0)]) != [2]:  # quiet at 1 thread until the probe
            windows += 1
        intervals.append(0.25 * windows)
        assert _feed(gov, [(0.25, 0.5)]) == [1]  # every probe finds the neighbour there
    assert intervals == pytest.approx([1.0, 2.0, 4.0, 4.0, 4.0])


def test_governor_removes_the_cores_the_wait_says_were_lost():
    gov = ThreadGovernor(16, S)
    # 16 threads each waiting 30% of the time: ~4.8 cores' worth lost -> 11 threads
    assert _feed(gov, [(0.25, 0.3)] * 2) == [None, 11]
    # a window shorter than window_s is not closed
    assert gov.observe(gov._start[0] + 0.2, gov._start[1] + 10**9) is None


def test_adaptive_threads_sets_torchs_count_and_restores_it():
    before = torch.get_num_threads()
    clock, wait = [0.0], [0]
    adaptive = AdaptiveThreads(2, S, clock=lambda: clock[0], read_wait=lambda: wait[0])
    try:
        torch.set_num_threads(2)
        for _ in range(3):  # windows of 0.25 s, each thread waiting 40% of it
            adaptive.before_step()
            clock[0] += 0.25
            wait[0] += int(0.4 * 0.25 * adaptive.threads * 1e9)
        adaptive.before_step()
        assert adaptive.threads == 1 and torch.get_num_threads() == 1
        clock[0] += 1.1  # the probe: all threads again
        adaptive.before_step()
        assert adaptive.threads == 2 and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_adaptive_threads_off_where_it_cannot_help(caplog):
    with caplog.at_level("WARNING", logger="kvflow.kernels.cpu_threads"):
        assert AdaptiveThreads.create(False, 2, pinned=False, ranks=1) is None
        assert not caplog.records  # not asked for: nothing to say
        assert AdaptiveThreads.create(True, 1, pinned=False, ranks=1) is None
        assert AdaptiveThreads.create(True, 2, pinned=True, ranks=1) is None
        assert AdaptiveThreads.create(True, 2, pinned=False, ranks=2) is None
    assert [r.getMessage().rsplit("with ", 1)[1] for r in caplog.records] == \
        ["one thread", "pinned threads", "2 worker processes"]
    made = AdaptiveThreads.create(True, 2, pinned=False, ranks=1)
    assert (made is not None) == HAVE_SCHEDSTAT


@pytest.mark.skipif(not HAVE_SCHEDSTAT, reason="no /proc/<pid>/task/<tid>/schedstat here")
def test_engine_drops_a_thread_mid_run_and_keeps_greedy_output(tiny_llama):
    """The runner consults the governor before each step: with a (fake) wait of half the wall
    time per thread it switches 2 -> 1 -> 2 (probe) -> 1 threads mid-run, and the greedy tokens
    still equal
    transformers' (the C kernels give the same bits at any thread count)."""
    from kvflow import LLM, SamplingParams

    before = torch.get_num_threads()
    llm = LLM(model=tiny_llama.path, device="cpu", dtype="float32", cpu_threads=2,
              kv_cache_memory="16MiB", cpu_adaptive_threads=True)  # (the suite's default is off: conftest.py)
    try:
        adaptive = llm.engine.core.executor.worker.runner.adaptive_threads
        assert adaptive is not None and adaptive.threads == 2
        clock, wait = [0.0], [0]

        def tick() -> float:  # every step: 0.25 s, each thread waiting half of it
            clock[0] += 0.25
            wait[0] += int(0.5 * 0.25 * adaptive.threads * 1e9)
            return clock[0]

        adaptive.clock, adaptive.read_wait = tick, lambda: wait[0]
        prompt = [5, 17, 42, 8, 99, 3]
        out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8,
                                                     ignore_eos=True), use_tqdm=False)
        # 8 steps, 0.25 s each: 2 -> 1 at the third, the probe 1 s later (seventh) back to 2,
        # contended, so 1 again at the eighth
        assert adaptive.threads == 1 and adaptive.governor.switches == 3
        assert torch.get_num_threads() == 1
        hf = tiny_llama.hf_model.generate(torch.tensor([prompt]), max_new_tokens=8,
                                          do_sample=False)
        assert list(out[0].outputs[0].token_ids) == hf[0, len(prompt):].tolist()
    finally:
        torch.set_num_threads(before)


def test_engine_keeps_a_fixed_count_when_asked(tiny_llama):
    from kvflow import LLM

    before = torch.get_num_threads()
    try:  # (pinned threads: AdaptiveThreads.create above; pinning here would pin pytest)
        options = [{"cpu_adaptive_threads": False}]
        if native_cpu_kernels() is not None:  # deterministic mode refuses to start without
            options.append({"cpu_adaptive_threads": True, "deterministic": True})
        for option in options:
            llm = LLM(model=tiny_llama.path, device="cpu", dtype="float32", cpu_threads=2,
                      kv_cache_memory="16MiB", **option)
            assert llm.engine.core.executor.worker.runner.adaptive_threads is None, option
    finally:
        torch.set_num_threads(before)


def test_default_comes_from_the_environment(monkeypatch):
    from kvflow.config import DeviceConfig, cpu_adaptive_threads_choice

    monkeypatch.delenv("KVFLOW_CPU_ADAPTIVE_THREADS", raising=False)
    assert cpu_adaptive_threads_choice() is False and cpu_adaptive_threads_choice(True) is True
    monkeypatch.setenv("KVFLOW_CPU_ADAPTIVE_THREADS", "1")
    assert cpu_adaptive_threads_choice() is True and cpu_adaptive_threads_choice(False) is False
    monkeypatch.setenv("KVFLOW_CPU_ADAPTIVE_THREADS", "yes")
    with pytest.raises(ValueError, match="KVFLOW_CPU_ADAPTIVE_THREADS='yes'"):
        DeviceConfig()
