"""--async-scheduling on the tiny model: the same tokens as lock-step scheduling (the oracle),
with the next step's forward pass really launched before the previous step's tokens are
folded in.

Each workload runs on two engines built alike but for ``async_scheduling``; every output
(token ids, finish and stop reasons, logprobs, prompt logprobs) must be equal. The workloads
mix greedy and seeded random sampling, stop tokens, max_tokens, min_tokens, n > 1, penalties,
logit bias, logprobs, structured output, chunked prefill, prefix caching and a KV pool small
enough to preempt.
"""

from __future__ import annotations

import argparse

import pytest

from kvflow import LLM, SamplingParams
from kvflow.config import EngineConfig
from kvflow.kernels.cpu_native import native_cpu_kernels
from kvflow.structured import StructuredOutputsParams

SMALL_KV_CACHE = "32MiB"
PROMPTS = ["the quick brown fox", "kvflow pages keys and values", "prefix caching reuses them,",
           "chunked prefill splits long prompts into pieces of the step budget", "a", "b c"]


def _engines(tiny_llama, **kwargs) -> tuple[LLM, LLM]:
    common = {"model": tiny_llama.path, "dtype": "float32", "block_size": 16, **kwargs}
    if "num_kv_blocks" not in kwargs:  # not the default (a share of free memory): 2 engines
        common["kv_cache_memory"] = SMALL_KV_CACHE
    return LLM(async_scheduling=False, **common), LLM(async_scheduling=True, **common)


def _outputs(llm: LLM, prompts, params) -> list:
    return [(c.token_ids, c.finish_reason, c.stop_reason, c.logprobs, o.prompt_logprobs)
            for o in llm.generate(prompts, params, use_tqdm=False) for c in o.outputs]


def _assert_same_up_to_rounding(actual: list, expected: list) -> None:
    """Token ids, finish and stop reasons, logprob ranks and decoded tokens equal; logprob
    values within 1e-4 (float32 rounding of a tiny model's logits)."""
    assert len(actual) == len(expected)
    for got, want in zip(actual, expected):
        assert got[:3] == want[:3]
        for got_lps, want_lps in ((got[3], want[3]), (got[4], want[4])):
            assert (got_lps is None) == (want_lps is None)
            for g, w in zip(got_lps or [], want_lps or []):
                assert (g is None) == (w is None)
                if g is None:
                    continue
                assert g.keys() == w.keys()
                for token in g:
                    assert (g[token].rank, g[token].decoded_token) == \
                        (w[token].rank, w[token].decoded_token)
                    assert abs(g[token].logprob - w[token].logprob) <= 1e-4


def _mixed_params(eos_like: int) -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0, max_tokens=12),
        SamplingParams(temperature=0.9, seed=3, max_tokens=9, top_p=0.9, logprobs=2),
        SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[eos_like]),
        SamplingParams(temperature=1.0, seed=5, max_tokens=7, n=3, presence_penalty=0.5,
                       frequency_penalty=0.3, repetition_penalty=1.2),
        SamplingParams(temperature=0, max_tokens=5, min_tokens=4, logit_bias={7: 2.0},
                       prompt_logprobs=2),
        SamplingParams(temperature=0.7, seed=1, max_tokens=1),
    ]


@pytest.fixture(scope="module")
def stop_token(tiny_llama) -> int:
    """A token the greedy run of prompt 2 emits mid-way: it stops that request early."""
    llm = LLM(model=tiny_llama.path, dtype="float32", block_size=16,
              kv_cache_memory=SMALL_KV_CACHE)
    out = llm.generate(PROMPTS[2], SamplingParams(temperature=0, max_tokens=20),
                       use_tqdm=False)
    return out[0].outputs[0].token_ids[5]


@pytest.mark.parametrize("kwargs", [
    {},
    {"max_num_batched_tokens": 8},  # chunked prefill mixed with decodes
    {"num_kv_blocks": 9, "enable_prefix_caching": False},  # preemptions, no sharing
])
def test_same_outputs_as_lock_step(tiny_llama, stop_token, kwargs):
    sync, overlap = _engines(tiny_llama, **kwargs)
    params = _mixed_params(stop_token)
    expected = _outputs(sync, PROMPTS, params)
    actual = _outputs(overlap, PROMPTS, params)
    if "num_kv_blocks" in kwargs and native_cpu_kernels() is None:
        # The engines preempt at different steps; a preempted request's recompute is a
        # prefill, which on the torch backend rounds differently from its decodes: the same
        # tokens, logprobs equal to float32 rounding (the native kernels give them bitwise).
        _assert_same_up_to_rounding(actual, expected)
    else:
        assert actual == expected
    tokens, finish, stop = expected[2][:3]  # the stop id stopped it before max_tokens
    assert (finish, stop, tokens[-1]) == ("stop", stop_token, stop_token) and len(tokens) < 20
    if "num_kv_blocks" in kwargs:
        assert overlap.engine.core.scheduler.num_preemptions > 0


