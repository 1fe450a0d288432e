"""Multi-LoRA over HTTP: ``kvflow serve --enable-lora --lora-modules`` with the tiny Llama and
random PEFT adapters; the adapters and the base model answer concurrent requests (batched in
one engine step) with transformers + peft's greedy tokens; adapters load and unload at run
time and show in /v1/models; bad names and adapters get vLLM's 4xx, and a bad
``--lora-modules`` adapter stops ``kvflow serve`` before the model loads."""

from __future__ import annotations

import concurrent.futures
import re

import httpx
import pytest

from tests.e2e.conftest import RUNTIME_LORA_ENV
from tests.lora.adapters import MAX_TOKENS, make_adapter, peft_greedy

PROMPTS = {"all": "the quick brown fox jumps over", "qv": "prefix caching reuses them, chunked",
           "base": "a lazy dog while kvflow pages keys"}


def _adapters(tiny_llama, built_models) -> dict[str, str]:
    def build(root: str) -> dict[str, str]:
        return {
            "all": make_adapter(tiny_llama.path, f"{root}/all", 11, r=8, lora_alpha=16,
                                target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                "gate_proj", "up_proj", "down_proj"]),
            "qv": make_adapter(tiny_llama.path, f"{root}/qv", 12, r=4, lora_alpha=4,
                               target_modules=["q_proj", "v_proj"]),
            "r16": make_adapter(tiny_llama.path, f"{root}/r16", 13, r=16,
                                target_modules=["q_proj"]),
        }

    return built_models("http_adapters", build)[1]


def _server_args(adapters: dict[str, str]) -> dict[str, list[str]]:
    return {"good": ["--dtype", "float32", "--device", "cpu", "--num-kv-blocks", "128",
                     "--block-size", "4", "--served-model-name", "base", "--enable-lora",
                     "--max-loras", "2", "--max-lora-rank", "8",
                     "--lora-modules", f"all={adapters['all']}"],
            "bad": ["--dtype", "float32", "--num-kv-blocks", "64", "--enable-lora",
                    "--max-lora-rank", "8", "--lora-modules", f"big={adapters['r16']}"]}


def prestart_servers(fixture):
    """This module's server (conftest.py's ``server`` fixture takes it), started ahead
    (``_prestart_next_module`` in conftest.py)."""
    tiny_llama = fixture("tiny_llama")
    args = _server_args(_adapters(tiny_llama, fixture("built_models")))
    return [(tiny_llama.path, args["good"], RUNTIME_LORA_ENV)]


@pytest.fixture(scope="module")
def adapters(tiny_llama, built_models) -> dict[str, str]:
    return _adapters(tiny_llama, built_models)


def complete(server, model: str, prompt: str) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/completions", timeout=120, json={
        "model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
        "ignore_eos": True, "return_token_ids": True})


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=60)


def test_adapters_and_base_batched_match_peft(server, tiny_llama, adapters, tiny_tokenizer):
    resp = post(server, "/v1/load_lora_adapter", {"lora_name": "qv", "lora_path": adapters["qv"]})
    assert resp.status_code == 200, resp.text
    models = httpx.get(f"{server.url}/v1/models").json()["data"]
    assert [(m["id"], m.get("parent")) for m in models] == \
        [("base", None), ("all", "base"), ("qv", "base")]
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        futures = {name: pool.submit(complete, server, name, prompt)
                   for name, prompt in PROMPTS.items()}
        got = {name: f.result() for name, f in futures.items()}
    for name, resp in got.items():
        assert resp.status_code == 200, resp.text
        ids = tiny_tokenizer.encode(PROMPTS[name])
        expected = peft_greedy(tiny_llama.path, adapters.get(name), ids)
        assert resp.json()["choices"][0]["token_ids"] == expected, name
        assert resp.json()["model"] == name  # the adapter's name is echoed, as vLLM does


def test_unknown_model_is_a_404(server):
    resp = complete(server, "no-such-adapter", "hi")
    assert resp.status_code == 404
    assert resp.json()["error"]["code"] == "model_not_found"


