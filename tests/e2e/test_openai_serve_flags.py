"""A ``kvflow serve`` started with vLLM's ``--return-tokens-as-token-ids``,
``--stream-interval 3``, ``--sse-keep-alive-interval`` (a tiny interval, so a stream's gaps
between tokens carry comments), ``--enable-log-requests --enable-log-outputs`` and
``--disable-log-stats``, each checked by its effect on the tiny random Llama: logprobs tokens
named ``token_id:N`` (the generated ids; a request's own false wins), streamed token counts per
chunk (1, then 3s, the rest last), ``: keep-alive`` comment lines between the data events,
each sample's output text in the log (equal to the reply's), and ``--max-num-queued-reqs 2``
(sequences in flight, running ones too: a 503 for n=3 alone, and for n=2 beside a running
stream, whose engine core is held stopped meanwhile)."""

from __future__ import annotations

import itertools
import json
import os
import re
import signal

import httpx
import pytest

from tests.e2e.test_engine_faults import core_pid

MODEL = "tiny"
ARGS = ["--dtype", "float32", "--device", "cpu", "--num-gpu-blocks-override", "128",
        "--block-size", "4", "--max-model-len", "96", "--served-model-name", MODEL,
        "--return-tokens-as-token-ids", "--stream-interval", "3",
        "--sse-keep-alive-interval", "0.001", "--enable-log-requests", "--enable-log-outputs",
        "--disable-log-stats", "--max-num-queued-reqs", "2", "--uvicorn-log-level", "info"]
HI = [{"role": "user", "content": "hi"}]


def prestart_servers(fixture):
    """This module's server, started ahead (``_prestart_next_module`` in conftest.py)."""
    return [(fixture("tiny_chat_model"), ARGS, None)]


def _post(server, path: str, body: dict) -> httpx.Response:
    resp = httpx.post(f"{server.url}{path}", json={"model": MODEL, "temperature": 0,
                                                   "ignore_eos": True, **body}, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp


def _events(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


def test_logprobs_tokens_as_token_ids(server):
    body = {"prompt": "the quick brown", "max_tokens": 5, "logprobs": 2,
            "return_token_ids": True}
    whole = _post(server, "/v1/completions", body).json()["choices"][0]
    named = [f"token_id:{t}" for t in whole["token_ids"]]
    assert whole["logprobs"]["tokens"] == named
    assert all(all(re.fullmatch(r"token_id:\d+", k) for k in top)
               for top in whole["logprobs"]["top_logprobs"])
    streamed = _post(server, "/v1/completions", {**body, "stream": True}).text
    assert [t for e in _events(streamed) for c in e["choices"]
            for t in (c.get("logprobs") or {}).get("tokens") or []] == named
    own = _post(server, "/v1/completions", {**body, "return_tokens_as_token_ids": False})
    assert not any(t.startswith("token_id:") for t in
                   own.json()["choices"][0]["logprobs"]["tokens"])  # the request's false wins
    chat = {"messages": HI, "max_tokens": 4, "logprobs": True, "top_logprobs": 1,
            "return_token_ids": True}
    reply = _post(server, "/v1/chat/completions", chat).json()["choices"][0]
    assert [c["token"] for c in reply["logprobs"]["content"]] == \
        [f"token_id:{t}" for t in reply["token_ids"]]
    streamed = _post(server, "/v1/chat/completions", {**chat, "stream": True}).text
    assert all(c["token"].startswith("token_id:") for e in _events(streamed)
               for ch in e["choices"] for c in (ch.get("logprobs") or {}).get("content") or [])


@pytest.mark.parametrize("max_tokens,counts", [(10, [1, 3, 3, 3]), (8, [1, 3, 3, 1])])
def test_stream_interval_and_keep_alive(server, max_tokens, counts):
    text = _post(server, "/v1/completions", {"prompt": "the quick brown", "stream": True,
                                             "max_tokens": max_tokens,
                                             "return_token_ids": True}).text
    chunks = [c for e in _events(text) for c in e["choices"] if c.get("token_ids")]
    # The interval's outputs end at these token counts; a stream read late joins consecutive
    # outputs (as vLLM's output collector does), so a chunk may end at fewer of them, never
    # between them (every token's own chunk, without the interval, would).
    ends = list(itertools.accumulate(len(c["token_ids"]) for c in chunks))
    assert set(ends) <= set(itertools.accumulate(counts)) and ends[-1] == max_tokens, ends
    assert chunks[-1]["finish_reason"] == "length"
    assert text.count(": keep-alive\n\n") >= 1  # gaps of a ms or more between chunks
    assert text.rstrip().endswith("data: [DONE]")


def test_outputs_logged(server):
    reply = _post(server, "/v1/completions", {"prompt": "yak herding", "max_tokens": 4})
    body = reply.json()
    rid = body["id"]
    lines = [line for line in server.log().splitlines()
             if f"Generated response {rid}-0: output: " in line]
    expected = (f"INFO kvflow.entrypoints.output_log: Generated response {rid}-0: "
                f"output: {body['choices'][0]['text']!r}, finish_reason: length")
    assert lines == [expected], server.log()[-2000:]
    streamed = _post(server, "/v1/chat/completions", {"messages": HI, "max_tokens": 3,
                                                      "stream": True}).text
    events = _events(streamed)
    text = "".join(c["delta"].get("content") or "" for e in events for c in e["choices"])
    sid = events[0]["id"]
    assert f"Generated response {sid}-0: output: {text!r}, finish_reason: length" in \
        server.log()


def test_max_num_queued_reqs(server):
    def complete(n: int) -> httpx.Response:
        return httpx.post(f"{server.url}/v1/completions", timeout=60,
                          json={"model": MODEL, "prompt": "hi", "max_tokens": 2, "n": n})
    alone = complete(3)  # more sequences than the limit: no retry would be admitted
    assert alone.status_code == 400, alone.text
    assert alone.json()["error"]["param"] == "n" and "retry-after" not in alone.headers
    assert complete(2).status_code == 200
    core = core_pid(server.proc.pid)
    body = {"model": MODEL, "prompt": "the quick", "max_tokens": 30, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as resp:
        lines = (line for line in resp.iter_lines() if line.startswith("data: "))
        next(lines)  # running now
        os.kill(core, signal.SIGSTOP)
        try:
            beside = complete(2)  # 1 running + 2 > 2
        finally:
            os.kill(core, signal.SIGCONT)
        assert list(lines)[-1] == "data: [DONE]"
    assert beside.status_code == 503, beside.text
    assert "sequences in flight: 1, this request's: 2" in beside.json()["error"]["message"]
    assert complete(2).status_code == 200  # the stream has ended: room again


def test_metrics_stay_on_with_disable_log_stats(server):
    """vLLM's ``--disable-log-stats`` turns off its periodic stats log line, not /metrics:
    a 4-token completion moves the counters (4 generated tokens, one sample finished by
    length, 3 inter-token latencies: the metrics see every step whatever
    ``--stream-interval 3`` streams)."""
    before = server.metrics()
    _post(server, "/v1/completions", {"prompt": "the quick brown", "max_tokens": 4,
                                      "stream": True})
    after = server.metrics()

    def grew(name: str, **labels: str) -> float:
        return server.value(after, name, **labels) - server.value(before, name, **labels)

    assert grew("kvflow:generation_tokens_total") == 4
    assert grew("kvflow:request_success_total", finished_reason="length") == 1
    assert grew("kvflow:inter_token_latency_seconds_count") == 3
