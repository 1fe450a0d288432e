"""kvflow's straggler-tolerant GEMM pool (``kernels/cpu_pool.py``, ``csrc/cpu_pool.c``).

Oracles: the OpenMP GEMM of the same packed weight (the pool must return it bit for bit: each
output element is computed by one thread in one order), the float64 product (the OpenMP GEMM's
own contract, re-checked here at a loose bound) and, for the work sharing, item counts derived
from the GEMM's blocking by hand.
"""

from __future__ import annotations

import math

import pytest
import torch

from kvflow import LLM, SamplingParams
from kvflow.kernels.cpu_native import native_cpu_kernels
from kvflow.kernels.cpu_pool import CpuPool
from kvflow.kernels.cpu_threads import use_gemm_pool

KERNELS = native_cpu_kernels()
pytestmark = pytest.mark.skipif(KERNELS is None, reason="native CPU kernels unavailable")


def _operands(m: int, n: int, k: int, dtype: torch.dtype, bias: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen).to(dtype)
    x = torch.randn(m, k, generator=gen).to(KERNELS.gemm_x_dtype(dtype))
    b = torch.randn(n, generator=gen) if bias else None
    return x, w, b


@pytest.fixture
def pool():
    p = CpuPool(KERNELS, 1)
    yield p
    p.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 100, 70), (33, 600, 96), (200, 100, 64), (5, 40, 0)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("delay_us", [0, 20_000])
def test_pool_gemm_equals_openmp_gemm(pool, dtype, shape, bias, delay_us):
    """Whoever computes an item (caller, worker, or the caller again after a late worker), the
    result is the OpenMP GEMM's, bit for bit, and near the float64 product."""
    x, w, b = _operands(*shape, dtype, bias)
    packed = KERNELS.gemm_pack(w)
    pool.set_worker_delay(delay_us)
    got = pool.gemm(x, packed, shape[1], b)
    assert torch.equal(got, KERNELS.gemm(x, packed, shape[1], b))
    ref = x.double() @ w.double().T + (0 if b is None else b.double())
    assert torch.allclose(got.double(), ref, rtol=1e-4, atol=1e-3 * max(1, shape[2]) ** 0.5)


