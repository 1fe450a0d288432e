"""Multi-LoRA at pipeline_parallel_size=2 (multiprocess executor, gloo; the tiny Llama's two
layers, one per stage) against transformers + peft: two random PEFT adapters and the base
model in one batch, then an adapter of layer 1 only (stage 0 keeps none of its weights), then
that adapter removed and its id reused for another folder, and a refused adapter that leaves
both stages serving. Each stage applies the adapters of its own layers: a stage refusing the
other's weights, or applying none, fails here (the random adapters move logprobs by > 0.1).

The oracle is peft run on the engine's own tokens (teacher forcing, fp32:
``tests.lora.adapters.check_tokens_against_peft``).
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from kvflow import LLM, SamplingParams
from kvflow.lora.request import LoRARequest
from tests.lora.adapters import (
    ALL_LINEAR,
    MAX_TOKENS,
    PROMPTS,
    assert_output_matches_peft,
    make_adapter,
    make_mixed_adapters,
    mixed_batch_matches_peft,
)

GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)


def _with_bad_layer1_shape(src: str, dst: str) -> str:
    """A copy of adapter ``src`` whose layer-1 q_proj lora_A has one input column too many
    (stage 0, holding layer 0, never checks it)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    path = os.path.join(dst, "adapter_model.safetensors")
    tensors = load_file(path)
    key = next(k for k in tensors if "layers.1.self_attn.q_proj.lora_A" in k)
    tensors[key] = torch.cat([tensors[key], tensors[key][:, :1]], dim=1)
    save_file(tensors, path)
    return dst


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("pp_adapters")
    adapters = make_mixed_adapters(tiny_llama.path, root)
    return {
        **adapters,
        "layer1": make_adapter(tiny_llama.path, str(root / "layer1"), 5, r=2, lora_alpha=4,
                               target_modules=ALL_LINEAR, layers_to_transform=[1]),
        "bad_layer1": _with_bad_layer1_shape(adapters["all"], str(root / "bad_layer1")),
    }


def test_adapters_over_two_stages_match_peft(tiny_llama, adapters):
    llm = LLM(model=tiny_llama.path, dtype="float32", device="cpu", num_kv_blocks=64,
              block_size=4, enable_lora=True, max_loras=2, max_lora_rank=8,
              pipeline_parallel_size=2, distributed_executor_backend="mp")
    try:
        ids, _ = mixed_batch_matches_peft(llm, tiny_llama.path, adapters, PROMPTS, GREEDY)
        # weights of layer 1 only: stage 0 holds none of them, stage 1 all
        one = llm.generate([ids[0]], GREEDY, lora_request=LoRARequest("layer1", 3,
                                                                      adapters["layer1"]),
                           use_tqdm=False)[0]
        assert_output_matches_peft(tiny_llama.path, adapters["layer1"], ids[0], one.outputs[0])
        assert llm.engine.core.remove_lora(3)
        again = llm.generate([ids[0]], GREEDY, lora_request=LoRARequest("layer1", 3,
                                                                        adapters["qv"]),
                             use_tqdm=False)[0]
        assert_output_matches_peft(tiny_llama.path, adapters["qv"], ids[0], again.outputs[0])
        with pytest.raises(ValueError, match="max_lora_rank"):
            llm.generate([ids[1]], GREEDY, lora_request=LoRARequest("wide", 9,
                                                                    adapters["too_wide"]),
                         use_tqdm=False)
        # a shape only stage 1 checks: refused there, forgotten by stage 0 too, so the id
        # reused for a good folder runs that folder on both stages
        with pytest.raises(ValueError, match="layers.1.self_attn.q_proj"):
            llm.generate([ids[1]], GREEDY, lora_request=LoRARequest("bad1", 4,
                                                                    adapters["bad_layer1"]),
                         use_tqdm=False)
        good = llm.generate([ids[1]], GREEDY, lora_request=LoRARequest("bad1", 4,
                                                                       adapters["qv"]),
                            use_tqdm=False)[0]
        assert_output_matches_peft(tiny_llama.path, adapters["qv"], ids[1], good.outputs[0])
        base = llm.generate([ids[1]], GREEDY, use_tqdm=False)[0]  # both stages still serve
        assert_output_matches_peft(tiny_llama.path, None, ids[1], base.outputs[0])
    finally:
        llm.shutdown()
