"""Large CPU tensors advised onto transparent huge pages (kvflow/platforms/cpu_memory.py): the
advised range is exactly the whole 2 MB pages inside the tensor, the tensor holds zeros, and the
engine's CPU KV cache goes through it. The KV cache is a fresh zeroed mapping, nothing of it
resident until touched (``mincore``, the kernel's own count, is the oracle), which the prefault
thread backs without changing a byte."""

from __future__ import annotations

import ctypes
import itertools
import mmap
import subprocess
import sys
import threading
import time
import weakref

import pytest
import torch

from kvflow.platforms import cpu_memory
from kvflow.platforms.cpu_memory import (
    HUGE_PAGE,
    advise_huge_pages,
    populate,
    prefault_in_background,
    zeros_on_huge_pages,
)

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise is Linux's")


@linux
def test_advises_the_whole_huge_pages_inside_the_tensor():
    t = torch.empty(5 * HUGE_PAGE + 12345, dtype=torch.uint8)
    ptr = t.data_ptr()
    first = -(-ptr // HUGE_PAGE) * HUGE_PAGE
    last = (ptr + t.numel()) // HUGE_PAGE * HUGE_PAGE
    assert advise_huge_pages(t) == last - first >= 4 * HUGE_PAGE


def test_small_or_non_cpu_tensors_are_left_alone():
    assert advise_huge_pages(torch.empty(HUGE_PAGE // 2, dtype=torch.uint8)) == 0
    assert advise_huge_pages(torch.empty(0)) == 0


@linux
def test_zeros_on_huge_pages_are_zeros():
    t = zeros_on_huge_pages((3, HUGE_PAGE // 2 + 7), torch.bfloat16)
    assert t.shape == (3, HUGE_PAGE // 2 + 7) and t.dtype == torch.bfloat16
    assert int(t.count_nonzero()) == 0


def _resident_pages(t: torch.Tensor) -> tuple[int, int]:
    """(pages of ``t`` in memory, pages of ``t``), by the kernel's ``mincore``."""
    libc = ctypes.CDLL(None, use_errno=True)
    start = t.data_ptr() // mmap.PAGESIZE * mmap.PAGESIZE
    end = -(-(t.data_ptr() + t.numel() * t.element_size()) // mmap.PAGESIZE) * mmap.PAGESIZE
    pages = (end - start) // mmap.PAGESIZE
    vec = (ctypes.c_ubyte * pages)()
    assert libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(end - start), vec) == 0
    return sum(v & 1 for v in vec), pages


@linux
def test_the_zeros_are_a_fresh_mapping_on_a_huge_page_boundary_untouched():
    shape = (2, 3 * HUGE_PAGE // 4 + 5, 2)  # 12 MiB + 40 bytes of bf16
    t = zeros_on_huge_pages(shape, torch.bfloat16)
    nbytes = t.numel() * 2
    assert t.shape == shape and t.is_contiguous() and t.untyped_storage().nbytes() == nbytes
    assert t.data_ptr() % HUGE_PAGE == 0  # every whole huge page advised: 6 of them
    assert advise_huge_pages(t) == 6 * HUGE_PAGE
    assert _resident_pages(t)[0] == 0  # was: every page written with zeros (all resident)
    assert int(t.count_nonzero()) == 0  # read as the kernel's zero pages
    t[1, -1, 1] = 7.0  # writable, to the last byte
    assert float(t.sum()) == 7.0


@linux
def test_populate_backs_every_page_and_changes_no_byte():
    t = zeros_on_huge_pages((5 * HUGE_PAGE // 4 + 3,), torch.float32)
    t[::1001] = torch.arange(len(t[::1001]), dtype=torch.float32)
    before = t.clone()
    if not populate(t):
        pytest.skip("kernel without MADV_POPULATE_WRITE (Linux < 5.14)")
    resident, pages = _resident_pages(t)
    assert resident == pages
    assert torch.equal(t, before)


@linux
def test_prefault_thread_backs_the_cache_and_holds_no_tensor():
    caches = [zeros_on_huge_pages((2, 40, 16, 3, 64), torch.bfloat16) for _ in range(3)]
    caches[1][1, 39, 15, 2, 63] = 3.0  # the V plane's last element, written before it runs
    gone = zeros_on_huge_pages((2, 40, 16, 3, 64), torch.bfloat16)
    gone_ref = weakref.ref(gone)
    thread = prefault_in_background([*caches, gone], chunk_bytes=64 << 10, first_bytes=0)
    assert thread is not None and thread.name == "kvflow-kv-prefault" and thread.daemon
    del gone
    thread.join(30)
    assert not thread.is_alive() and gone_ref() is None  # freed although the thread had it
    if not populate(caches[0][:1]):
        pytest.skip("kernel without MADV_POPULATE_WRITE (Linux < 5.14)")
    assert [_resident_pages(c)[0] == _resident_pages(c)[1] for c in caches] == [True] * 3
    assert float(caches[1].float().sum()) == 3.0 and int(caches[0].count_nonzero()) == 0
    assert prefault_in_background([]) is None


EXIT_WHILE_PREFAULTING = """
import time, torch
from kvflow.platforms.cpu_memory import prefault_in_background, zeros_on_huge_pages
cache = zeros_on_huge_pages((2, 4096, 16, 4, 64), torch.float32)  # 256 MiB
prefault_in_background([cache], chunk_bytes=4096, first_bytes=0)  # busy in torch calls
time.sleep(0.05)
print("exiting")
"""


@linux
def test_the_interpreter_exits_cleanly_while_the_thread_prefaults():
    """A process that exits while the prefault thread is mid-way (a short ``kvflow generate``)
    exits with status 0. Was: the interpreter ended the daemon thread inside a torch call,
    ``terminate called without an active exception``, status 134 in about half the runs (CI
    failed on it); six runs at once make a pass by luck unlikely (1 in 64)."""
    runs = [subprocess.Popen([sys.executable, "-c", EXIT_WHILE_PREFAULTING], text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            for _ in range(6)]
    results = [(p.wait(timeout=120), *p.communicate()) for p in runs]
    assert [(rc, out) for rc, out, _ in results] == [(0, "exiting\n")] * 6, results


def _resident(t: torch.Tensor, start: int, end: int) -> bool:
    """Whether bytes [start, end) of ``t``'s memory are all in memory (``mincore``)."""
    part = t.view(-1).view(torch.uint8)[start:end]
    resident, pages = _resident_pages(part)
    return resident == pages


@linux
def test_the_first_blocks_are_backed_before_it_returns_the_rest_while_no_step_runs():
    """Each K and V plane's first 2 MB (the blocks the pool hands out first: the first
    requests') is backed before ``prefault_in_background`` returns; the thread backs the rest
    only once the steps have left the CPU alone for ``PREFAULT_IDLE_S``. Was: everything left
    to a thread that ran beside the steps, so the first request after /health faulted its
    blocks' pages itself while the thread took the other core (1.5 s against 0.4 s)."""
    caches = [zeros_on_huge_pages((2, 1000, 16, 3, 64), torch.bfloat16) for _ in range(3)]
    plane = 1000 * 16 * 3 * 64 * 2  # bytes: 6,144,000, so V starts inside a huge page
    gate = cpu_memory.StepGate()
    with gate.running():  # a step runs
        thread = prefault_in_background(caches, gate=gate)
        assert thread is not None
        for c in caches:
            if not _resident(c, 0, HUGE_PAGE):
                pytest.skip("kernel without MADV_POPULATE_WRITE (Linux < 5.14)")
            assert _resident(c, plane, plane + HUGE_PAGE)  # V's first blocks
        time.sleep(0.3)
        assert [_resident(c, HUGE_PAGE, 2 * HUGE_PAGE) for c in caches] == [False] * 3
    thread.join(30)
    assert not thread.is_alive()
    assert [_resident_pages(c)[0] == _resident_pages(c)[1] for c in caches] == [True] * 3
    assert all(int(c.count_nonzero()) == 0 for c in caches)


def test_step_gate_is_quiet_only_after_the_steps_left_it_alone():
    gate = cpu_memory.StepGate()
    assert gate.quiet(10.0)  # no step yet
    with gate.running():
        assert not gate.quiet(0.0)
        with gate.running():  # nested parts of one step
            pass
        assert not gate.quiet(0.0)
    assert gate.quiet(0.0) and not gate.quiet(5.0)
    with pytest.raises(RuntimeError), gate.running():
        raise RuntimeError("a failed step")
    assert gate.quiet(0.0)


@linux
def test_the_prefault_thread_alone_runs_at_nice_19():
    """Oracle: the kernel's per-thread nice value (``/proc/self/task/<tid>/stat``, field 19)."""
    def nice(tid: int) -> int:
        with open(f"/proc/self/task/{tid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[16])

    seen, mine = [], nice(threading.get_native_id())

    def run():
        seen.append(cpu_memory.lower_thread_priority())
        seen.append(nice(threading.get_native_id()))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert seen == [True, 19]
    assert nice(threading.get_native_id()) == mine  # the process's other threads keep theirs


def test_cpu_kv_cache_is_allocated_through_it(monkeypatch, tiny_llama):
    from kvflow import LLM, SamplingParams

    calls = []
    real = cpu_memory.zeros_on_huge_pages

    def spy(shape, dtype):
        calls.append((tuple(shape), dtype))
        return real(shape, dtype)

    monkeypatch.setattr("kvflow.worker.kv_cache_setup.zeros_on_huge_pages", spy)
    prefaulted = []
    monkeypatch.setattr("kvflow.worker.kv_cache_setup.prefault_in_background",
                        lambda tensors, gate: prefaulted.append(([t.data_ptr() for t in tensors],
                                                                 gate)))
    llm = LLM(model=tiny_llama.path, kv_cache_memory="16MiB", enable_prefix_caching=False)
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, temperature=0.0),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2
    assert calls and all(shape[0] == 2 and len(shape) == 5 for shape, _ in calls)
    runner = llm.engine.core.executor.runner
    assert prefaulted == [([t.data_ptr() for t in runner.kv_caches], runner.step_gate)]
    assert not runner.step_gate.quiet(60.0)  # the worker's steps went through it just now


def _span(t: torch.Tensor) -> tuple[int, int]:
    return t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()


def test_arena_places_tensors_side_by_side_on_aligned_segments():
    arena = cpu_memory.HugePageArena(segment_bytes=4 * HUGE_PAGE)
    sizes = [(1000, torch.float32), (3, torch.bfloat16), (HUGE_PAGE // 2, torch.bfloat16),
             (5, torch.uint8), (HUGE_PAGE, torch.float32)]  # 4000, 6, 1 MiB, 5, 4 MiB bytes
    tensors = [arena.empty(n, dt) for n, dt in sizes]
    assert [(t.numel(), t.dtype, t.dim()) for t in tensors] == [(n, dt, 1) for n, dt in sizes]
    spans = [_span(t) for t in tensors]
    first = spans[0][0]
    assert first % HUGE_PAGE == 0  # a segment starts on a huge page
    # hand-computed offsets: each tensor starts on the next 64-byte boundary
    assert [s - first for s, _ in spans[:4]] == [0, 4032, 4096, 4096 + HUGE_PAGE // 2 * 2]
    # the 4 MiB tensor equals the segment size: its own segment, on a huge page
    assert spans[4][0] % HUGE_PAGE == 0 and not spans[0][0] <= spans[4][0] < first + 4 * HUGE_PAGE
    ordered = sorted(spans)
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in itertools.pairwise(ordered))
    for i, t in enumerate(tensors):  # writable, and no tensor overlaps another
        t.fill_(i + 1)
    assert [int(t[0]) for t in tensors] == [1, 2, 3, 4, 5]
    assert [int(t[-1]) for t in tensors] == [1, 2, 3, 4, 5]


def test_arena_opens_a_new_segment_when_the_current_one_is_full():
    arena = cpu_memory.HugePageArena(segment_bytes=HUGE_PAGE)
    a = arena.empty(HUGE_PAGE * 3 // 4, torch.uint8)
    b = arena.empty(HUGE_PAGE // 2, torch.uint8)  # does not fit behind a
    c = arena.empty(HUGE_PAGE // 4 - 64, torch.uint8)  # fits behind b
    assert a.data_ptr() % HUGE_PAGE == 0 and b.data_ptr() % HUGE_PAGE == 0
    assert b.data_ptr() != a.data_ptr() + HUGE_PAGE * 3 // 4
    assert c.data_ptr() == b.data_ptr() + HUGE_PAGE // 2
    assert a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()
    assert b.untyped_storage().data_ptr() == c.untyped_storage().data_ptr()


@linux
def test_arena_segments_are_advised_whole():
    arena = cpu_memory.HugePageArena(segment_bytes=2 * HUGE_PAGE)
    arena.empty(10, torch.float32)
    arena.empty(HUGE_PAGE + 1, torch.float32)  # 8 MiB + 4 bytes: its own segment of 10 MiB
    assert arena.advised_bytes == 2 * HUGE_PAGE + 5 * HUGE_PAGE


def test_arena_rejects_bad_sizes():
    with pytest.raises(ValueError, match="segment_bytes"):
        cpu_memory.HugePageArena(segment_bytes=0)
    with pytest.raises(ValueError, match="numel"):
        cpu_memory.HugePageArena().empty(-1, torch.float32)


def test_engine_packs_the_native_gemm_weights_into_shared_segments(tiny_llama):
    from kvflow import LLM
    from kvflow.kernels.cpu_native import native_cpu_kernels
    from kvflow.kernels.gemm import NativePackedWeight
    from kvflow.quant.base import weight_bytes

    if native_cpu_kernels() is None:
        pytest.skip("no native CPU kernels here")
    llm = LLM(model=tiny_llama.path, kv_cache_memory="16MiB", enable_prefix_caching=False,
              cpu_gemm="native")
    model = llm.engine.core.executor.runner.model
    packed = {id(m.packed_weight): m.packed_weight.packed for m in model.modules()
              if isinstance(getattr(m, "packed_weight", None), NativePackedWeight)}
    assert len(packed) >= 4
    storages = {t.untyped_storage().data_ptr() for t in packed.values()}
    assert len(storages) == 1  # a tiny model's weights share one segment
    # weight_bytes counts each packed copy's own bytes, not the 32 MiB segment
    plain = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                 for t in [*model.parameters(), *model.buffers()]}.values())
    own = sum(t.numel() * t.element_size() for t in packed.values())
    assert weight_bytes(model) == plain + own


def test_thp_mode_reads_the_bracketed_word(tmp_path):
    path = tmp_path / "enabled"
    for text, mode in [("always [madvise] never\n", "madvise"), ("[always] madvise never", "always"),
                       ("always madvise [never]\n", "never"), ("garbled\n", "unavailable")]:
        path.write_text(text)
        assert cpu_memory.thp_mode(str(path)) == mode
    assert cpu_memory.thp_mode(str(tmp_path / "missing")) == "unavailable"
