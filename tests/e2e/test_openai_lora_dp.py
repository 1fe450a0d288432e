"""``kvflow serve --data-parallel-size 2 --enable-lora``: an adapter given at start-up
(``--lora-modules``) and one loaded through ``/v1/load_lora_adapter`` each answer a request of
two prompts, which the balancer spreads over both replicas (each replica's ``engine`` series
in /metrics grows), with peft's greedy tokens and logprobs; a refused load is a 400 that
leaves both replicas serving; an unloaded adapter is a 404."""

from __future__ import annotations

import httpx

from tests.e2e.conftest import RUNTIME_LORA_ENV
from tests.e2e.test_data_parallel import per_engine
from tests.lora.adapters import MAX_TOKENS, check_tokens_against_peft, make_adapter

PROMPTS = [[85, 73, 70, 222, 314, 302, 40, 41], [9, 250, 31, 77, 120, 5]]


def _adapters(tiny_llama, built_models) -> dict[str, str]:
    def build(root: str) -> dict[str, str]:
        return {
            "all": make_adapter(tiny_llama.path, f"{root}/all", 31, r=8, lora_alpha=16,
                                target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                "gate_proj", "up_proj", "down_proj"]),
            "qv": make_adapter(tiny_llama.path, f"{root}/qv", 32, r=4, lora_alpha=8,
                               use_rslora=True, target_modules=["q_proj", "v_proj",
                                                                "down_proj"]),
            "r16": make_adapter(tiny_llama.path, f"{root}/r16", 33, r=16,
                                target_modules=["q_proj"]),
        }

    return built_models("http_dp_adapters", build)[1]


def prestart_servers(fixture):
    """This module's server, taken with ``start_server.declared`` and started ahead
    (``_prestart_next_module`` in conftest.py)."""
    tiny_llama = fixture("tiny_llama")
    adapters = _adapters(tiny_llama, fixture("built_models"))
    return [(tiny_llama.path, ["--dtype", "float32", "--device", "cpu", "--num-kv-blocks", "64",
                               "--block-size", "4", "--served-model-name", "base",
                               "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8",
                               "--data-parallel-size", "2",
                               "--lora-modules", f"all={adapters['all']}"], RUNTIME_LORA_ENV)]


def _check_both_replicas(server, tiny_llama, model: str, adapter: str | None) -> None:
    """One request of both prompts under ``model``: each replica runs one, peft's tokens."""
    before = per_engine(server, "kvflow:prefix_cache_queries_total")
    resp = httpx.post(f"{server.url}/v1/completions", timeout=120, json={
        "model": model, "prompt": PROMPTS, "max_tokens": MAX_TOKENS, "temperature": 0,
        "ignore_eos": True, "logprobs": 1, "return_token_ids": True})
    assert resp.status_code == 200, resp.text
    after = per_engine(server, "kvflow:prefix_cache_queries_total")
    assert all(after[e] > before[e] for e in ("0", "1")), (before, after)
    for choice in sorted(resp.json()["choices"], key=lambda c: c["index"]):
        check_tokens_against_peft(tiny_llama.path, adapter, PROMPTS[choice["index"]],
                                  choice["token_ids"], choice["logprobs"]["token_logprobs"])


def test_lora_over_two_replicas(start_server, request, tiny_llama, built_models):
    adapters = _adapters(tiny_llama, built_models)
    server = start_server.declared(request)
    url = server.url
    _check_both_replicas(server, tiny_llama, "all", adapters["all"])  # from --lora-modules
    resp = httpx.post(f"{url}/v1/load_lora_adapter", timeout=60,
                      json={"lora_name": "qv", "lora_path": adapters["qv"]})
    assert resp.status_code == 200, resp.text
    _check_both_replicas(server, tiny_llama, "qv", adapters["qv"])
    resp = httpx.post(f"{url}/v1/load_lora_adapter", timeout=60,
                      json={"lora_name": "big", "lora_path": adapters["r16"]})
    assert resp.status_code == 400 and "max_lora_rank=8" in resp.json()["error"]["message"]
    assert httpx.post(f"{url}/v1/unload_lora_adapter", timeout=60,
                      json={"lora_name": "qv"}).status_code == 200
    resp = httpx.post(f"{url}/v1/completions", timeout=60,
                      json={"model": "qv", "prompt": PROMPTS[0], "max_tokens": 2})
    assert resp.status_code == 404
