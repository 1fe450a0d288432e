"""Sleep mode on CUDA (skipped without a GPU): level 1 moves the weights to host memory and
frees the KV cache, level 2 drops both; torch.cuda.memory_allocated falls by at least the KV
cache's bytes (plus the weights' bytes), and greedy tokens after the wake-up (CUDA graphs
captured again) equal those before the sleep."""

from __future__ import annotations

import gc

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

PROMPTS = [[(7 * i + 3 * j) % 500 + 1 for j in range(n)] for i, n in enumerate((5, 17, 40))]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("tiny-llama-gpu-sleep")
    cfg = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=512)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(path)
    return str(path)


def _greedy(llm) -> list[list[int]]:
    from kvflow import SamplingParams

    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                        use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _allocated() -> int:
    gc.collect()
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_frees_cuda_memory_and_wakes_to_the_same_tokens(tiny_llama, level):
    from kvflow import LLM

    llm = LLM(model=tiny_llama, dtype="float32", skip_tokenizer_init=True, num_kv_blocks=2048,
              device="cuda", enable_sleep_mode=True)
    expected = _greedy(llm)
    kv_bytes = sum(llm.collective_rpc("kv_cache_bytes"))
    weight_bytes = llm.engine.core.weight_bytes
    before = _allocated()
    llm.sleep(level=level)
    freed = before - _allocated()
    assert freed >= kv_bytes + weight_bytes, (freed, kv_bytes, weight_bytes)
    llm.wake_up()
    if level == 2:
        llm.collective_rpc("reload_weights")
    assert llm.engine.core.executor.runner.graph_runner is not None
    assert _greedy(llm) == expected
