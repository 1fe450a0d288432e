"""vLLM's ``LLM.reset_mm_cache()`` on the tiny LLaVA (prefix caching off, so every run needs
the image's embeddings): the same image a second time is an encoder-cache hit (not encoded
again); after ``reset_mm_cache`` it is encoded again, with transformers' tokens each time;
after ``collective_rpc("reload_weights")`` too (the new models' encoder caches are empty)."""

from __future__ import annotations

from kvflow import LLM, SamplingParams
from tests.multimodal.conftest import LLAVA_IMAGE, hf_generate, random_image

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def test_reset_mm_cache_encodes_the_image_again(tiny_llava):
    llm = LLM(tiny_llava.path, dtype="float32", num_kv_blocks=64, block_size=4,
              enable_prefix_caching=False)
    text = f"USER: {LLAVA_IMAGE}\ndescribe the picture please ASSISTANT:"
    image = random_image(64, 64, 10)
    encoder = llm.engine.core.scheduler.encoder

    def run() -> list[int]:
        (out,) = llm.generate({"prompt": text, "multi_modal_data": {"image": image}}, GREEDY,
                              use_tqdm=False)
        return out.outputs[0].token_ids

    expected = hf_generate(tiny_llava, text, [image], GREEDY.max_tokens)
    assert run() == expected and encoder.num_encoded == 1
    assert run() == expected and (encoder.num_encoded, encoder.num_hits) == (1, 1)
    assert llm.reset_mm_cache() is None
    assert encoder.num_cached_tokens == 0
    assert run() == expected and (encoder.num_encoded, encoder.num_hits) == (2, 1)


def test_reload_weights_forgets_the_images(tiny_llava):
    """``collective_rpc("reload_weights")`` builds new models, whose encoder caches are
    empty: the scheduler's mirror still listed the image, so the next request with it skipped
    the encode and the runner found no rows (KeyError; the server's engine core died)."""
    llm = LLM(tiny_llava.path, dtype="float32", num_kv_blocks=64, block_size=4,
              enable_prefix_caching=False)
    text = f"USER: {LLAVA_IMAGE}\ndescribe the picture please ASSISTANT:"
    image = random_image(64, 64, 10)
    encoder = llm.engine.core.scheduler.encoder
    prompt = {"prompt": text, "multi_modal_data": {"image": image}}
    expected = hf_generate(tiny_llava, text, [image], GREEDY.max_tokens)
    assert llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == expected
    assert encoder.num_encoded == 1 and encoder.num_cached_tokens > 0

    assert llm.collective_rpc("reload_weights") == [None]
    assert encoder.num_cached_tokens == 0
    assert llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == expected
    assert encoder.num_encoded == 2  # encoded again
