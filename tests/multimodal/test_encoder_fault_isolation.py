"""The vision encoder raising on one request's image ends that request alone.

Was: the exception failed the whole step (every request in it aborted, ``LLM`` raised it, the
server's engine core died). Now the batched encoder call that raises is retried image by
image; the requests holding an image that fails alone end with its error (``RequestRefused``,
field ``multi_modal_data``, for a ValueError), the others run on. Oracle: transformers'
greedy tokens (``hf_generate``); every KV block free and no container holding the ids.
The same over 2 worker processes, the image failing on one rank only (rank 1 of TP=2, the
first of two pipeline stages): ``test_an_image_failing_on_one_rank_ends_only_its_request``.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvflow import LLM
from kvflow.core.request_errors import MULTI_MODAL_DATA, RequestError
from kvflow.engine.streams import RequestRefused
from tests.multimodal.conftest import PLACEHOLDER, hf_generate, random_image
from tests.request_state import holders
from tests.test_step_fault_isolation import greedy, step_until_done


@pytest.fixture(scope="module")
def llm(tiny_qwen2_vl) -> LLM:
    return LLM(tiny_qwen2_vl.path, dtype="float32", num_kv_blocks=256, block_size=8)


@pytest.mark.parametrize("config", ["plain", "async_chunked"])
def test_an_image_the_encoder_fails_on_ends_only_its_request(llm, tiny_qwen2_vl, config):
    """The vision encoder raises on one request's image (a stand-in for an image it cannot
    take): the batched call fails, each image is encoded alone, and only the request holding
    the failing image ends (field ``multi_modal_data``); the text-only request and the
    request with a good image beside it get transformers' tokens. The failed image is not
    left in the encoder-cache mirror, nor its K/V in the prefix cache: the same prompt with
    an encoder that works again gets transformers' tokens."""
    if config == "async_chunked":  # images cut across steps, step N+1 launched before N ends
        llm = LLM(tiny_qwen2_vl.path, dtype="float32", num_kv_blocks=256, block_size=8,
                  async_scheduling=True, max_num_batched_tokens=24)
    model = llm.engine.core.executor.runner.mm_runner.model
    good_image, bad_image = random_image(84, 56, 1), random_image(120, 200, 2)
    bad_rows = []

    def flaky(pixel_values, grid_thw, **kwargs):
        if any(p.shape == bad_rows[0].shape and torch.equal(p, bad_rows[0])
               for p in pixel_values):
            raise ValueError("the encoder cannot take this image")
        return type(model).embed_multimodal(model, pixel_values, grid_thw, **kwargs)

    prompts = {"fi-text": ("the quick brown fox jumps over", []),
               "fi-good": (f"a {PLACEHOLDER} what is this?", [good_image]),
               "fi-bad": (f"look {PLACEHOLDER} here", [bad_image])}
    engine = llm.engine
    for rid, (text, images) in prompts.items():
        engine.add_request({"prompt": text, "multi_modal_data": {"image": images}},
                           greedy(6), rid)
    bad_rows.append(engine.core.scheduler.requests["fi-bad"].mm_features[0].pixel_values())
    model.embed_multimodal = flaky
    try:
        tokens, errors = step_until_done(engine)  # was: the step raised, all were aborted
    finally:
        del model.embed_multimodal
    for rid in ("fi-text", "fi-good"):
        assert tokens[rid] == hf_generate(tiny_qwen2_vl, *prompts[rid], 6)
    assert "fi-bad" not in tokens
    error = errors["fi-bad"]
    assert isinstance(error, RequestRefused) and error.field == MULTI_MODAL_DATA
    assert "image 0: the encoder cannot take this image" in str(error)
    again = llm.generate({"prompt": prompts["fi-bad"][0],
                          "multi_modal_data": {"image": [bad_image]}}, greedy(6))
    assert again[0].outputs[0].token_ids == hf_generate(tiny_qwen2_vl, *prompts["fi-bad"], 6)
    pool = engine.core.kv_cache_manager.pool
    pool.check_invariants()
    assert pool.num_free_blocks == pool.num_usable_blocks
    assert holders(llm, list(prompts)) == []