def _count_decode_allocations(llm: LLM) -> list[tuple[str, int]]:
    """(request id, computed count) at each one-token ``try_allocate_slots`` call of the
    engine's KV manager from now on."""
    kv, calls = llm.engine.core.scheduler.kv, []
    real = kv.try_allocate_slots

    def counted(request, num_new_tokens, *args):
        if num_new_tokens == 1:
            calls.append((request.request_id, request.num_computed_tokens))
        return real(request, num_new_tokens, *args)

    kv.try_allocate_slots = counted
    return calls


def test_decodes_skip_the_kv_manager_as_lock_step_does(tiny_llama, assert_no_leaks):
    """Async scheduling's decodes (each with its last token still out) take the promise of
    ``Request.kv_steady_until`` as lock-step ones do: the same one-token KV manager calls,
    at block boundaries only (block size 4: at most 2 in 4 decodes; was: every decode), the
    same tokens, and every block free at the end."""
    sync, overlap = _engines(tiny_llama, block_size=4)
    params = SamplingParams(temperature=0, max_tokens=17, ignore_eos=True)
    counts = [_count_decode_allocations(llm) for llm in (sync, overlap)]
    outputs = [_outputs(llm, PROMPTS[:3], params) for llm in (sync, overlap)]
    assert outputs[1] == outputs[0]
    assert sorted(counts[1]) == sorted(counts[0])
    num_decodes = 3 * 16
    assert 0 < len(counts[1]) <= num_decodes // 2
    for llm in (sync, overlap):
        assert_no_leaks(llm)


def test_structured_output_same_as_lock_step(tiny_llama):
    sync, overlap = _engines(tiny_llama)
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=24,
                             structured_outputs=StructuredOutputsParams(**kind))
              for i, kind in enumerate([{"json_object": True}, {"regex": r"[a-c]{2,6}"},
                                        {"choice": ["yes", "no"]}, {"regex": r"\d+"}])]
    prompts = PROMPTS[:4]
    expected = _outputs(sync, prompts, params)
    assert _outputs(overlap, prompts, params) == expected
    assert any(e[1] == "stop" for e in expected)


def test_next_forward_is_launched_before_tokens_are_folded_in(tiny_llama):
    """The order of calls on the executor: launch N+1's forward, collect N, sample N+1; and
    step N+1's inputs read N's tokens on the device."""
    _, overlap = _engines(tiny_llama)
    executor, runner = overlap.engine.core.executor, overlap.engine.core.executor.runner
    calls, pending = [], []
    for name in ("launch_forward", "collect_output", "launch_sampling"):
        real = getattr(executor, name)

        def traced(*args, _real=real, _name=name):
            calls.append(_name)
            return _real(*args)
        setattr(executor, name, traced)
    real_forward = runner._forward

    def forward(inputs, *args, **kwargs):
        pending.append(len(inputs.pending_token_index))
        return real_forward(inputs, *args, **kwargs)
    runner._forward = forward
    overlap.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    order = "".join({"launch_forward": "f", "collect_output": "c", "launch_sampling": "s"}[n]
                    for n in calls)
    assert "fcs" in order  # forward N+1, then collect N, then sample N+1
    assert max(pending) == 2  # both requests' inputs came from the device


def test_a_failing_step_aborts_both_steps_and_the_engine_recovers(tiny_llama, monkeypatch,
                                                                  assert_no_leaks):
    sync, overlap = _engines(tiny_llama)
    params = SamplingParams(temperature=0, max_tokens=8)
    expected = _outputs(sync, PROMPTS[:2], params)
    runner = overlap.engine.core.executor.runner
    real, calls = runner.launch_forward, []

    def broken(sched, *args):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("simulated kernel failure")
        return real(sched, *args)
    monkeypatch.setattr(runner, "launch_forward", broken)
    with pytest.raises(RuntimeError, match="simulated"):
        overlap.generate(PROMPTS[:2], params, use_tqdm=False)
    monkeypatch.setattr(runner, "launch_forward", real)
    assert_no_leaks(overlap)
    assert _outputs(overlap, PROMPTS[:2], params) == expected


def test_async_scheduling_with_several_ranks_is_refused(tiny_llama):
    with pytest.raises(ValueError, match="async-scheduling"):
        LLM(model=tiny_llama.path, async_scheduling=True, tensor_parallel_size=2,
            distributed_executor_backend="mp")


@pytest.mark.parametrize(("argv", "expected"), [
    ([], None), (["--async-scheduling"], True), (["--no-async-scheduling"], False)])
def test_flag_parses_to_on_off_or_platform_default(argv, expected):
    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    config = EngineConfig.from_cli_args(parser.parse_args(argv))
    assert config.scheduler_config.async_scheduling is expected


def test_platform_default_applies_when_not_given(tiny_llama):
    llm = LLM(model=tiny_llama.path, dtype="float32",  # neither form of the flag
              kv_cache_memory=SMALL_KV_CACHE)
    assert llm.engine.core.platform.default_async_scheduling is False
    assert llm.engine.core.scheduler.async_scheduling is False
