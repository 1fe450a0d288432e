"""Qwen2-VL with chunked prefill, prefix-cache hits on the same image and preemption at once,
against transformers' greedy tokens (fp32, CPU): a 10-token step budget cuts each image
across steps, a 4-token block size lets hits end inside an image's rows, and a small pool
preempts requests that share an image's blocks (recomputed, under ``--preemption-mode swap``
too: requests with images are not swapped)."""

from __future__ import annotations

import pytest

from kvflow import LLM, SamplingParams
from tests.multimodal.conftest import PLACEHOLDER, hf_generate, random_image

MAX_TOKENS = 6


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_chunks_hits_on_one_image_and_preemption_equal_transformers(tiny_qwen2_vl, mode,
                                                                    monkeypatch,
                                                                    assert_no_leaks):
    from tests.core.swap_checks import always_swap

    if mode == "swap":
        always_swap(monkeypatch)
    image, other = random_image(120, 200, 2), random_image(84, 56, 1)
    cases = [(f"{PLACEHOLDER} describe it", [image]),
             (f"{PLACEHOLDER} describe the colours of it", [image]),
             (f"look: {PLACEHOLDER} and {PLACEHOLDER} compare", [other, image]),
             (f"{PLACEHOLDER} describe it", [other]),
             (f"{PLACEHOLDER} describe", [image])]
    llm = LLM(tiny_qwen2_vl.path, dtype="float32", num_kv_blocks=20, block_size=4,
              max_num_batched_tokens=10, enable_prefix_caching=True, preemption_mode=mode,
              **({"swap_space": "1MiB"} if mode == "swap" else {}))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    prompts = [{"prompt": t, "multi_modal_data": {"image": imgs}} for t, imgs in cases]
    llm.generate(prompts[:1], params, use_tqdm=False)  # caches the image's blocks
    outs = llm.generate(prompts, params, use_tqdm=False)
    for (text, images), out in zip(cases, outs):
        assert out.outputs[0].token_ids == hf_generate(tiny_qwen2_vl, text, images,
                                                       MAX_TOKENS), text
    core = llm.engine.core
    assert core.kv_cache_manager.num_hits > 0
    assert core.scheduler.num_preemptions > 0
    if mode == "swap":  # requests with images are recomputed (README, Preemption)
        assert core.scheduler.swap.num_swapped_out == 0
    assert_no_leaks(llm)
