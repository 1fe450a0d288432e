"""A failure that belongs to ONE request inside a batched engine step ends that request alone.

Was: a request's per-request logits processor that raised (in ``apply`` or when the request
was bound), a LoRA adapter that could not be read again at the request's first schedule (the
adapter removed while the request waited, its folder changed meanwhile) or the vision encoder
raising on one request's image (``tests/multimodal/test_encoder_fault_isolation.py``) failed
the whole step: every request in it was aborted and
``LLM`` raised the bare exception (the server's engine core died). Now the runner records the
failure for that request (``kvflow/worker/request_failures.py``), the scheduler ends it with
the error (its K/V kept out of the prefix cache, its blocks freed) and the step's other
requests run on: the request beside it gets the tokens of its solo run.

Oracles: each good request's greedy tokens alone on the same engine; the error's type (``RequestRefused``, a ValueError, for a ValueError in the
request's work; ``RequestFailed`` for another exception) and field; every KV block free and
no container holding the requests' ids (``tests/request_state.py``).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable

import pytest
import torch

from kvflow import LLM, SamplingParams
from kvflow.core.request_errors import EXTRA_ARGS, LORA_REQUEST
from kvflow.engine.streams import RequestFailed, RequestRefused
from kvflow.logits_process import AdapterLogitsProcessor
from kvflow.lora.request import LoRARequest
from tests.lora.adapters import make_adapter
from tests.request_state import holders, wait_until_idle

GOOD = [40, 41, 42, 43, 44, 45, 46, 47]
BAD = [1, 5, 9, 13, 17, 21]
HERE = "tests.test_step_fault_isolation"


class FailAt(AdapterLogitsProcessor):
    """Per request: raises once the request has ``extra_args["fail_at"]`` generated tokens
    (a ValueError, or a RuntimeError with ``"kind": "runtime"``); ``"kind": "bind"`` makes
    ``new_req_logits_processor`` itself raise."""

    def is_argmax_invariant(self) -> bool:
        return False

    def new_req_logits_processor(self, params: SamplingParams):
        args = params.extra_args or {}
        if "fail_at" not in args:
            return None
        if args.get("kind") == "bind":
            raise ValueError("fail_at: cannot bind")
        return fail_at(args)


def fail_at(args: dict) -> Callable[[list[int], torch.Tensor], torch.Tensor]:
    """A per-request processor raising once ``args["fail_at"]`` tokens are out: RuntimeError
    for ``kind`` "runtime", else ValueError."""
    error = RuntimeError if args.get("kind") == "runtime" else ValueError

    def fail(output_ids: list[int], row: torch.Tensor) -> torch.Tensor:
        if len(output_ids) >= args["fail_at"]:
            raise error(f"fail_at={args['fail_at']} reached")
        return row
    return fail


def greedy(n: int = 10, **extra) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True,
                          extra_args=extra or None)


def step_until_done(engine) -> tuple[dict[str, list[int]], dict[str, Exception]]:
    """Step an ``LLMEngine`` until idle; (request id -> its final tokens, request id -> the
    error its step raised)."""
    tokens, errors = {}, {}
    while engine.has_unfinished_requests():
        try:
            outputs = engine.step()
        except (RequestRefused, RequestFailed) as e:
            outputs = e.outputs
            errors[e.request_id] = e
        for out in outputs:
            if out.finished:
                tokens[out.request_id] = out.outputs[0].token_ids
    return tokens, errors


def assert_idle_and_forgotten(llm: LLM, ids: list[str]) -> None:
    """The engine serves the next request (which also tells the runner of the ends); every
    KV block is free again and nothing holds ``ids``."""
    assert len(llm.generate({"prompt_token_ids": [2, 3]}, greedy(2),
                            use_tqdm=False)[0].outputs[0].token_ids) == 2
    pool = llm.engine.core.kv_cache_manager.pool
    pool.check_invariants()
    assert pool.num_free_blocks == pool.num_usable_blocks
    assert holders(llm, ids) == []


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(tiny_llama.path, dtype="float32", num_kv_blocks=64, block_size=4,
               logits_processors=[FailAt])


@pytest.mark.parametrize(("kind", "error_type", "match"), [
    ("value", RequestRefused, "its logits processor: fail_at=3 reached"),
    ("runtime", RequestFailed, "its logits processor failed: RuntimeError: fail_at=3"),
    ("bind", RequestRefused, "its logits processor: fail_at: cannot bind"),
])
def test_a_failing_request_logits_processor_ends_only_its_request(llm, kind, error_type,
                                                                  match):
    solo = llm.generate({"prompt_token_ids": GOOD}, greedy())[0].outputs[0].token_ids
    engine = llm.engine
    engine.add_request({"prompt_token_ids": GOOD}, greedy(), f"fi-good-{kind}")
    engine.add_request({"prompt_token_ids": BAD}, greedy(fail_at=3, kind=kind), f"fi-bad-{kind}")
    tokens, errors = step_until_done(engine)  # was: the step raised, both were aborted
    assert tokens == {f"fi-good-{kind}": solo}
    error = errors[f"fi-bad-{kind}"]
    assert type(error) is error_type and match in str(error)
    assert error_type is RequestFailed or error.field == EXTRA_ARGS
    assert_idle_and_forgotten(llm, [f"fi-good-{kind}", f"fi-bad-{kind}"])


@pytest.mark.parametrize("kind", ["value", "bind"])
def test_async_scheduling_ends_only_the_failing_request(tiny_llama, kind):
    """Async scheduling launches step N+1 before N's tokens are collected: N's failures
    travel with N (not N+1), and the failed request's row in N+1 is dropped as stale."""
    llm = LLM(tiny_llama.path, dtype="float32", num_kv_blocks=64, block_size=4,
              logits_processors=[FailAt], async_scheduling=True, max_num_batched_tokens=8)
    solo = llm.generate({"prompt_token_ids": GOOD}, greedy())[0].outputs[0].token_ids
    engine = llm.engine
    engine.add_request({"prompt_token_ids": GOOD}, greedy(), "fi-good")
    engine.add_request({"prompt_token_ids": BAD}, greedy(fail_at=3, kind=kind), "fi-bad")
    tokens, errors = step_until_done(engine)
    assert tokens == {"fi-good": solo}
    assert isinstance(errors["fi-bad"], RequestRefused)
    assert errors["fi-bad"].field == EXTRA_ARGS
    assert_idle_and_forgotten(llm, ["fi-good", "fi-bad"])


