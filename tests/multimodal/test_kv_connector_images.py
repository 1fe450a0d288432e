"""SharedStorageConnector with images (tiny Qwen2-VL): a block's key names the images whose
placeholders it overlaps, so a consumer loads an image prompt's blocks for the same image
only. Oracles: transformers' greedy tokens (``hf_generate``), and hand counts from the
placeholder's position in transformers' expanded prompt ids (``hf_prompt_ids``).
"""

from __future__ import annotations

from kvflow import LLM, SamplingParams
from tests.multimodal.conftest import PLACEHOLDER, hf_generate, hf_prompt_ids, random_image

BLOCK_SIZE = 4
MAX_TOKENS = 6
TEXT = f"the quick brown fox jumps over {PLACEHOLDER} what is this?"


def _llm(tiny, folder: str, role: str) -> LLM:
    return LLM(tiny.path, dtype="float32", num_kv_blocks=256, block_size=BLOCK_SIZE,
               enable_prefix_caching=False,
               kv_transfer_config={"kv_connector": "SharedStorageConnector", "kv_role": role,
                                   "kv_connector_extra_config": {"shared_storage_path": folder}})


def test_image_prompt_loads_its_images_blocks(tiny_qwen2_vl, tmp_path):
    """The producer prefills the prompt with image A. A consumer loads every whole block but
    the last token's for image A (tokens equal transformers'); for image B with the same
    text, only the blocks wholly before the placeholder (tokens equal transformers' with B)."""
    image_a, image_b = random_image(84, 56, 1), random_image(84, 56, 2)
    producer = _llm(tiny_qwen2_vl, str(tmp_path), "kv_producer")
    try:
        producer.generate({"prompt": TEXT, "multi_modal_data": {"image": [image_a]}},
                          SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    finally:
        producer.shutdown()
    consumer = _llm(tiny_qwen2_vl, str(tmp_path), "kv_consumer")
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    try:
        outs = consumer.generate([{"prompt": TEXT, "multi_modal_data": {"image": [image]}}
                                  for image in (image_a, image_b)], greedy, use_tqdm=False)
    finally:
        consumer.shutdown()
    ids = hf_prompt_ids(tiny_qwen2_vl, TEXT, [image_a])
    assert ids == hf_prompt_ids(tiny_qwen2_vl, TEXT, [image_b])  # same size: same ids
    first_pad = ids.index(tiny_qwen2_vl.image_token_id)
    assert first_pad >= BLOCK_SIZE  # some blocks lie before the image
    assert [o.metrics.num_cached_tokens for o in outs] == \
        [(len(ids) - 1) // BLOCK_SIZE * BLOCK_SIZE, first_pad // BLOCK_SIZE * BLOCK_SIZE]
    for out, image in zip(outs, (image_a, image_b)):
        assert out.outputs[0].token_ids == hf_generate(tiny_qwen2_vl, TEXT, [image], MAX_TOKENS)
