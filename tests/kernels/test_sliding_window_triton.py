"""The Triton attention backend with several KV-cache groups (Gemma 3: a full-attention group
and a sliding-window group whose released leading blocks read as the null block) gives the
torch backend's greedy tokens, on CPU with Triton in the interpreter."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

PROMPTS = [[(7 * i + 13 * j) % 300 + 2 for j in range(n)] for i, n in enumerate((5, 30, 37))]


def _greedy(path: str, backend: str) -> list[list[int]]:
    from kvflow import LLM, SamplingParams

    llm = LLM(model=path, dtype="float32", skip_tokenizer_init=True, num_kv_blocks=64,
              block_size=4, max_num_batched_tokens=16, max_num_seqs=4,
              attention_backend=backend, device="cpu")
    assert len(llm.engine.core.kv_cache_config.kv_cache_groups) == 2
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
                        use_tqdm=False)
    kv = llm.engine.core.kv_cache_manager
    kv.pool.check_invariants()
    assert kv.num_free_blocks == kv.pool.num_usable_blocks
    return [o.outputs[0].token_ids for o in outs]


def test_triton_matches_torch_with_kv_cache_groups(tiny_model_factory):
    path = tiny_model_factory("gemma3").path
    assert _greedy(path, "triton") == _greedy(path, "torch")
