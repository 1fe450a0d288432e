"""/v1/completions ``prompt_embeds`` (base64 of a ``torch.save``d tensor) on the tiny Llama
served with ``--enable-prompt-embeds``.

Oracles: the same server's completion of the equivalent token ids when the embeddings are the
model's own embedding rows, and HF ``generate(inputs_embeds=...)`` greedy tokens for random
rows (a divergence only at a near-tie of HF's top-2 logits). Every bad input is a 400 OpenAI
error naming the field, a body over ``--max-request-body-size`` a 413; a server without the
flag answers 400 naming it. The pickle payload
that would run a command is refused by ``torch.load(weights_only=True)`` and runs nothing.
"""

from __future__ import annotations

import base64
import io
import json
import os
import pickle

import httpx
import pytest
import torch

MODEL = "tiny"
ARGS = ["--dtype", "float32", "--device", "cpu", "--num-kv-blocks", "64", "--block-size", "4",
        "--max-model-len", "48", "--max-num-batched-tokens", "8", "--served-model-name", MODEL]
MAX_TOKENS = 6
TIE = 1e-4


def prestart_servers(fixture):
    """This module's servers (``_prestart_next_module`` in conftest.py): with the flag, and
    without it."""
    model = fixture("tiny_chat_model")
    return [(model, [*ARGS, "--enable-prompt-embeds", "--max-request-body-size", "64KiB"], None),
            (model, ARGS, None)]


@pytest.fixture(scope="module")
def plain_server(start_server, request):
    server = start_server.declared(request, 1)
    yield server
    server.terminate()


def b64(obj) -> str:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return base64.b64encode(buf.getvalue()).decode()


def complete(server, **body) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/completions", timeout=60,
                      json={"model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0,
                            "ignore_eos": True, "return_token_ids": True, **body})


def _hf_greedy(tiny, embeds: torch.Tensor) -> tuple[list[int], torch.Tensor]:
    from transformers import GenerationConfig

    cfg = GenerationConfig(do_sample=False, max_new_tokens=MAX_TOKENS, min_new_tokens=0,
                           eos_token_id=None, pad_token_id=0, output_logits=True,
                           return_dict_in_generate=True)
    with torch.no_grad():
        out = tiny.hf_model.generate(inputs_embeds=embeds[None],
                                     attention_mask=torch.ones(1, embeds.shape[0],
                                                               dtype=torch.long),
                                     generation_config=cfg)
    return out.sequences[0, -MAX_TOKENS:].tolist(), torch.stack([s[0] for s in out.logits])