@pytest.mark.parametrize(("change", "match"), [
    ({"grid_thw": (1, 2, 2)}, r"grid_thw \[1, 2, 2\] .* product is its \d+ patch rows"),
    ({"data": b"\0" * 8}, r"image 0: data must be \[\d+, \d+\] float32 values"),
    ({"offset": 10_000}, r"image 0: placeholders \[10000, \d+\) must lie in the prompt"),
    ({"modality": "audio"}, "modality 'audio' is not image or video"),
])
def test_preprocessed_images_that_do_not_hold_what_they_say_are_refused(llm, change, match):
    """Images handed over preprocessed (``AsyncLLM.add_request``'s ``mm_features``, a
    ``ProcessedPrompt``, the core's queue) are checked before they are queued: was accepted,
    and the step they were encoded in raised (every request of it failed)."""
    from kvflow.inputs.prompts import ProcessedPrompt
    from kvflow.request import Request

    engine = llm.engine
    processed = engine.processor.process({"prompt": f"a {PLACEHOLDER} b",
                                          "multi_modal_data": {"image": random_image(84, 56, 5)}})
    bad = [dataclasses.replace(processed.mm_features[0], **change)]
    with pytest.raises(ValueError, match=match):
        engine.add_request(ProcessedPrompt(None, processed.token_ids, bad), greedy(4), "fi-mm")
    assert not engine.has_unfinished_requests()
    with pytest.raises(RequestError, match=match) as refused:  # one past a front end
        engine.core.add_request(Request("fi-mm-core", processed.token_ids, greedy(4),
                                        mm_features=bad))
    assert refused.value.field == MULTI_MODAL_DATA
    assert not engine.core.has_unfinished_requests()


@pytest.mark.parametrize(("parallel", "fault_rank"), [
    ({"tensor_parallel_size": 2}, 1),  # rank 1's encoder alone fails
    # the first stage (rank 0) runs the encoder; images cut across micro-batches in flight
    ({"pipeline_parallel_size": 2, "max_num_batched_tokens": 24}, None),
], ids=["tp2-rank1", "pp2-first-stage-chunked"])
def test_an_image_failing_on_one_rank_ends_only_its_request(tiny_qwen2_vl, parallel,
                                                            fault_rank):
    """Over 2 worker processes (tests/distributed/test_parallel_fault_isolation.py's
    ``RankFaults``): a solid image fails in the vision encoder of one rank, its request ends
    with a 400 (``RequestRefused``, field ``multi_modal_data``) and the text request and the
    request with a good image beside it get transformers' tokens. Was: PP=2 raised
    ``ExecutorError`` (the first stage's worker died), TP=2 ran the request on with wrong
    tokens (rank 1 without the image, rank 0 with it) and never ended it."""
    from PIL import Image

    from tests.distributed.conftest import shutdown_and_check
    from tests.distributed.test_parallel_fault_isolation import start
    from tests.test_step_fault_isolation import assert_idle_and_forgotten

    llm = start(tiny_qwen2_vl.path, fault_rank, **parallel)
    try:
        prompts = {"pf-text": ("the quick brown fox jumps over", []),
                   "pf-good": (f"a {PLACEHOLDER} what is this?", [random_image(84, 56, 1)]),
                   "pf-bad": (f"look {PLACEHOLDER} here",
                              [Image.new("RGB", (120, 200), (200, 30, 90))])}
        engine = llm.engine
        for rid, (text, images) in prompts.items():
            engine.add_request({"prompt": text, "multi_modal_data": {"image": images}},
                               greedy(6), rid)
        tokens, errors = step_until_done(engine)
        assert set(tokens) == {"pf-text", "pf-good"} and set(errors) == {"pf-bad"}
        for rid in tokens:
            assert tokens[rid] == hf_generate(tiny_qwen2_vl, *prompts[rid], 6)
        error = errors["pf-bad"]
        assert isinstance(error, RequestRefused) and error.field == MULTI_MODAL_DATA
        assert "image 0: the encoder cannot take a solid image" in str(error)
        assert_idle_and_forgotten(llm, list(prompts))
    finally:
        shutdown_and_check(llm)