def test_llm_generate_raises_value_error_naming_the_prompt(llm):
    """``LLM.generate`` raises the refused prompt's error (a ValueError naming it), and the
    engine serves on."""
    solo = llm.generate({"prompt_token_ids": GOOD}, greedy())[0].outputs[0].token_ids
    with pytest.raises(ValueError, match=r"prompt 1: .*fail_at=2 reached"):
        llm.generate([{"prompt_token_ids": GOOD}, {"prompt_token_ids": BAD}],
                     [greedy(), greedy(fail_at=2)])
    assert llm.generate({"prompt_token_ids": GOOD}, greedy())[0].outputs[0].token_ids == solo
    pool = llm.engine.core.kv_cache_manager.pool
    assert pool.num_free_blocks == pool.num_usable_blocks


def test_a_batched_processor_that_raises_still_fails_the_step(tiny_llama):
    """A processor that cannot say which row failed (a batched ``LogitsProcessor.apply``):
    the engine's fault, raised as before (nothing hides it)."""
    llm = LLM(tiny_llama.path, dtype="float32", num_kv_blocks=32, block_size=4,
              logits_processors=[f"{HERE}:Broken"])
    with pytest.raises(ZeroDivisionError):
        llm.generate([{"prompt_token_ids": GOOD}, {"prompt_token_ids": BAD}], greedy(3))
    pool = llm.engine.core.kv_cache_manager.pool
    assert pool.num_free_blocks == pool.num_usable_blocks


class Broken(FailAt):
    """A batched processor whose ``apply`` raises for the whole batch."""

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        raise ZeroDivisionError("broken processor")


