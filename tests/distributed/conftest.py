"""Helpers for the multi-process tests: greedy runs of a tiny model in one process and over
several ranks, compared token by token with a near-tie tolerance.

Worker processes inherit ``OMP_NUM_THREADS=1`` (set here): the tiny models gain nothing from
threads, and two ranks on two shared cores must not oversubscribe them.
"""

from __future__ import annotations

import os
import time
from typing import Any

import pytest

from kvflow import LLM, SamplingParams

os.environ.setdefault("OMP_NUM_THREADS", "1")

# Token-id prompts of different lengths (one longer than a 16-token block, one chunked).
PROMPTS = [[5, 17, 33, 2, 91, 7], [40, 41, 42] * 7, [9, 250, 31, 77], list(range(60, 100))]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2)
NEAR_TIE = 1e-3  # top-2 logprob gap below which a different greedy pick is not an error
# Marks of a multi-process case kept out of the default run (the suite's time budget): it runs
# in scripts/test_distributed_slow.sh, which sets KVFLOW_TEST_DISTRIBUTED_SLOW=1.
SLOW = (pytest.mark.distributed_slow,
        pytest.mark.skipif(os.environ.get("KVFLOW_TEST_DISTRIBUTED_SLOW") != "1",
                           reason="slow: run scripts/test_distributed_slow.sh"))


def slow(test: Any) -> Any:
    """``test`` with the ``SLOW`` marks (for a whole test; a parameter takes ``marks=SLOW``)."""
    for mark in SLOW:
        test = mark(test)
    return test


def greedy_run(path: str, shutdown: bool = True, **engine_kwargs: Any) -> tuple[list, LLM]:
    """(per prompt: [(token id, its logprobs entry)], the LLM) of a greedy fp32 run."""
    llm = LLM(model=path, dtype="float32", num_kv_blocks=96, max_num_batched_tokens=32,
              **engine_kwargs)
    try:
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    finally:
        if shutdown:
            shutdown_and_check(llm)
    return [list(zip(o.outputs[0].token_ids, o.outputs[0].logprobs)) for o in outs], llm


def shutdown_and_check(llm: LLM) -> None:
    """``llm.shutdown()``; its worker processes (if any) must stop by themselves at once (exit
    status 0 within 3 s; a worker that ran the interpreter's teardown took 4-6 s on 2 busy
    cores and was often killed after the executor's 5 s grace)."""
    executor = getattr(getattr(llm.engine, "core", None), "executor", None)
    procs = list(getattr(executor, "_procs", []))
    start = time.monotonic()
    llm.shutdown()
    took = time.monotonic() - start
    assert [p.returncode for p in procs] == [0] * len(procs), \
        f"worker exit statuses {[p.returncode for p in procs]} (negative: killed)"
    assert took < 3.0, f"shutdown took {took:.1f} s"


def assert_same_greedy(reference: list, got: list) -> None:
    """Token-by-token equality, except that the runs may part at a near-tie of the
    reference (its top-2 logprobs within ``NEAR_TIE``), after which nothing is compared."""
    for prompt, (ref, out) in enumerate(zip(reference, got)):
        for pos, ((ref_id, ref_lp), (out_id, _)) in enumerate(zip(ref, out)):
            if ref_id != out_id:
                top = sorted(ref_lp.values(), key=lambda lp: lp.logprob, reverse=True) \
                    if isinstance(ref_lp, dict) else None
                gap = top[0].logprob - top[1].logprob if top and len(top) > 1 else None
                assert gap is not None and gap < NEAR_TIE, \
                    f"prompt {prompt} token {pos}: {out_id} != {ref_id} (top-2 gap {gap})"
                break
        assert len(ref) == len(out)


@pytest.fixture(scope="session")
def single_process_greedy(tiny_model_factory):
    """``ref(model_name)``: the one-process greedy run of a tiny model (cached)."""
    cache: dict[str, list] = {}

    def ref(name: str) -> list:
        if name not in cache:
            cache[name] = greedy_run(tiny_model_factory(name).path)[0]
        return cache[name]

    return ref
