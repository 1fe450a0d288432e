"""The native CPU LoRA kernel (kernels/csrc/cpu_lora.c) in eager steps (prefills, and every step
under ``enforce_eager``), not only in replayed CPU step graphs: two random PEFT adapters (ranks 8
and 4) and the base model prefilled in one batch, every output's tokens and logprobs checked
against transformers + peft (fp32, teacher forcing: ``tests.lora.adapters``) with
``KVFLOW_CPU_LORA=native`` and ``torch``; the kernel's calls counted, so the native one is seen
running the multi-row prefills (and torch's path seen running them without it). Odd ranks and
in/out sizes through the layer's mapping: GroupedLoRA with the mapping an eager step carries
against a float64 per-token loop.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvflow import LLM, SamplingParams
from kvflow.kernels import cpu_native_lora
from kvflow.kernels.cpu_native import native_cpu_kernels
from kvflow.lora.layers import GroupedLoRA, make_mapping
from tests.lora.adapters import MAX_TOKENS, PROMPTS, make_mixed_adapters, mixed_batch_matches_peft

pytestmark = pytest.mark.skipif(native_cpu_kernels() is None, reason="no C compiler")

GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory) -> dict[str, str]:
    return make_mixed_adapters(tiny_llama.path, tmp_path_factory.mktemp("eager_adapters"))


@pytest.fixture
def native_rows(monkeypatch) -> list[int]:
    """Rows of each native LoRA kernel call made meanwhile."""
    rows: list[int] = []
    original = cpu_native_lora.LoRAKernels.lora

    def counted(self, y, x, lora_a, lora_b, slots):
        rows.append(int((slots >= 0).sum()))
        return original(self, y, x, lora_a, lora_b, slots)

    monkeypatch.setattr(cpu_native_lora.LoRAKernels, "lora", counted)
    return rows


@pytest.mark.parametrize("kernel", ["native", "torch"])
def test_eager_mixed_adapter_prefill_matches_peft(tiny_llama, adapters, native_rows,
                                                  monkeypatch, kernel):
    monkeypatch.setenv("KVFLOW_CPU_LORA", kernel)
    llm = LLM(model=tiny_llama.path, dtype="float32", device="cpu", num_kv_blocks=128,
              block_size=4, enable_lora=True, max_loras=2, max_lora_rank=8, enforce_eager=True)
    runner = llm.engine.core.executor.runner
    assert runner.graph_runner is None
    assert runner.lora_manager.eager_cpu_kernel(2048) == kernel
    mixed_batch_matches_peft(llm, tiny_llama.path, adapters, PROMPTS, GREEDY)
    if kernel == "torch":
        assert not native_rows
    else:  # the prefill of both adapted prompts in one call per layer, the decode steps too
        prompt_tokens = sum(len(llm.get_tokenizer().encode(p)) for p in PROMPTS[:2])
        assert max(native_rows) == prompt_tokens and 2 in native_rows


@pytest.mark.parametrize("rank,in_features,out", [(1, 33, 17), (5, 97, 131), (13, 64, 200)])
def test_eager_mapping_runs_the_kernel_at_odd_ranks(rank, in_features, out):
    """GroupedLoRA on an eager step's mapping (``row_slots``: the tokens' slots as
    ``LoRAManager.step_mapping`` attaches them) over three adapters and unadapted rows, against
    a float64 per-token loop; the torch path on the same mapping without ``row_slots`` too."""
    gen = torch.Generator().manual_seed(rank)
    slots = np.array([0, 0, 0, -1, 2, 2, 1, 1, 1, 1, -1, 2, 0, 0], dtype=np.int64)  # 3 requests
    x = torch.randn(len(slots), in_features, generator=gen).bfloat16()
    y = torch.randn(len(slots), out, generator=gen).bfloat16()
    a = torch.randn(3, rank, in_features, generator=gen) / in_features**0.5
    b = (torch.randn(3, rank, out, generator=gen) / rank**0.5).transpose(1, 2)
    mapping = make_mapping(slots, torch.device("cpu"))
    eager = mapping.__class__(**{**vars(mapping),
                                 "row_slots": torch.from_numpy(slots.astype(np.int32))})
    ref, delta = y.double().clone(), torch.zeros(y.shape, dtype=torch.float64)
    for t, s in enumerate(slots):
        if s >= 0:
            delta[t] = (x[t].double() @ a[s].double().T) @ b[s].double().T
    ref += delta
    # bf16 y: the delta rounds once (2^-8 of it), the sum once (2^-8 of the result); fp32
    # math's error is far below (and the rounded delta is added to the sum's bound)
    bound = 2.0**-8 * (delta.abs() + ref.abs() + 2.0**-8 * delta.abs()) + 1e-5
    op = GroupedLoRA()
    for got in (op(y.clone(), x, a, b, eager), op(y.clone(), x, a, b, mapping)):
        assert ((got.double() - ref).abs() <= bound).all()
        assert torch.equal(got[slots < 0], y[slots < 0])