@pytest.mark.timeout(300)
def test_async_llm_ends_only_the_failing_request(tiny_llama):
    """Over the engine-core process: the bad request's stream raises ``RequestRefused``
    naming ``extra_args``, the request beside it gets its solo tokens, the core serves on
    and forgets both."""
    from kvflow.config import EngineConfig
    from kvflow.engine.async_llm import AsyncLLM, collect

    engine = AsyncLLM(EngineConfig.from_kwargs(
        model=tiny_llama.path, dtype="float32", num_kv_blocks=48, block_size=4,
        logits_processors=[f"{HERE}:FailAt"]))

    async def scenario():
        await engine.start()
        try:
            solo = await collect(engine.add_request("fi-solo", None, GOOD, greedy()))
            good = engine.add_request("fi-good", None, GOOD, greedy())
            bad = engine.add_request("fi-bad", None, BAD, greedy(fail_at=2))
            with pytest.raises(RequestRefused) as refused:
                await asyncio.wait_for(collect(bad), 60)
            kept = await asyncio.wait_for(collect(good), 60)
            await wait_until_idle(engine)
            return solo, kept, refused.value
        finally:
            await engine.shutdown()

    try:
        solo, kept, error = asyncio.run(scenario())
    finally:
        engine.close()
    assert kept.outputs[0].token_ids == solo.outputs[0].token_ids
    assert kept.outputs[0].finish_reason == "length"
    assert error.field == EXTRA_ARGS and "fail_at=2 reached" in str(error)
    assert holders(engine, ["fi-good", "fi-bad", "fi-good-0", "fi-bad-0"]) == []


def test_an_adapter_that_cannot_be_read_at_first_schedule_ends_only_its_request(
        tiny_llama, tmp_path):
    """The adapter was loaded when the request was queued, removed while it waited and its
    folder then corrupted: the runner reads it again at the request's first schedule, and
    fails; only that request ends (field ``lora_request``)."""
    folder = make_adapter(tiny_llama.path, str(tmp_path / "a"), 1, r=4, lora_alpha=8,
                          target_modules=["q_proj"])
    llm = LLM(tiny_llama.path, dtype="float32", num_kv_blocks=64, block_size=4,
              enable_lora=True, max_loras=1, max_lora_rank=8)
    solo = llm.generate({"prompt_token_ids": GOOD}, greedy())[0].outputs[0].token_ids
    engine = llm.engine
    engine.add_request({"prompt_token_ids": GOOD}, greedy(), "fi-good")
    engine.add_request({"prompt_token_ids": BAD}, greedy(), "fi-bad",
                       lora_request=LoRARequest("a", 1, folder))
    assert engine.core.remove_lora(1)
    with open(os.path.join(folder, "adapter_model.safetensors"), "wb") as f:
        f.write(b"\x00not safetensors")
    tokens, errors = step_until_done(engine)  # was: the step raised, both were aborted
    assert tokens == {"fi-good": solo}
    error = errors["fi-bad"]
    assert isinstance(error, RequestRefused) and error.field == LORA_REQUEST
    assert "LoRA adapter 'a'" in str(error) and "truncated or corrupt" in str(error)
    assert_idle_and_forgotten(llm, ["fi-good", "fi-bad"])


def test_an_adapter_dropped_for_room_that_cannot_be_read_again_ends_only_its_request(
        tiny_llama, tmp_path):
    """max_cpu_loras=1: adapter ``a`` is dropped from host memory when ``b`` is loaded, and
    its folder then corrupted; the runner reads it again at its request's first schedule,
    and fails: only that request ends (field ``lora_request``), and a later request of
    ``a`` is refused alike (the drop is remembered, nothing half-read kept)."""
    folders = [make_adapter(tiny_llama.path, str(tmp_path / name), seed, r=4, lora_alpha=8,
                            target_modules=["q_proj"]) for seed, name in ((1, "a"), (2, "b"))]
    llm = LLM(tiny_llama.path, dtype="float32", num_kv_blocks=64, block_size=4,
              enable_lora=True, max_loras=1, max_cpu_loras=1, max_lora_rank=8)
    solo = llm.generate({"prompt_token_ids": GOOD}, greedy())[0].outputs[0].token_ids
    a, b = LoRARequest("a", 1, folders[0]), LoRARequest("b", 2, folders[1])
    engine = llm.engine
    for rid in ("fi-bad", "fi-bad-again"):
        engine.add_request({"prompt_token_ids": GOOD}, greedy(), "fi-good")
        engine.add_request({"prompt_token_ids": BAD}, greedy(), rid, lora_request=a)
        engine.add_request({"prompt_token_ids": BAD}, greedy(), "fi-b", lora_request=b)
        assert set(engine.core.executor.runner.lora_manager.evicted) == {1}
        with open(os.path.join(folders[0], "adapter_model.safetensors"), "wb") as f:
            f.write(b"\x00not safetensors")
        tokens, errors = step_until_done(engine)
        assert tokens["fi-good"] == solo and set(tokens) == {"fi-good", "fi-b"}
        error = errors[rid]
        assert isinstance(error, RequestRefused) and error.field == LORA_REQUEST
        assert "LoRA adapter 'a'" in str(error) and "truncated or corrupt" in str(error)
        assert_idle_and_forgotten(llm, ["fi-good", rid, "fi-b"])


