"""LoRA decode steps replayed as CPU step graphs (kvflow/worker/cpu_graphs.py with the native
LoRA kernel, kernels/csrc/cpu_lora.c) against transformers + peft: two random PEFT adapters and
the base model in one batch, the same prompts again under another mix of adapters (same batch
size: the same recorded program, the slots read from its static buffer), then an adapter
loaded into a slot, run, removed and its id reused for another folder between replays of one
program. Each output's tokens and logprobs are checked against peft run on them (teacher
forcing, fp32: ``tests.lora.adapters``); a replay that read a stale slot, the wrong row's
adapter or none moves logprobs by > 0.1.
"""

from __future__ import annotations

import pytest

from kvflow import LLM, SamplingParams
from kvflow.kernels.cpu_native import native_cpu_kernels
from kvflow.lora.request import LoRARequest
from kvflow.worker.cpu_graphs import CpuGraphRunner
from tests.lora.adapters import (
    MAX_TOKENS,
    PROMPTS,
    assert_output_matches_peft,
    make_late_adapter,
    make_mixed_adapters,
    mixed_batch_matches_peft,
    reload_and_refusal_match_peft,
)

pytestmark = pytest.mark.skipif(native_cpu_kernels() is None, reason="no C compiler")

GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("graph_adapters")
    return {**make_mixed_adapters(tiny_llama.path, root),
            "late": make_late_adapter(tiny_llama.path, root)}


def _engine(path: str) -> LLM:
    return LLM(model=path, dtype="float32", device="cpu", num_kv_blocks=128, block_size=4,
               enable_lora=True, max_loras=2, max_lora_rank=8)


def test_replayed_lora_steps_match_peft(tiny_llama, adapters, assert_no_leaks, monkeypatch):
    monkeypatch.setenv("KVFLOW_CPU_LORA", "native")  # (auto's choice: test_auto_choice_...)
    llm = _engine(tiny_llama.path)
    graphs = llm.engine.core.executor.runner.graph_runner
    assert isinstance(graphs, CpuGraphRunner) and graphs.lora_ctx is not None
    ids, outs = mixed_batch_matches_peft(llm, tiny_llama.path, adapters, PROMPTS, GREEDY)
    assert graphs.disabled is None and not graphs.refused and graphs.replayed_steps > 0
    replayed, programs = graphs.replayed_steps, dict(graphs.programs)
    # another mix of the same three rows: the batch size's program replays from the start
    loras = [None, LoRARequest("all", 1, adapters["all"]), LoRARequest("qv", 2, adapters["qv"])]
    again = llm.generate(ids, GREEDY, lora_request=loras, use_tqdm=False)
    for prompt, lora, out in zip(ids, loras, again):
        assert_output_matches_peft(tiny_llama.path, lora and lora.lora_path, prompt,
                                   out.outputs[0])
    assert graphs.replayed_steps - replayed == MAX_TOKENS - 1  # every decode step replayed
    assert all(graphs.programs[key] is program for key, program in programs.items())
    # slots loaded, emptied and loaded again between replays of the one-row program
    replayed = graphs.replayed_steps
    reload_and_refusal_match_peft(llm, tiny_llama.path, adapters, ids, outs, GREEDY)
    assert graphs.replayed_steps > replayed and graphs.disabled is None and not graphs.refused


def test_torch_lora_kernel_keeps_steps_eager(tiny_llama, monkeypatch):
    """``KVFLOW_CPU_LORA=torch``: the torch path, as before the kernel: no step graphs."""
    from kvflow.worker.step_graphs import cpu_step_graphs_expected

    monkeypatch.setenv("KVFLOW_CPU_LORA", "torch")
    llm = _engine(tiny_llama.path)
    assert llm.engine.core.executor.runner.graph_runner is None
    assert not cpu_step_graphs_expected(llm.engine.config)
    monkeypatch.setenv("KVFLOW_CPU_LORA", "native")
    assert cpu_step_graphs_expected(llm.engine.config)
    monkeypatch.setenv("KVFLOW_CPU_LORA", "auto")  # torch only where faster by the margin
    assert cpu_step_graphs_expected(llm.engine.config)
    monkeypatch.setenv("KVFLOW_CPU_LORA", "fast")
    with pytest.raises(ValueError, match="KVFLOW_CPU_LORA"):
        cpu_step_graphs_expected(llm.engine.config)


def test_auto_choice_decides_the_step_graphs(tiny_llama, monkeypatch):
    """``KVFLOW_CPU_LORA=auto`` (the default): the engine's choice, timed at start for its
    LoRA layers, is what its runner does: graphs with ``native``, none with ``torch``; the
    LoRA layers keep B as the transpose of a contiguous [L, R, out] (the kernel's vector
    expand)."""
    monkeypatch.delenv("KVFLOW_CPU_LORA", raising=False)
    runner = _engine(tiny_llama.path).engine.core.executor.runner
    picked = runner.lora_manager.cpu_kernel()
    assert picked in ("native", "torch")
    assert (runner.graph_runner is not None) == (picked == "native")
    layer = next(iter(runner.lora_manager.layers.values()))
    assert layer.lora_b.transpose(1, 2).is_contiguous() and not layer.lora_b.is_contiguous()
