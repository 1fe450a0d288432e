"""Multi-LoRA at context_parallel_size=2 (multiprocess executor, gloo; Ring Attention prefill:
each rank runs only its own prompt tokens through the adapted layers) against transformers +
peft: two random PEFT adapters and the base model in one batch, with prefill chunks of 8
tokens sharing steps with decodes, so every step's token split mixes rows of both adapters and
of the base; then an adapter loaded, run and removed with its id reused for another folder,
and a refused adapter that leaves both ranks serving.

A rank that applied the whole step's mapping to its share of the tokens (the adapter of
another row, or the delta of the wrong token) moves logprobs by > 0.1; the oracle is peft run
on the engine's own tokens (teacher forcing, fp32: ``tests.lora.adapters``). Run with each CPU
LoRA kernel forced (``KVFLOW_CPU_LORA``, inherited by the ranks): ``native`` runs every rank's
share of a split prefill through ``csrc/cpu_lora.c`` too (its tokens' slots renumbered,
``LoRAContext.select``), ``torch`` the grouped torch matmuls (a second CP=2 engine, so in
scripts/test_distributed_slow.sh: the torch path is the single-process tests' default).
"""

from __future__ import annotations

import pytest

from kvflow import LLM, SamplingParams
from tests.distributed.conftest import SLOW, shutdown_and_check
from tests.lora.adapters import (
    MAX_TOKENS,
    PROMPTS,
    make_late_adapter,
    make_mixed_adapters,
    mixed_batch_matches_peft,
    reload_and_refusal_match_peft,
)

GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("cp_adapters")
    return {**make_mixed_adapters(tiny_llama.path, root),
            "late": make_late_adapter(tiny_llama.path, root)}


@pytest.mark.parametrize("cpu_lora", ["native", pytest.param("torch", marks=SLOW)])
def test_two_adapters_and_base_at_cp2_match_peft(tiny_llama, adapters, cpu_lora, monkeypatch):
    monkeypatch.setenv("KVFLOW_CPU_LORA", cpu_lora)
    llm = LLM(model=tiny_llama.path, dtype="float32", device="cpu", num_kv_blocks=64,
              block_size=4, max_num_batched_tokens=8, enable_lora=True, max_loras=2,
              max_lora_rank=8, context_parallel_size=2, distributed_executor_backend="mp")
    try:
        ids, outs = mixed_batch_matches_peft(llm, tiny_llama.path, adapters, PROMPTS, GREEDY)
        # the ring split ran: each rank computed about half of the prompt tokens, not all
        stats = llm.engine.core.executor.collective_rpc("step_stats")
        every_token = sum(len(p) for p in ids) + len(ids) * (MAX_TOKENS - 1)
        assert all(s["dense_tokens"] < every_token for s in stats), (stats, every_token)
        reload_and_refusal_match_peft(llm, tiny_llama.path, adapters, ids, outs, GREEDY)
    finally:
        shutdown_and_check(llm)
