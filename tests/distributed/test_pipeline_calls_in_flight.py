"""Calls that reach every rank (``collective_rpc``, ``sleep`` / ``wake_up``; on the server
also /start_profile and /stop_profile, which are collective calls) while a pipeline
micro-batch is in flight: the engine folds it in first, as it does for a LoRA load.

With ``pipeline_parallel_size=2`` a micro-batch stays in flight after its requests were
aborted (a ``generate`` interrupted by its ``on_output`` callback; on the server, a client
that disconnects) although the engine counts as idle. Before, each of these calls then failed
with ``RuntimeError: collective_rpc while steps are in flight`` (on the server a RuntimeError
in a utility call ends the engine core: 503s). Oracles: the ranks' KV-cache specs (each stage
its own layer), the one-process greedy tokens after a sleep and wake-up, and every KV block
free at the end.

One engine of 2 worker processes (about 10 s on 2 busy cores), shared by both tests (the
first leaves it idle, awake, every block free, nothing in flight).
"""

from __future__ import annotations

import pytest

from kvflow import LLM, SamplingParams
from tests.distributed.conftest import (
    GREEDY,
    PROMPTS,
    assert_same_greedy,
    shutdown_and_check,
)


class _Interrupt(Exception):
    """Raised by the ``on_output`` callback to stop a ``generate`` mid-run."""


@pytest.fixture(scope="module")
def pp_llm(tiny_llama):
    """PP=2, sleep mode on, 32 tokens a step (the greedy check's chunked prompt)."""
    llm = LLM(model=tiny_llama.path, dtype="float32", num_kv_blocks=96,
              max_num_batched_tokens=32, pipeline_parallel_size=2, enable_sleep_mode=True)
    yield llm
    shutdown_and_check(llm)


@pytest.mark.timeout(300)
def test_calls_to_every_rank_fold_the_micro_batch_in_flight_first(pp_llm,
                                                                  single_process_greedy):
    llm = pp_llm
    core = llm.engine.core
    seen: list[int] = []

    def interrupt_at_the_sixth_output(index, out):
        seen.append(index)
        if len(seen) == 6:
            raise _Interrupt

    with pytest.raises(_Interrupt):
        llm.generate([[5, 6, 7, 8 + i] for i in range(4)],
                     SamplingParams(temperature=0, max_tokens=50, ignore_eos=True),
                     use_tqdm=False, on_output=interrupt_at_the_sixth_output)
    # its requests aborted, the engine is idle with one micro-batch still in flight
    assert not core.has_unfinished_requests() and len(core.batch_queue) == 1
    specs = llm.collective_rpc("get_kv_cache_spec")
    assert [list(rank) for rank in specs] == [["model.layers.0.self_attn.attn"],
                                             ["model.layers.1.self_attn.attn"]]
    assert not core.batch_queue
    llm.sleep(1)
    assert llm.is_sleeping()
    assert llm.wake_up() is True
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    got = [list(zip(o.outputs[0].token_ids, o.outputs[0].logprobs)) for o in outs]
    assert_same_greedy(single_process_greedy("llama"), got)
    manager = core.kv_cache_manager
    assert manager.num_free_blocks == manager.pool.num_usable_blocks


@pytest.mark.timeout(300)
def test_sleep_refused_with_requests_running_keeps_their_outputs(pp_llm):
    """``sleep`` asked while requests run (from ``on_output``) folds the micro-batches in
    flight, is refused as on one process (ValueError naming the requests), and the
    requests' outputs folded meanwhile still reach the caller: every request ends with its
    50 tokens."""
    llm = pp_llm
    refusals: list[str] = []

    def try_to_sleep(index, out):
        if not refusals:
            with pytest.raises(ValueError, match=r"cannot sleep with \d+ request") as err:
                llm.sleep(1)
            refusals.append(str(err.value))

    outs = llm.generate([[5, 6, 7, 8 + i] for i in range(4)],
                        SamplingParams(temperature=0, max_tokens=50, ignore_eos=True),
                        use_tqdm=False, on_output=try_to_sleep)
    assert refusals and not llm.is_sleeping()
    assert [len(o.outputs[0].token_ids) for o in outs] == [50] * 4
