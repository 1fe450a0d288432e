"""An exception raised out of an engine step inside the engine-core process (an internal error
of the model runner: here a batched logits processor raising once) ends ``AsyncLLM``'s open
request with ``EngineDeadError`` naming the cause, and the next request is refused at once
(``EngineDeadError``, "not running"): it never waits for ever. The in-process ``LLM`` case is
tests/test_engine_recovery.py's. Regression guard: this already held when the offline hang
was found."""

from __future__ import annotations

import asyncio
import os

import pytest
import torch

from kvflow import SamplingParams
from kvflow.logits_process import AdapterLogitsProcessor

MARKER_ENV = "KVFLOW_TEST_BREAK_STEP_MARKER"
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
IDS = [40, 41, 42, 43]


class BreakOnce(AdapterLogitsProcessor):
    """A batched processor that raises for the whole step once the file named by
    ``$KVFLOW_TEST_BREAK_STEP_MARKER`` exists (deleting it: once, and only in the one process
    whose delete succeeds when data-parallel replicas race for it)."""

    def is_argmax_invariant(self) -> bool:
        return False

    def new_req_logits_processor(self, params: SamplingParams):
        return None

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        marker = os.environ.get(MARKER_ENV, "")
        if not marker:
            return logits
        try:
            os.remove(marker)  # claims the marker: one process of several raises
        except FileNotFoundError:
            return logits
        raise RuntimeError("simulated runner failure")


@pytest.mark.timeout(180)
def test_async_llm_step_failure_is_reported_and_never_hangs(tiny_llama, tmp_path, monkeypatch):
    from kvflow.config import EngineConfig
    from kvflow.engine.async_llm import AsyncLLM, EngineDeadError, collect

    marker = tmp_path / "break"
    monkeypatch.setenv(MARKER_ENV, str(marker))  # the core process inherits it
    engine = AsyncLLM(EngineConfig.from_kwargs(
        model=tiny_llama.path, dtype="float32", num_kv_blocks=48, block_size=4,
        logits_processors=["tests.test_async_llm_step_failure:BreakOnce"]))

    async def scenario():
        await engine.start()
        try:
            await asyncio.wait_for(collect(engine.add_request("ok", None, IDS, GREEDY)), 60)
            marker.touch()
            with pytest.raises(EngineDeadError) as failed:
                await asyncio.wait_for(collect(engine.add_request("bad", None, IDS, GREEDY)),
                                       60)
            with pytest.raises(EngineDeadError) as refused:
                await asyncio.wait_for(collect(engine.add_request("next", None, IDS, GREEDY)),
                                       5)
            return failed.value, refused.value
        finally:
            await engine.shutdown()

    try:
        failed, refused = asyncio.run(scenario())
    finally:
        engine.close()
    assert "RuntimeError: simulated runner failure" in str(failed)
    assert "not running" in str(refused)
