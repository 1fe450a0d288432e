"""YaRN and dynamic-NTK models against transformers' cached greedy ``generate`` past the
original context (fp32, CPU): greedy tokens equal and each token's logprob within tolerance
(tests/models/test_parity.py's oracle rule), for whole prompts, chunked prefill and prefix
caching. The tiny configs are in tests/conftest.py: ``qwen2_rope_yarn`` (original 64 of 256
positions), ``llama_rope_yarn`` (original 32 of 128, betas 16/2, no truncation, base 500) and
``llama_rope_dynamic`` and ``gemma3_rope_dynamic`` (scaled from 48 positions up to 192),
``llama_rope_linear48`` (linear, 48 positions by 2).
"""

from __future__ import annotations

import pytest

from kvflow import LLM
from tests.models.test_parity import _prompts, assert_matches_hf, greedy


def _llm(tiny, **kwargs) -> LLM:
    kwargs = {"num_kv_blocks": 160, "block_size": 4, "max_num_seqs": 8, **kwargs}
    return LLM(model=tiny.path, dtype="float32", **kwargs)


@pytest.mark.parametrize("name, prompt_lens, max_tokens", [
    ("qwen2_rope_yarn", [100, 70, 9], 24),    # prompts past the original 64 positions
    ("llama_rope_yarn", [90, 40, 5], 24),     # past 32, up to 114 of 128
])
@pytest.mark.parametrize("chunked", [False, True], ids=["whole", "chunked"])
def test_yarn_past_the_original_context(tiny_model_factory, assert_no_leaks, name,
                                        prompt_lens, max_tokens, chunked):
    tiny = tiny_model_factory(name)
    llm = _llm(tiny, max_num_batched_tokens=16 if chunked else 512)
    prompts = _prompts(prompt_lens, tiny.vocab_size, seed=11)
    for out in llm.generate(prompts, greedy(max_tokens), use_tqdm=False):
        assert_matches_hf(tiny, out, max_tokens)
    assert_no_leaks(llm)


@pytest.mark.parametrize("prefix_caching", [True, False], ids=["pc_on", "pc_off"])
@pytest.mark.parametrize("name", ["llama_rope_dynamic", "gemma3_rope_dynamic"])
def test_dynamic_generation_runs_past_the_original_context(tiny_model_factory, assert_no_leaks,
                                                            prefix_caching, name):
    """Prompts within the 48 original positions, generation to position 139: every decoded
    token is rotated with the base for its own length, as transformers decodes it. The batch
    runs twice so the second run starts from cached prefix blocks. Gemma 3 scales its global
    layer only (a per-layer-type rope_parameters entry): its base grows from the config's 48
    positions too, not from the 192 its table covers."""
    tiny = tiny_model_factory(name)
    llm = _llm(tiny, enable_prefix_caching=prefix_caching, max_num_batched_tokens=32)
    prompts = _prompts([40, 17, 3], tiny.vocab_size, seed=12)
    for _ in range(2):
        for out in llm.generate(prompts, greedy(100), use_tqdm=False):
            assert_matches_hf(tiny, out, 100)
    assert_no_leaks(llm)


def test_dynamic_context_limit_is_scaled(tiny_model_factory):
    """max_model_len defaults to 48 x 4 positions; more is refused (the table ends there)."""
    tiny = tiny_model_factory("llama_rope_dynamic")
    assert _llm(tiny).engine.core.max_model_len == 192
    with pytest.raises(ValueError, match="the model covers \\(192: max_position_embeddings 48 "
                       "x factor 4.0 of its dynamic RoPE scaling\\)"):
        _llm(tiny, max_model_len=193)


def test_linear_scaling_serves_the_scaled_context(tiny_model_factory, assert_no_leaks):
    """Linear scaling from 48 positions by 2: max_model_len defaults to 96, as vLLM derives it
    (it was 48: an 80-token prompt was refused), and prompts past position 48 decode as
    transformers does; 97 is refused (the table ends there)."""
    tiny = tiny_model_factory("llama_rope_linear48")
    llm = _llm(tiny, max_num_batched_tokens=16)
    assert llm.engine.core.max_model_len == 96
    prompts = _prompts([80, 30, 5], tiny.vocab_size, seed=14)
    for out in llm.generate(prompts, greedy(12), use_tqdm=False):
        assert_matches_hf(tiny, out, 12)
    assert_no_leaks(llm)
    with pytest.raises(ValueError, match="the model covers \\(96"):
        _llm(tiny, max_model_len=97)


def test_longrope_prompt_past_the_original_context(tiny_model_factory, assert_no_leaks):
    """Phi-3 LongRoPE (``phi3_longrope``: short factors within 64 original positions): a
    prompt longer than 64 is rotated with the long factors at every position, as
    transformers' ``generate`` does (it picks the factors from the sequence's length), while
    a sequence within 64 keeps the short ones. The short prompt shares the long prompt's
    first 60 tokens and runs after it with prefix caching on: the long prompt's blocks
    (long-factor keys) must not be reused for it, nor its blocks for the long prompt's
    second run. Chunks of 13 tokens cross the 4-token blocks and position 64 mid-chunk."""
    tiny = tiny_model_factory("phi3_longrope")
    llm = _llm(tiny, max_num_batched_tokens=13, enable_prefix_caching=True)
    (long,) = _prompts([100], tiny.vocab_size, seed=13)
    for prompt, max_tokens in ((long, 20), (long[:60], 4), (long, 20)):
        (out,) = llm.generate([prompt], greedy(max_tokens), use_tqdm=False)
        assert_matches_hf(tiny, out, max_tokens)
    assert llm.engine.core.kv_cache_manager.num_hits >= 96  # the second long run's prefix
    assert_no_leaks(llm)