def test_embedding_rows_answer_as_their_token_ids(server, tiny_llama):
    ids = [[7, 8, 9, 200, 31, 64, 5, 5, 12, 90, 1], [44, 3, 250]]
    table = tiny_llama.hf_model.model.embed_tokens.weight.detach()
    gen = torch.Generator().manual_seed(3)
    rand = 0.5 * torch.randn(10, 64, generator=gen)
    resp = complete(server, prompt_embeds=[b64(table[ids[0]]), b64(rand.double())],
                    prompt=ids[1])
    assert resp.status_code == 200, resp.text
    body = resp.json()
    choices = sorted(body["choices"], key=lambda c: c["index"])
    assert len(choices) == 3  # the prompt_embeds prompts first, then prompt's
    assert body["usage"]["prompt_tokens"] == len(ids[0]) + 10 + len(ids[1])
    plain = complete(server, prompt=ids).json()["choices"]
    plain = sorted(plain, key=lambda c: c["index"])
    assert choices[0]["token_ids"] == plain[0]["token_ids"]
    assert choices[0]["text"] == plain[0]["text"]
    assert choices[2]["token_ids"] == plain[1]["token_ids"]
    streamed = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
        "model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
        "prompt_embeds": b64(table[ids[0]]), "stream": True})
    chunks = [json.loads(line[len("data: "):]) for line in streamed.text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == \
        choices[0]["text"]
    ref, logits = _hf_greedy(tiny_llama, rand)
    ours = choices[1]["token_ids"]
    for step, (a, b) in enumerate(zip(ours, ref)):
        if a != b:
            top2 = logits[step].topk(2).values
            assert float(top2[0] - top2[1]) <= TIE, f"kvflow {ours}, HF {ref}"
            break
    else:
        assert ours == ref


def test_truncate_prompt_tokens_keeps_the_last_rows(server, tiny_llama):
    """vLLM's rule: ``truncate_prompt_tokens`` k keeps the last k rows, cut before the length
    check (60 rows, more than --max-model-len 48, are served), and usage counts the kept
    rows. Oracle: the same server's completion of the last k token ids."""
    ids = list(range(10, 70))
    table = tiny_llama.hf_model.model.embed_tokens.weight.detach()
    resp = complete(server, prompt_embeds=b64(table[ids]), truncate_prompt_tokens=5)
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["usage"]["prompt_tokens"] == 5
    assert body["choices"][0]["prompt_token_ids"] == [0] * 5  # one placeholder per kept row
    plain = complete(server, prompt=ids[-5:]).json()["choices"][0]
    assert body["choices"][0]["token_ids"] == plain["token_ids"]
    whole = complete(server, prompt_embeds=b64(table[ids]))  # not cut: too long
    assert whole.status_code == 400 and whole.json()["error"]["param"] == "prompt_embeds"


class _RunsCommand:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_bad_inputs_are_400s(server, tmp_path):
    good = b64(torch.ones(3, 64))
    marker = tmp_path / "pwned"
    evil = base64.b64encode(pickle.dumps(_RunsCommand(str(marker)))).decode()
    cases = [
        ({"prompt_embeds": "not base64!"}, "prompt_embeds", "not valid base64"),
        ({"prompt_embeds": evil}, "prompt_embeds", "torch.load"),
        ({"prompt_embeds": b64({"w": torch.ones(2)})}, "prompt_embeds", "holds a dict"),
        ({"prompt_embeds": b64(torch.ones(3, 64, dtype=torch.int32))}, "prompt_embeds",
         "floating-point"),
        ({"prompt_embeds": [good, b64(torch.ones(3, 32))]}, "prompt_embeds.1",
         "hidden size 32"),
        ({"prompt_embeds": b64(torch.full((2, 64), float("nan")))}, "prompt_embeds",
         "NaN or infinite"),
        ({"prompt_embeds": b64(torch.ones(0, 64))}, "prompt_embeds", "no rows"),
        ({"prompt_embeds": b64(torch.ones(48, 64))}, "prompt_embeds", "max_model_len"),
        ({"prompt_embeds": []}, "prompt_embeds", "empty list"),
        ({"prompt_embeds": good, "echo": True}, "echo", "no token ids"),
        ({"prompt_embeds": good, "prompt_logprobs": 1}, "prompt_logprobs", "no token ids"),
        ({}, "prompt", "either prompt or prompt_embeds"),
    ]
    for body, param, words in cases:
        resp = complete(server, **body)
        assert resp.status_code == 400, (body, resp.text)
        error = resp.json()["error"]
        assert error["param"] == param and words in error["message"], (body, error)
    assert not marker.exists()
    # 45 rows in the 48-token context: max_tokens is clamped to the 3 tokens left (vLLM
    # 0.32's get_max_tokens), not refused
    clamped = complete(server, prompt_embeds=b64(torch.ones(45, 64))).json()
    assert (clamped["usage"]["completion_tokens"], clamped["choices"][0]["finish_reason"]) \
        == (3, "length"), clamped
    chat = httpx.post(f"{server.url}/v1/chat/completions", timeout=30, json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}],
        "prompt_embeds": good})
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "prompt_embeds"
    # the body limit applies before anything is decoded: 40 rows of float32 fit in 64 KiB of
    # base64, 300 do not
    big = complete(server, prompt_embeds=b64(torch.ones(300, 64)))
    assert big.status_code == 413 and big.json()["error"]["code"] == "request_too_large"
    # still serving; prompt null as the openai client sends it with prompt=None
    assert complete(server, prompt=None, prompt_embeds=good).status_code == 200


def test_refused_without_the_flag(plain_server):
    resp = complete(plain_server, prompt_embeds=b64(torch.ones(3, 64)), echo=True)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == "prompt_embeds" and "--enable-prompt-embeds" in error["message"]
