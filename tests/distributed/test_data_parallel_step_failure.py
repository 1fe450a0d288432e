"""``LLM(data_parallel_size=2)`` after a replica's step raised (an internal error of its model
runner, here a batched logits processor raising once; the replica process exits). Was: the
requests that replica held stayed unfinished in the front end, so ``wait_for_completion`` (and
any later call stepping until idle) waited for ever. Now the failed call raises naming the
replica and the cause, the next ``generate`` runs on the surviving replica (oracle: its tokens
before the failure), and ``wait_for_completion`` raises ``RequestFailed`` for the enqueued
requests the dead replica took with it."""

from __future__ import annotations

import pytest

from kvflow import LLM, SamplingParams
from kvflow.engine.streams import RequestFailed
from tests.test_async_llm_step_failure import MARKER_ENV

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
LONG = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)


@pytest.mark.timeout(300)
def test_a_dead_replica_does_not_leave_requests_hanging(tiny_llama, tmp_path, monkeypatch):
    marker = tmp_path / "break"
    monkeypatch.setenv(MARKER_ENV, str(marker))  # the replica processes inherit it
    llm = LLM(model=tiny_llama.path, dtype="float32", num_kv_blocks=96, data_parallel_size=2,
              logits_processors=["tests.test_async_llm_step_failure:BreakOnce"])
    try:
        prompts = ["the lazy fox", "a second prompt"]
        want = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        llm.enqueue([f"queued prompt {i}" for i in range(4)], LONG)  # two per replica
        marker.touch()
        with pytest.raises(RuntimeError, match="failed: RuntimeError: simulated runner failure"):
            llm.generate(prompts, GREEDY, use_tqdm=False)
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        assert got == want
        with pytest.raises(RequestFailed, match="simulated runner failure"):
            llm.wait_for_completion(use_tqdm=False)
        assert not llm.engine.has_unfinished_requests()
    finally:
        llm.shutdown()