def test_bad_adapters_are_refused_at_load(server, adapters, tmp_path):
    resp = post(server, "/v1/load_lora_adapter", {"lora_name": "big", "lora_path": adapters["r16"]})
    assert resp.status_code == 400 and "max_lora_rank=8" in resp.json()["error"]["message"]
    resp = post(server, "/v1/load_lora_adapter", {"lora_name": "all", "lora_path": adapters["qv"]})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "lora_name"
    resp = post(server, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(tmp_path)})
    assert resp.status_code == 400 and "adapter_config.json" in resp.json()["error"]["message"]
    assert complete(server, "big", "hi").status_code == 404  # nothing half-loaded
    assert complete(server, "base", "hi").status_code == 200  # the engine keeps serving


def test_unload(server, adapters):
    assert post(server, "/v1/load_lora_adapter",
                {"lora_name": "tmp", "lora_path": adapters["qv"]}).status_code == 200
    assert complete(server, "tmp", "hi").status_code == 200
    assert post(server, "/v1/unload_lora_adapter", {"lora_name": "tmp"}).status_code == 200
    assert complete(server, "tmp", "hi").status_code == 404
    resp = post(server, "/v1/unload_lora_adapter", {"lora_name": "tmp"})
    assert resp.status_code == 404 and resp.json()["error"]["param"] == "lora_name"
    assert resp.json()["error"]["code"] == "model_not_found"  # was null
    # served under VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 only, with vLLM's warning
    assert "LoRA dynamic loading & unloading is enabled in the API server" in server.log()


def test_load_inplace_replaces_the_adapter(server, tiny_llama, adapters, tiny_tokenizer):
    """vLLM's ``load_inplace``: a name in use is refused without it (the message says to send
    it), replaced with it (the replies are then the new adapter's), and a refused replacement
    leaves the old adapter serving; the field is not logged as unknown."""
    ids = tiny_tokenizer.encode(PROMPTS["qv"])

    def tokens() -> list[int]:
        resp = complete(server, "swap", PROMPTS["qv"])
        assert resp.status_code == 200, resp.text
        return resp.json()["choices"][0]["token_ids"]

    load = {"lora_name": "swap", "lora_path": adapters["qv"]}
    assert post(server, "/v1/load_lora_adapter", load).status_code == 200
    assert tokens() == peft_greedy(tiny_llama.path, adapters["qv"], ids)
    resp = post(server, "/v1/load_lora_adapter", {**load, "lora_path": adapters["all"]})
    assert resp.status_code == 400 and "load_inplace" in resp.json()["error"]["message"]
    resp = post(server, "/v1/load_lora_adapter",
                {**load, "lora_path": adapters["all"], "load_inplace": True})
    assert resp.status_code == 200, resp.text
    expected = peft_greedy(tiny_llama.path, adapters["all"], ids)
    assert tokens() == expected != peft_greedy(tiny_llama.path, adapters["qv"], ids)
    roots = {m["id"]: m["root"] for m in httpx.get(f"{server.url}/v1/models").json()["data"]}
    assert roots["swap"] == adapters["all"]
    resp = post(server, "/v1/load_lora_adapter",
                {**load, "lora_path": adapters["r16"], "load_inplace": True})
    assert resp.status_code == 400 and "max_lora_rank=8" in resp.json()["error"]["message"]
    assert tokens() == expected  # the refused one replaced nothing
    assert post(server, "/v1/unload_lora_adapter", {"lora_name": "swap"}).status_code == 200
    assert "load_inplace" not in server.log()


def test_bad_lora_module_stops_start_up(tiny_llama, adapters, monkeypatch, capsys):
    """A rank-16 adapter over --max-lora-rank 8: refused from its adapter_config.json before
    the model loads, one line naming the flag, exit status 2
    (tests/test_lora_modules_precheck.py has the exact line). ``kvflow serve`` runs
    in-process with its engine replaced by a failure: a server process started only to be
    refused cost a whole process start-up."""
    from kvflow.engine import async_llm
    from kvflow.entrypoints.cli import main

    def no_engine(*args, **kwargs):
        raise AssertionError("the engine was started")

    monkeypatch.setattr(async_llm.AsyncLLM, "__init__", no_engine)
    rc = main(["serve", tiny_llama.path, "--port", "0", *_server_args(adapters)["bad"]])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert rc == 2 and len(err) == 1, err
    assert re.fullmatch(r"kvflow: error: --lora-modules big=.*rank 16 exceeds "
                        r"--max-lora-rank=8 .*", err[0]), err