class FailingMatcher:
    """A grammar matcher that raises ``error`` from ``method`` once it was called ``after``
    times (a stand-in for a matcher that cannot advance); the rest is the real matcher's."""

    def __init__(self, inner, method: str, after: int, error: Exception) -> None:
        self.inner, self.method, self.after, self.error, self.calls = \
            inner, method, after, error, 0

    def __getattr__(self, name: str):
        attr = getattr(self.inner, name)
        if name != self.method:
            return attr

        def call(*args):
            self.calls += 1
            if self.calls > self.after:
                raise self.error
            return attr(*args)
        return call


@pytest.mark.parametrize(("method", "after", "error", "error_type", "match"), [
    ("accept_tokens", 2, ValueError("token not in the grammar's state"), RequestRefused,
     "advancing its grammar: token not in the grammar's state"),
    ("fill_bitmask", 3, RuntimeError("matcher state lost"), RequestFailed,
     "filling its grammar's token mask failed: RuntimeError: matcher state lost"),
])
def test_a_grammar_matcher_that_raises_ends_only_its_request(llm, method, after, error,
                                                             error_type, match):
    """The engine core advances each constrained request's matcher after the step and fills
    its bitmask row before it: a matcher that raises there ends its request alone (field
    ``structured_outputs``); was: the exception ended the step (the server's core)."""
    from kvflow.core.request_errors import STRUCTURED_OUTPUTS
    from kvflow.structured import StructuredOutputsParams

    solo = llm.generate({"prompt_token_ids": GOOD}, greedy())[0].outputs[0].token_ids
    engine = llm.engine
    engine.add_request({"prompt_token_ids": GOOD}, greedy(), f"fi-good-{method}")
    params = SamplingParams(temperature=0.0, max_tokens=10, structured_outputs=
                            StructuredOutputsParams(regex="[a-z]{1,40}"))
    engine.add_request({"prompt_token_ids": BAD}, params, f"fi-bad-{method}")
    state = engine.core.scheduler.requests[f"fi-bad-{method}"].structured_output
    make = state._new_matcher  # the matcher is made at its first use (the first step)
    state._new_matcher = lambda compiled: FailingMatcher(make(compiled), method, after, error)
    tokens, errors = step_until_done(engine)
    assert tokens == {f"fi-good-{method}": solo}
    error = errors[f"fi-bad-{method}"]
    assert type(error) is error_type and match in str(error)
    assert error_type is RequestFailed or error.field == STRUCTURED_OUTPUTS
    assert_idle_and_forgotten(llm, [f"fi-good-{method}", f"fi-bad-{method}"])


def test_server_names_the_fields_of_step_failures():
    """The server's 400 names the request field holding the part at fault: ``vllm_xargs``
    for a logits processor's arguments (was: no ``param``), ``messages`` for an image."""
    from kvflow.core.request_errors import MULTI_MODAL_DATA
    from kvflow.entrypoints.engine_requests import refused

    xargs = refused(RequestRefused("its logits processor: bad", "x", field=EXTRA_ARGS), None)
    assert (xargs.status, xargs.param) == (400, "vllm_xargs")
    image = refused(RequestRefused("image 0: bad", "x", field=MULTI_MODAL_DATA), None)
    assert (image.status, image.param) == (400, "messages")


def test_failures_cross_the_worker_process_boundary():
    """A worker process sends its step's failures to the engine core (the mp executor's
    ``StepCodec``): the decoded output carries them unchanged."""
    from kvflow.executor.step_codec import StepCodec
    from kvflow.runner_output import ModelRunnerOutput, RequestFailure

    codec = StepCodec()
    out = ModelRunnerOutput(["a", "b"], [[1], [2]], failed={
        "b": RequestFailure("image 0: bad", "multi_modal_data", False),
        "c": RequestFailure("its logits processor failed: KeyError: 'x'", "extra_args", True)})
    assert codec.decode_result(codec.encode(out)) == out
