"""Disaggregated prefill served: a ``kv_producer`` server and a ``kv_consumer`` server share a
SharedStorageConnector folder (vLLM's two-instance example). A prompt prefilled on the
producer (``max_tokens=1``) is loaded by the consumer: its
``usage.prompt_tokens_details.cached_tokens`` is the prompt's whole blocks but the last
token's, ``(prompt_tokens - 1) // block_size * block_size`` (computed by hand), and its
greedy tokens and logprobs equal the producer's own full run of the prompt (which computed
it); a prompt never prefilled loads nothing."""

from __future__ import annotations

import json

import pytest

MODEL = "tiny"
BLOCK_SIZE = 4
PROMPT = list(range(40, 62))  # 22 tokens: 5 whole blocks before the last token
ARGS = ["--dtype", "float32", "--device", "cpu", "--num-kv-blocks", "128",
        "--block-size", str(BLOCK_SIZE), "--max-model-len", "128",
        "--served-model-name", MODEL, "--enable-prompt-tokens-details"]


def _kv(folder: str, role: str) -> list[str]:
    return ["--kv-transfer-config", json.dumps({
        "kv_connector": "SharedStorageConnector", "kv_role": role,
        "kv_connector_extra_config": {"shared_storage_path": folder}})]


def prestart_servers(fixture):
    """The producer and the consumer, on one folder under the session's temporary base."""
    folder = str(fixture("tmp_path_factory").getbasetemp() / "kv_transfer_e2e")
    model = fixture("tiny_chat_model")
    return [(model, ARGS + _kv(folder, "kv_producer"), None),
            (model, ARGS + _kv(folder, "kv_consumer"), None)]


@pytest.fixture(scope="module")
def servers(start_server, request):
    producer = start_server.declared(request, 0, wait=False)
    consumer = start_server.declared(request, 1)
    producer.wait_ready()
    return producer.client(), consumer.client()


def _complete(client, prompt: list[int], max_tokens: int):
    return client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens,
                                     temperature=0, logprobs=2)


def test_consumer_loads_what_the_producer_prefilled(servers):
    producer, consumer = servers
    first = _complete(producer, PROMPT, 1)
    assert first.usage.prompt_tokens == len(PROMPT)
    got = _complete(consumer, PROMPT, 5)
    assert got.usage.prompt_tokens_details.cached_tokens == \
        (len(PROMPT) - 1) // BLOCK_SIZE * BLOCK_SIZE  # 20
    want = _complete(producer, PROMPT, 5)
    assert got.choices[0].text == want.choices[0].text
    for g, w in zip(got.choices[0].logprobs.token_logprobs,
                    want.choices[0].logprobs.token_logprobs):
        assert abs(g - w) < 1e-4


def test_unseen_prompt_loads_nothing(servers):
    _, consumer = servers
    got = _complete(consumer, list(range(100, 113)), 2)
    assert got.usage.prompt_tokens_details.cached_tokens == 0


# what vLLM's disaggregated-prefill proxies send: the prefill instance is told to keep the
# KV for a remote decode, the decode instance gets what the prefill's reply handed back (or,
# when it handed nothing back, as here and from vLLM's SharedStorageConnector, a remote prefill)
PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                  "remote_block_ids": None, "remote_host": None, "remote_port": None}
DECODE_PARAMS = {**PREFILL_PARAMS, "do_remote_decode": False, "do_remote_prefill": True}


def _cached(usage) -> int:
    return usage.prompt_tokens_details.cached_tokens


def test_proxy_kv_transfer_params_are_taken_on_both_endpoints(servers):
    """A proxy's ``kv_transfer_params`` are accepted by the producer and the consumer
    (a 200, not a 400 naming an unknown field), on completions and chat: the consumer
    loads the prompt's whole blocks but the last token's, and decodes what the producer's
    own full run of the prompt decodes."""
    producer, consumer = servers
    prompt = list(range(200, 223))  # 23 tokens: 5 whole blocks before the last token
    first = producer.completions.create(model=MODEL, prompt=prompt, max_tokens=1,
                                        temperature=0,
                                        extra_body={"kv_transfer_params": PREFILL_PARAMS})
    handed = (first.model_extra or {}).get("kv_transfer_params") or DECODE_PARAMS
    got = consumer.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0,
                                      extra_body={"kv_transfer_params": handed})
    assert _cached(got.usage) == (len(prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE  # 20
    want = producer.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0)
    assert got.choices[0].text == want.choices[0].text
    messages = [{"role": "user", "content": "tell me about the quick brown fox " * 3}]
    producer.chat.completions.create(model=MODEL, messages=messages, max_tokens=1,
                                     temperature=0,
                                     extra_body={"kv_transfer_params": PREFILL_PARAMS})
    got = consumer.chat.completions.create(model=MODEL, messages=messages, max_tokens=5,
                                           temperature=0,
                                           extra_body={"kv_transfer_params": DECODE_PARAMS})
    assert _cached(got.usage) == (got.usage.prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE > 0
    want = producer.chat.completions.create(model=MODEL, messages=messages, max_tokens=5,
                                            temperature=0)
    assert got.choices[0].message.content == want.choices[0].message.content
