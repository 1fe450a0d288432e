"""Multi-LoRA at tensor_parallel_size=2 (multiprocess executor, gloo) against transformers +
peft: two random PEFT adapters (every linear layer r=8; q/v/down r=4 rsLoRA) and the base
model in one batch; an adapter loaded and unloaded while the engine runs; a refused adapter
that leaves both ranks running; Phi-3's fused ``qkv_proj`` / ``gate_up_proj`` targets.

The oracle is peft run on the engine's own tokens (teacher forcing, fp32; the tolerance's
derivation is ``tests.lora.adapters.check_tokens_against_peft``'s): adding the row-parallel
delta after the all-reduce, or keeping a removed adapter's slot, fails here.

Phi-3's fused targets and the one-KV-head Llama run in scripts/test_distributed_slow.sh: each
rank's slices of fused and replicated-KV-head pairs are checked in one process by
tests/lora/test_lora_tp_sharding.py (against the base layers' own weight loaders), and the
default run keeps the mixed batch (adapters loaded, removed and refused on both ranks) and the
MLA model at TP=2 here; ``max_cpu_loras`` at TP=2 runs in the slow script too (its one-process
cases: tests/lora/test_lora_cpu_cache.py).
"""

from __future__ import annotations

import pytest

from kvflow import LLM, SamplingParams
from kvflow.lora.request import LoRARequest
from tests.distributed.conftest import SLOW, shutdown_and_check, slow
from tests.lora.adapters import (
    ALL_LINEAR,
    LOGPROB_ATOL,
    MAX_TOKENS,
    PROMPTS,
    assert_output_matches_peft,
    make_adapter,
    make_late_adapter,
    make_mixed_adapters,
    mixed_batch_matches_peft,
    peft_logprobs,
    reload_and_refusal_match_peft,
)

GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tp_adapters")
    return {**make_mixed_adapters(tiny_llama.path, root),
            "late": make_late_adapter(tiny_llama.path, root)}


def test_two_adapters_and_base_at_tp2_match_peft(tiny_llama, adapters):
    """One batch of [all, qv, base] at TP=2; then 'late' is loaded, run and unloaded, and its
    id reused for another folder (a rank that kept the old weights would decode 'late');
    a refused adapter leaves both ranks serving."""
    llm = LLM(model=tiny_llama.path, dtype="float32", device="cpu", num_kv_blocks=64,
              block_size=4, enable_lora=True, max_loras=2, max_lora_rank=8,
              tensor_parallel_size=2, distributed_executor_backend="mp")
    try:
        ids, outs = mixed_batch_matches_peft(llm, tiny_llama.path, adapters, PROMPTS, GREEDY)
        # dynamic: load 'late' (every rank), run it, unload it, reuse its id for 'qv'
        again = reload_and_refusal_match_peft(llm, tiny_llama.path, adapters, ids, outs,
                                              GREEDY)
        assert again.outputs[0].token_ids == outs[1].outputs[0].token_ids
    finally:
        shutdown_and_check(llm)


@slow
def test_phi3_fused_targets_at_tp2_match_peft(tiny_model_factory, tmp_path):
    """Phi-3's adapters target the fused ``qkv_proj`` and ``gate_up_proj`` whole: each rank
    keeps each slice's (q, k, v; gate, up) rows of the one B."""
    tiny = tiny_model_factory("phi3_longrope")
    path = make_adapter(tiny.path, str(tmp_path / "phi3"), 7, r=4, lora_alpha=8,
                        target_modules=["qkv_proj", "gate_up_proj", "o_proj", "down_proj"])
    llm = LLM(model=tiny.path, dtype="float32", device="cpu", num_kv_blocks=64,
              block_size=4, enable_lora=True, max_lora_rank=4, tensor_parallel_size=2,
              distributed_executor_backend="mp")
    try:
        ids = llm.get_tokenizer().encode(PROMPTS[0])
        outs = llm.generate([ids, ids], GREEDY, lora_request=[LoRARequest("phi", 1, path),
                                                              None], use_tqdm=False)
        assert_output_matches_peft(tiny.path, path, ids, outs[0].outputs[0])
        assert_output_matches_peft(tiny.path, None, ids, outs[1].outputs[0])
        assert outs[0].outputs[0].token_ids != outs[1].outputs[0].token_ids
    finally:
        shutdown_and_check(llm)


@pytest.mark.parametrize("name, targets", [
    # one KV head for 4 query heads: both ranks hold it, so both keep all of k's / v's B
    pytest.param("llama_mqa", ALL_LINEAR, marks=SLOW),
    # MLA: q_a_proj / kv_a_proj_with_mqa replicated (whole pairs), q_b_proj split by head,
    # o_proj row-parallel (peft would target the MoE experts' fused parameters by the MLP
    # names, which kvflow refuses)
    ("deepseek_v3", ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj"]),
])
def test_prompt_logprobs_at_tp2_match_peft(tiny_model_factory, tmp_path, name, targets):
    tiny = tiny_model_factory(name)
    path = make_adapter(tiny.path, str(tmp_path / name), 9, r=4, lora_alpha=8,
                        target_modules=targets)
    llm = LLM(model=tiny.path, dtype="float32", device="cpu", num_kv_blocks=32,
              block_size=4, enable_lora=True, max_lora_rank=4, tensor_parallel_size=2,
              distributed_executor_backend="mp")
    try:
        ids = llm.get_tokenizer().encode(PROMPTS[1])
        (out,) = llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=0),
                              lora_request=LoRARequest(name, 1, path), use_tqdm=False)
    finally:
        shutdown_and_check(llm)
    ref, base = peft_logprobs(tiny.path, path, ids), peft_logprobs(tiny.path, None, ids)
    for p in range(1, len(ids)):
        got = out.prompt_logprobs[p][ids[p]].logprob
        assert got == pytest.approx(ref[p - 1, ids[p]].item(), abs=LOGPROB_ATOL), p
    assert (ref - base).abs().max().item() > 1e-1  # the adapter changes the logprobs


@slow
def test_max_cpu_loras_drops_the_same_adapters_on_both_ranks(tiny_llama, adapters):
    """max_loras=1, max_cpu_loras=2 at TP=2: three adapters used in turn, then the first
    again (dropped meanwhile: read again on both ranks). After each request both ranks hold
    the same two adapters (``list_loras``), and every output is peft's."""
    llm = LLM(model=tiny_llama.path, dtype="float32", device="cpu", num_kv_blocks=64,
              block_size=4, enable_lora=True, max_loras=1, max_cpu_loras=2, max_lora_rank=8,
              tensor_parallel_size=2, distributed_executor_backend="mp")
    try:
        ids = llm.get_tokenizer().encode(PROMPTS[0])
        loras = [LoRARequest(name, i + 1, adapters[name])
                 for i, name in enumerate(("all", "qv", "late"))]
        held = []
        for lora in (*loras, loras[0]):
            out = llm.generate([ids], GREEDY, lora_request=lora, use_tqdm=False)[0]
            assert_output_matches_peft(tiny_llama.path, lora.lora_path, ids, out.outputs[0])
            by_rank = llm.collective_rpc("list_loras")
            assert by_rank[0] == by_rank[1]
            held.append(by_rank[0])
        assert held == [{1}, {1, 2}, {2, 3}, {3, 1}]
    finally:
        shutdown_and_check(llm)
