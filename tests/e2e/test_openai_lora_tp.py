"""``kvflow serve --enable-lora`` over two ranks, ``--tensor-parallel-size 2`` and
``--context-parallel-size 2`` (Ring Attention prefill, chunks of 8 tokens, so a step's token
split mixes the three requests' rows): an adapter given at start-up (``--lora-modules``), one
loaded through ``/v1/load_lora_adapter`` and the base model answer concurrent requests with
peft's greedy tokens and logprobs (both ranks hold their shards, or under CP their copies); a
refused load is a 400 that leaves both ranks serving; an unloaded adapter is a 404."""

from __future__ import annotations

import concurrent.futures

import httpx
import pytest

from tests.distributed.conftest import SLOW
from tests.e2e.conftest import RUNTIME_LORA_ENV
from tests.lora.adapters import MAX_TOKENS, check_tokens_against_peft, make_adapter

PROMPTS = {"all": [85, 73, 70, 222, 314, 302, 40, 41], "qv": [9, 250, 31, 77, 120, 5],
           "base": [40, 41, 42, 43, 44, 45, 46]}


def _adapters(tiny_llama, built_models) -> dict[str, str]:
    def build(root: str) -> dict[str, str]:
        return {
            "all": make_adapter(tiny_llama.path, f"{root}/all", 21, r=8, lora_alpha=16,
                                target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                "gate_proj", "up_proj", "down_proj"]),
            "qv": make_adapter(tiny_llama.path, f"{root}/qv", 22, r=4, lora_alpha=8,
                               use_rslora=True, target_modules=["q_proj", "v_proj",
                                                                "down_proj"]),
            "r16": make_adapter(tiny_llama.path, f"{root}/r16", 23, r=16,
                                target_modules=["q_proj"]),
        }

    return built_models("http_tp_adapters", build)[1]


PARALLEL = {"tp": ["--tensor-parallel-size", "2"],
            "cp": ["--context-parallel-size", "2", "--max-num-batched-tokens", "8"]}
# The CP=2 case is a sibling of the TP=2 one (the same routes, and adapter loads sent to both
# ranks the same way) in the slow run (scripts/test_distributed_slow.sh); CP=2 + LoRA,
# including an adapter loaded, run, removed and refused, stays in the default run in
# tests/distributed/test_lora_context_parallel.py.
SLOW_PARALLEL = ("cp",)


def _declaration(tiny_llama, adapters: dict[str, str], parallel: str) -> tuple:
    """(model, args, env) of the ``parallel`` server."""
    return (tiny_llama.path, ["--dtype", "float32", "--device", "cpu", "--num-kv-blocks", "64",
                              "--block-size", "4", "--served-model-name", "base",
                              "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8",
                              *PARALLEL[parallel], "--lora-modules", f"all={adapters['all']}"],
            RUNTIME_LORA_ENV)


def prestart_servers(fixture):
    """This module's default-run servers (one per ``PARALLEL`` entry not in
    ``SLOW_PARALLEL``), started ahead (``_prestart_next_module`` in conftest.py) and taken by
    ``start_server`` with the same arguments."""
    tiny_llama = fixture("tiny_llama")
    adapters = _adapters(tiny_llama, fixture("built_models"))
    return [_declaration(tiny_llama, adapters, name) for name in PARALLEL
            if name not in SLOW_PARALLEL]


def _complete(url: str, model: str, prompt: list[int]) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", timeout=120, json={
        "model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
        "ignore_eos": True, "logprobs": 1, "return_token_ids": True})


@pytest.mark.parametrize("parallel", [pytest.param(name, marks=SLOW if name in SLOW_PARALLEL
                                                      else ()) for name in PARALLEL])
def test_lora_over_two_ranks(start_server, tiny_llama, built_models, parallel):
    adapters = _adapters(tiny_llama, built_models)
    model, args, env = _declaration(tiny_llama, adapters, parallel)
    server = start_server(model, args, env=env)
    url = server.url
    resp = httpx.post(f"{url}/v1/load_lora_adapter", timeout=60,
                      json={"lora_name": "qv", "lora_path": adapters["qv"]})
    assert resp.status_code == 200, resp.text
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        futures = {name: pool.submit(_complete, url, name, prompt)
                   for name, prompt in PROMPTS.items()}
        got = {name: f.result() for name, f in futures.items()}
    for name, resp in got.items():
        assert resp.status_code == 200, resp.text
        choice = resp.json()["choices"][0]
        check_tokens_against_peft(tiny_llama.path, adapters.get(name), PROMPTS[name],
                                  choice["token_ids"], choice["logprobs"]["token_logprobs"])
    resp = httpx.post(f"{url}/v1/load_lora_adapter", timeout=60,
                      json={"lora_name": "big", "lora_path": adapters["r16"]})
    assert resp.status_code == 400 and "max_lora_rank=8" in resp.json()["error"]["message"]
    assert httpx.post(f"{url}/v1/unload_lora_adapter", timeout=60,
                      json={"lora_name": "qv"}).status_code == 200
    assert _complete(url, "qv", PROMPTS["qv"]).status_code == 404
    again = _complete(url, "base", PROMPTS["base"])  # both ranks still serve
    assert again.status_code == 200
    assert again.json()["choices"][0]["token_ids"] == \
        got["base"].json()["choices"][0]["token_ids"]