def _items(m: int, n: int, k: int) -> int:
    # cpu_gemm.c: row blocks of min(96, 65536 // k // 6 * 6) rows for the fp32 weights here
    # (k-paired bf16 on Zen 5 rounds to 8 rows), panels of NR columns
    rows = min(96, max(6, 65536 // max(k, 1) // 6 * 6))
    return math.ceil(m / rows) * math.ceil(n / KERNELS.lib.kvflow_gemm_panel_width())


def test_late_worker_items_are_taken_over(pool):
    """A worker that sleeps 0.2 s in every item (a thread descheduled on a busy core) never
    holds the caller up: the caller computes all but the worker's items itself and takes over
    the ones the worker holds; every item is counted once, and the packed weight stays
    referenced while the late worker may still read it."""
    m, n, k = 200, 100, 64
    x, w, b = _operands(m, n, k, torch.float32, True, seed=1)
    packed = KERNELS.gemm_pack(w)
    pool.set_worker_delay(200_000)
    before = pool.stats()
    for _ in range(3):
        assert torch.equal(pool.gemm(x, packed, n, b), KERNELS.gemm(x, packed, n, b))
    after = {key: after - before[key] for key, after in pool.stats().items()}
    assert after["caller"] + after["committed"] + after["taken_over"] == 3 * _items(m, n, k)
    assert after["caller"] > after["committed"]
    if after["taken_over"]:  # the worker was still asleep in an item when the call returned
        assert any(t is packed for t in pool._in_use.values()) or pool.stats()["dropped"] > 0
    pool.close()
    assert pool._in_use == {}
    with pytest.raises(ValueError, match="closed"):
        pool.gemm(x, packed, n, b)


def test_quiet_worker_commits_items(pool):
    """Without a delay the worker takes part: over many calls it commits items, and nothing
    is taken over twice (each item counted once)."""
    m, n, k = 600, 1024, 256
    x, w, _ = _operands(m, n, k, torch.float32, False, seed=2)
    packed = KERNELS.gemm_pack(w)
    before = pool.stats()
    for _ in range(10):
        pool.gemm(x, packed, n)
    after = {key: after - before[key] for key, after in pool.stats().items()}
    assert after["caller"] + after["committed"] + after["taken_over"] == 10 * _items(m, n, k)
    assert after["committed"] > 0


def test_use_gemm_pool_sets_and_clears_the_process_pool():
    """configure_cpu_threads' helper: threads - 1 workers, kept when unchanged, replaced when
    the pinning changes, removed with one thread or the pool off."""
    try:
        use_gemm_pool(KERNELS, 2, None)
        first = KERNELS.pool
        assert first is not None and first.num_workers == 1
        use_gemm_pool(KERNELS, 2, None)
        assert KERNELS.pool is first
        use_gemm_pool(KERNELS, 1, None)
        assert KERNELS.pool is None
        use_gemm_pool(KERNELS, 2, [0, 1])  # pinned: a new pool, worker on the second CPU
        assert KERNELS.pool.cpus == [1] and KERNELS.pool.num_workers == 1
        use_gemm_pool(KERNELS, 2, None, enabled=False)
        assert KERNELS.pool is None
    finally:
        KERNELS.pool = None


def test_engine_with_and_without_the_pool_agree(tiny_llama, monkeypatch):
    """The same fp32 engine with the GEMM pool on and off: identical greedy tokens and
    logprobs (the pool changes who computes each output, never how)."""
    monkeypatch.setenv("KVFLOW_CPU_GEMM", "native")
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=1, ignore_eos=True)
    prompts = ["hello world", "the cat sat on the mat and", "a"]
    results, threads = [], torch.get_num_threads()
    try:
        for on in (True, False):
            llm = LLM(model=tiny_llama.path, device="cpu", dtype="float32", cpu_threads=2,
                      cpu_gemm_pool=on, kv_cache_memory="16MiB")
            assert (native_cpu_kernels().pool is not None) == on
            outs = llm.generate(prompts, params, use_tqdm=False)
            results.append([(o.outputs[0].token_ids, [lp[t].logprob for lp, t in zip(
                o.outputs[0].logprobs, o.outputs[0].token_ids)]) for o in outs])
            del llm
    finally:
        native_cpu_kernels().pool = None
        torch.set_num_threads(threads)  # cpu_threads=2 set it for the whole process
    assert results[0] == results[1]


def test_forked_child_falls_back_to_openmp():
    """A forked child has the pool's memory but not its threads: its GEMMs run the OpenMP
    path (same result), and closing its copy does not wait for the parent's threads (which
    would hang the child)."""
    import os

    x, w, _ = _operands(40, 200, 64, torch.float32, False, seed=3)
    packed = KERNELS.gemm_pack(w)
    expected = KERNELS.gemm(x, packed, 200)
    try:
        use_gemm_pool(KERNELS, 2, None)
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # child: one OpenMP thread (libgomp's threads do not survive a fork)
            torch.set_num_threads(1)
            ok = torch.equal(KERNELS.gemm(x, packed, 200), expected) and not KERNELS.pool.is_open
            KERNELS.pool.close()
            os.write(write, b"1" if ok else b"0")
            os._exit(0)
        os.close(write)
        assert os.read(read, 1) == b"1"
        os.waitpid(pid, 0)
        assert KERNELS.pool.is_open
    finally:
        KERNELS.pool = None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("delay_us", [0, 20_000])
@pytest.mark.parametrize("batch_invariant", [False, True])
def test_pool_attention_equals_openmp_attention(pool, dtype, delay_us, batch_invariant):
    """Paged attention through the pool (a tile per item; a late worker's tile recomputed by
    the caller) returns the OpenMP kernel's output bit for bit, for a mixed batch of decodes
    and prefill chunks, with a block table whose row stride exceeds its columns; and the
    OpenMP output is itself near the float64 softmax reference."""
    from tests.kernels.paged_batch import make_batch

    b = make_batch([(40, 1), (0, 37), (100, 1), (9, 20), (0, 1)], num_heads=6, num_kv_heads=2,
                   head_dim=32, dtype=dtype, seed=4)
    wide = torch.zeros(b["block_table"].shape[0], b["block_table"].shape[1] + 5,
                       dtype=torch.int32)
    wide[:, :b["block_table"].shape[1]] = b["block_table"]
    args = (b["q"], b["kv_cache"], b["query_start_loc"], b["seq_lens"],
            wide[:, :b["block_table"].shape[1]], b["scale"])
    tokens = int(b["query_start_loc"][-1])
    try:
        KERNELS.pool = None
        expected = KERNELS.paged_attention(*args, batch_invariant=batch_invariant)
        KERNELS.pool = pool
        pool.set_worker_delay(delay_us)
        before = pool.stats()
        got = KERNELS.paged_attention(*args, batch_invariant=batch_invariant)
        assert sum(pool.stats().values()) > sum(before.values())  # the pool ran it
    finally:
        KERNELS.pool = None
    assert torch.equal(got[:tokens], expected[:tokens])
    qsl, lens, bs = b["query_start_loc"].tolist(), b["seq_lens"].tolist(), 16
    kv = b["kv_cache"].double()
    for r in range(len(lens)):  # causal softmax over the request's context, in float64
        blocks = b["block_table"][r, :-(-lens[r] // bs)].tolist()
        k = kv[0, blocks].reshape(-1, 2, 32)[:lens[r]].repeat_interleave(3, dim=1)
        v = kv[1, blocks].reshape(-1, 2, 32)[:lens[r]].repeat_interleave(3, dim=1)
        for i, t in enumerate(range(qsl[r], qsl[r + 1])):
            visible = lens[r] - (qsl[r + 1] - qsl[r]) + i + 1
            s = torch.einsum("hd,khd->hk", b["q"][t].double(), k[:visible]) * b["scale"]
            ref = torch.einsum("hk,khd->hd", s.softmax(-1), v[:visible])
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            assert torch.allclose(expected[t].double(), ref, atol=tol, rtol=tol)
