"""LLaVA through ``kvflow serve``: /v1/chat/completions with ``image_url`` data URLs.

Oracle: transformers' ``LlavaProcessor`` (its chat template + ``<image>`` expansion) and
``LlavaForConditionalGeneration.generate`` on the same tiny random weights (CLIP tower,
Llama decoder): the server's greedy tokens equal them for one and two images; more images
than ``--limit-mm-per-prompt`` allows get a 400.
"""

from __future__ import annotations

import json

import httpx
import pytest

from tests.e2e.conftest import ServerProcess
from tests.multimodal.conftest import data_url, hf_generate, random_image

MAX_TOKENS = 6
ARGS = ["--dtype", "float32", "--device", "cpu", "--num-kv-blocks", "128", "--block-size", "16",
        "--limit-mm-per-prompt", json.dumps({"image": 2})]


def prestart_servers(fixture):
    """This module's server, started ahead by a module before it in this folder
    (``_prestart_next_module`` in tests/e2e/conftest.py, a fixture of
    tests/multimodal/conftest.py too)."""
    return [(fixture("tiny_llava").path, ARGS, None)]


@pytest.fixture(scope="module")
def server(start_server, request):
    server = start_server.declared(request)
    yield server
    server.terminate()


def chat(server: ServerProcess, parts: list) -> httpx.Response:
    content = [{"type": "text", "text": p} if isinstance(p, str) else
               {"type": "image_url", "image_url": {"url": data_url(p)}} for p in parts]
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": MAX_TOKENS,
            "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)


def hf_chat_tokens(tiny, parts: list) -> list[int]:
    hf_parts = [{"type": "text", "text": p} if isinstance(p, str) else {"type": "image"}
                for p in parts]
    text = tiny.processor.apply_chat_template([{"role": "user", "content": hf_parts}],
                                              add_generation_prompt=True, tokenize=False)
    return hf_generate(tiny, text, [p for p in parts if not isinstance(p, str)], MAX_TOKENS)


@pytest.mark.parametrize("parts", [
    [random_image(84, 56, 1), "what is this?"],
    ["compare", random_image(120, 200, 2), random_image(300, 90, 3), "now"],
], ids=["1_image", "2_images"])
def test_chat_image_url_equals_transformers(server, tiny_llava, parts):
    resp = chat(server, parts)
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["token_ids"] == hf_chat_tokens(tiny_llava, parts)


def test_more_images_than_the_limit_is_a_400(server):
    resp = chat(server, ["three:", *(random_image(60, 60, s) for s in range(3))])
    assert resp.status_code == 400, resp.text
    assert "3 images" in resp.json()["error"]["message"]
