"""Options a text-generating decoder's engine reads by default stay as they were when the
unread ones are refused elsewhere (kvflow/core/unread_options.py): left out, prefix caching is
on for a decoder (a repeated prompt hits its cached blocks) and the engine generates
transformers' greedy tokens."""

from __future__ import annotations

import pytest
import torch

from kvflow import LLM, SamplingParams

IDS = [5, 17, 42, 8, 99, 3, 61, 12, 7, 33, 21, 54, 2, 80, 19, 40, 11]


def _hf_greedy(tiny, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = tiny.hf_model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=n,
                                     eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


def _greedy(llm: LLM, ids: list[int], n: int) -> list[int]:
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    (out,) = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)
    return list(out.outputs[0].token_ids)


@pytest.fixture(scope="module")
def default_llm(tiny_llama) -> LLM:
    return LLM(model=tiny_llama.path, dtype="float32", device="cpu", num_kv_blocks=32,
               block_size=4)


def test_a_decoder_caches_prefixes_by_default_and_generates_as_transformers(tiny_llama,
                                                                             default_llm):
    kv = default_llm.engine.core.kv_cache_manager
    expected = _hf_greedy(tiny_llama, IDS, 10)
    assert _greedy(default_llm, IDS, 10) == expected
    hits = kv.num_hits
    assert _greedy(default_llm, IDS, 10) == expected
    assert kv.enable_prefix_caching is True and kv.num_hits > hits


@pytest.mark.parametrize("caching", [True, False])
def test_a_decoder_takes_prefix_caching_either_way(tiny_llama, caching):
    llm = LLM(model=tiny_llama.path, dtype="float32", device="cpu", num_kv_blocks=32,
              block_size=4, enable_prefix_caching=caching)
    expected = _hf_greedy(tiny_llama, IDS, 6)
    assert _greedy(llm, IDS, 6) == expected and _greedy(llm, IDS, 6) == expected
    kv = llm.engine.core.kv_cache_manager
    assert (kv.enable_prefix_caching, kv.num_hits > 0) == (caching, caching)


@pytest.mark.parametrize("options, named", [
    ({"encoder_cache_size": 4096}, "encoder_cache_size=4096"),
    ({"max_num_encoder_input_tokens": 512}, "max_num_encoder_input_tokens=512"),
    ({"encoder_cache_size": 16384, "max_num_encoder_input_tokens": 64},
     "max_num_encoder_input_tokens=64, encoder_cache_size=16384"),
    ({"allowed_media_domains": "images.example.com"},
     "allowed_media_domains='images.example.com'"),
    ({"max_image_bytes": 1024}, "max_image_bytes=1024"),
    ({"max_image_pixels": 4096 * 4096}, "max_image_pixels=16777216"),
    ({"max_images_per_prompt": 16}, "max_images_per_prompt=16"),
    ({"media_fetch_timeout": 2.5}, "media_fetch_timeout=2.5"),
    ({"encoder_cache_size": 4096, "media_fetch_timeout": 10.0, "max_image_bytes": 1024},
     "max_image_bytes=1024, media_fetch_timeout=10.0, encoder_cache_size=4096"),
])
def test_a_text_only_model_refuses_image_settings(tiny_llama, options, named):
    """The vision encoder's step budget and cache exist only for a model that takes images,
    and images are fetched, decoded and counted only for one (the API side's image processor
    is None for a text-only model): for a text-only one they were accepted and never read
    (the defaults' values too, given: 16384 tokens, 4096 x 4096 pixels, 16 images, 10 s)."""
    them = "them" if "," in named else "it"
    with pytest.raises(ValueError) as e:
        LLM(model=tiny_llama.path, dtype="float32", device="cpu", num_kv_blocks=32, **options)
    assert str(e.value) == (f"{named}: LlamaForCausalLM is a text-only model, which takes no "
                            f"images, so nothing reads {them}; leave {them} out")


def test_a_text_only_model_has_no_encoder_cache(default_llm):
    assert default_llm.engine.core.scheduler.encoder is None


def test_serve_says_it_in_one_line(tiny_llama, capfd):
    """``kvflow serve`` of a text-only model with --allowed-media-domains: one error line
    naming the flag, before the server listens."""
    from kvflow.entrypoints.cli import main

    rc = main(["serve", tiny_llama.path, "--port", "0", "--device", "cpu", "--num-kv-blocks", "32",
               "--allowed-media-domains", "images.example.com,127.0.0.1"])
    err = [line for line in capfd.readouterr().err.splitlines() if line.strip()]
    assert rc == 2 and err == [
        ("kvflow: error: --allowed-media-domains='images.example.com,127.0.0.1': "
         "LlamaForCausalLM is a text-only model, which takes no images, so nothing reads it; "
         "leave it out")], err
