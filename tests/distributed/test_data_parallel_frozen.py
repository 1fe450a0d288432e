"""``LLM(model, data_parallel_size=2, engine_heartbeat_timeout=2)`` with a replica stopped
(SIGSTOP) mid-run: ``generate`` raises naming it and its silence within the timeout (plus a
check period), the frozen process is killed, and the LLM serves on with the other replica,
whose greedy tokens equal the one-process engine's.

Was: ``generate`` waited for ever on the frozen replica's outputs (no exit status to poll).
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from kvflow import LLM, SamplingParams
from tests.distributed.conftest import GREEDY, PROMPTS, assert_same_greedy


@pytest.fixture(scope="module")
def dp_llm(tiny_llama):
    llm = LLM(model=tiny_llama.path, dtype="float32", num_kv_blocks=96,
              max_num_batched_tokens=32, data_parallel_size=2, engine_heartbeat_timeout=2.0)
    yield llm
    llm.shutdown()
    assert all(not c.is_alive for c in llm.engine.core.cores)


def test_a_frozen_replica_is_named_and_the_other_keeps_serving(dp_llm, single_process_greedy):
    client = dp_llm.engine.core
    handle, frozen = client._handle, []

    def freeze_replica_one_on_first_output(msg):
        if not frozen:
            os.kill(client.cores[1].pid, signal.SIGSTOP)
            frozen.append(time.monotonic())
        handle(msg)

    client._handle = freeze_replica_one_on_first_output
    try:
        with pytest.raises(RuntimeError, match=r"^engine core 1 of 2 \(pid \d+\) sent no "
                                               r"heartbeat and used no CPU for [\d.]+ s "
                                               r"\(engine_heartbeat_timeout=2\): the "
                                               r"process is stopped "
                                               r"\(SIGSTOP or SIGTSTP\); killed it$"):
            dp_llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=400,
                                                    ignore_eos=True), use_tqdm=False)
    finally:
        client._handle = handle
    assert 1.5 <= time.monotonic() - frozen[0] < 5.0  # silent since its last beat (0.5 s apart)
    assert client.balancer.depth == [0, 0]
    outs = dp_llm.generate(PROMPTS, GREEDY, use_tqdm=False)  # all on replica 0 now
    assert_same_greedy(single_process_greedy("llama"),
                       [list(zip(o.outputs[0].token_ids, o.outputs[0].logprobs)) for o in outs])
    assert [c.is_live for c in client.cores] == [True, False]
    client.cores[1].proc.join(5)
    assert client.cores[1].proc.exitcode == -signal.SIGKILL
