"""Differential fuzz of the OpenAI server (``kvflow serve``: API process + AsyncLLM + engine
core process): a streamed response must say exactly what the same request says unstreamed.

Starts ``kvflow serve`` on the tiny random Llama of ``combo_fuzz.py`` once per server
configuration (plain; prefix caching + a 4-token step budget + a small KV pool that preempts;
n-gram speculation; async scheduling + prefix caching), then sends seeded cases to
``/v1/completions`` (token-id prompts) and ``/v1/chat/completions``: greedy, n 1-3, max_tokens
1-40, stop strings of 1-6 characters cut from the probe's own output (so they often span
delta boundaries), ``include_stop_str_in_output``, logprobs / top_logprobs, ``echo``,
``return_token_ids``, ``ignore_eos``, vLLM 0.32's ``stream_interval`` /
``repetition_detection`` / ``logprob_token_ids`` / ``session_id``, and a
constraint (``response_format`` json_schema /
json_object, ``structured_outputs`` regex / choice / grammar). Some cases run the pair side by
side with a third stream that the client drops after a few chunks (an abort mid-stream).

Oracles: per choice index, the concatenated stream deltas (text / content, logprobs' tokens,
token_logprobs, top_logprobs, text_offset / content entries, token_ids) and the finish_reason
and stop_reason must equal the non-streamed response's; the final usage chunk
(``stream_options.include_usage``) must equal its usage. An output ended by a stop string must be the probe's text (the same
greedy request, no stop, n=1) cut at the string's first match (after it with
``include_stop_str_in_output``): streamed and whole responses share the detokenizer, so
this independent check is the one that sees a stop-string bug common to both. A probe with logprobs drops prompts
whose greedy top-2 margin is under 1e-3 (near-ties: batch composition may flip them).
Structured outputs that finished with ``stop`` and no stop string must satisfy the
constraint (``combo_fuzz_structured.satisfies``). Every 10 cases and at the end: the server
answers, and once idle its /metrics show no running or waiting request and every usable KV
block free (no leak from aborts).

    PYTHONPATH=. .venv/bin/python benchmarks/combo_fuzz_server.py [--start 0] [--n 40]

Prints one line per case; exit status 1 if any case failed. Each server takes ~5-10 s to
start; a case about 0.5 s.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import combo_fuzz as cf  # sets the thread environment and sys.path first
import combo_fuzz_structured as cfs
import httpx

from tests.conftest import TINY_CHAT_TEMPLATE
from tests.e2e.conftest import ServerProcess

NUM_KV_BLOCKS = 48
SERVERS = {
    "plain": ["--block-size", "4"],
    "prefix_chunked_small_pool": ["--block-size", "4", "--enable-prefix-caching",
                                  "--max-num-batched-tokens", "4", "--num-kv-blocks",
                                  str(NUM_KV_BLOCKS), "--max-num-seqs", "4"],
    "ngram": ["--block-size", "4", "--speculative-config",
              json.dumps({"method": "ngram", "num_speculative_tokens": 3,
                          "prompt_lookup_min": 1, "prompt_lookup_max": 3})],
    "async_prefix": ["--block-size", "8", "--async-scheduling", "--enable-prefix-caching"],
}
WORDS = ["the", "quick", "brown", "fox", "kvflow", "pages", "keys", "prefix", "caching", "reuses", "them", "chunked"]


def _constraint(rng: random.Random) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """(request body fields, structured_outputs fields for the independent check) or None."""
    fields = rng.choice(cfs.CONSTRAINTS)[0]
    if "json" in fields and rng.random() < 0.5:
        return {"response_format": {"type": "json_schema", "json_schema": {
            "name": "s", "schema": fields["json"]}}}, fields
    if "json_object" in fields:
        return {"response_format": {"type": "json_object"}}, fields
    return {"structured_outputs": fields}, fields


def _recent_fields(rng: random.Random, body: dict[str, Any]) -> None:
    """vLLM 0.32's per-request fields, each drawn in some cases: ``stream_interval`` (the
    concatenated deltas must not depend on it), ``repetition_detection`` (finish reason
    ``repetition`` alike streamed or not), ``logprob_token_ids`` (where logprobs are asked),
    and ``session_id`` (no effect on the tokens). ``vllm_xargs`` is left out: a server with no
    ``--logits-processors`` refuses it (400)."""
    if rng.random() < 0.3:
        body["stream_interval"] = rng.randint(1, 7)
    if rng.random() < 0.2:
        body["repetition_detection"] = {"max_pattern_size": rng.randint(1, 4),
                                        "min_pattern_size": rng.randint(0, 1),
                                        "min_count": rng.randint(2, 3)}
    if body.get("logprobs") and rng.random() < 0.3:
        body["logprob_token_ids"] = [rng.randint(0, 319) for _ in range(rng.randint(1, 3))]
    if rng.random() < 0.15:
        body["session_id"] = rng.choice(["", "s", "session-\u00e9" * 20])


def draw_body(rng: random.Random) -> tuple[str, dict[str, Any], dict[str, Any] | None]:
    """(endpoint path, body without stream fields, constraint fields or None)."""
    chat = rng.random() < 0.4
    text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 12)))
    body: dict[str, Any] = {"model": "m", "temperature": 0, "n": rng.choice([1, 1, 2, 3]),
                            "max_tokens": rng.choice([1, 2, 5, 12, 20, 40]),
                            "ignore_eos": rng.random() < 0.5}
    if chat:
        body["messages"] = [{"role": "user", "content": text}]
        if rng.random() < 0.6:
            body.update(logprobs=True, top_logprobs=rng.randint(0, 2))
    else:
        body["prompt"] = [rng.randint(2, 319) for _ in range(rng.randint(1, 30))]
        if rng.random() < 0.6:
            body["logprobs"] = rng.randint(0, 2)
        body["echo"] = rng.random() < 0.15
    body["return_token_ids"] = rng.random() < 0.4
    _recent_fields(rng, body)
    fields = None
    if rng.random() < 0.35:
        extra, fields = _constraint(rng)
        body.update(extra)
    return ("/v1/chat/completions" if chat else "/v1/completions"), body, fields


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    resp = httpx.post(url, json=body, timeout=120)
    assert resp.status_code == 200, (resp.status_code, resp.text)
    return resp.json()


def _fold(acc: dict[str, Any], choice: dict[str, Any]) -> None:
    """Append one choice (or a stream delta of it) to ``acc``: strings and lists concatenated,
    finish_reason / stop_reason the last set."""
    msg = choice.get("delta") or choice.get("message") or {}
    acc["text"] = acc.get("text", "") + (choice.get("text") or msg.get("content") or "")
    lp = choice.get("logprobs") or {}
    for key, value in [*lp.items(), ("token_ids", choice.get("token_ids"))]:
        if isinstance(value, list):
            acc.setdefault(key, []).extend(value)
    for key in ("finish_reason", "stop_reason"):
        if choice.get(key) is not None:
            acc[key] = choice[key]


def whole(url: str, body: dict[str, Any]) -> tuple[dict[int, dict], dict]:
    """{choice index: folded choice}, usage of the non-streamed response."""
    data = _post(url, body)
    out: dict[int, dict] = {}
    for c in data["choices"]:
        _fold(out.setdefault(c["index"], {}), c)
    return out, data["usage"]


def streamed(url: str, body: dict[str, Any], drop_after: int | None = None
             ) -> tuple[dict[int, dict], dict | None]:
    """The same, from the concatenated SSE deltas; ``drop_after`` closes the connection after
    that many chunks (a client abort)."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    out: dict[int, dict] = {}
    usage, chunks = None, 0
    with httpx.stream("POST", url, json=body, timeout=120) as resp:
        assert resp.status_code == 200, (resp.status_code, resp.read())
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            assert "error" not in data, data
            for c in data["choices"]:
                _fold(out.setdefault(c["index"], {}), c)
            usage = data.get("usage") or usage
            chunks += 1
            if drop_after is not None and chunks >= drop_after:
                return out, None
    return out, usage


def same(a: Any, b: Any, where: str) -> None:
    """``a`` == ``b`` but floats (logprobs) within 1e-3: the two requests may run in
    different batches.

    Raises:
        AssertionError: naming the first differing field.
    """
    if isinstance(a, float) and isinstance(b, float):
        assert abs(a - b) < cf.LOGPROB_TOL, (where, a, b)
    elif isinstance(a, dict) and isinstance(b, dict):
        assert a.keys() == b.keys(), (where, sorted(a), sorted(b))
        for k in a:
            same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list) and isinstance(b, list):
        assert len(a) == len(b), (where, len(a), len(b), a, b)
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


def _near_tie(url: str, path: str, body: dict[str, Any]) -> bool:
    probe = {**body, "n": 1}
    probe.pop("stop", None)
    if path.endswith("chat/completions"):
        probe.update(logprobs=True, top_logprobs=2)
        entries = [e["top_logprobs"] for e in
                   (_post(url, probe)["choices"][0]["logprobs"] or {}).get("content") or []]
        tops = [[x["logprob"] for x in e] for e in entries]
    else:
        probe.update(logprobs=2, echo=False)
        lp = _post(url, probe)["choices"][0]["logprobs"] or {}
        tops = [list(e.values()) for e in lp.get("top_logprobs") or []]
    tops = [sorted(t, reverse=True) for t in tops if len(t) > 1]
    return any(t[0] - t[1] < cf.NEAR_TIE for t in tops)


def one_case(seed: int, server: ServerProcess) -> str:
    """One request streamed and not; returns a summary line.

    Raises:
        AssertionError: where the two responses differ or a constraint is broken.
    """
    rng = random.Random(seed)
    path, body, fields = draw_body(rng)
    url = server.url + path
    if _near_tie(url, path, body):
        return "skipped (near-tie)"
    probe, _ = whole(url, {**body, "n": 1})
    text = probe[0]["text"]
    if len(text) > 2 and rng.random() < 0.5:
        a = rng.randint(0, len(text) - 2)
        body["stop"] = [text[a:a + rng.randint(1, 6)]]
        body["include_stop_str_in_output"] = rng.random() < 0.5
    results: dict[str, Any] = {}
    jobs = {"whole": lambda: whole(url, body), "stream": lambda: streamed(url, body)}
    if rng.random() < 0.4:  # side by side, with a stream the client drops
        jobs["dropped"] = lambda: streamed(url, {**body, "max_tokens": 40, "ignore_eos": True},
                                           drop_after=rng.randint(1, 4))
        threads = [threading.Thread(target=lambda k=k, f=f: results.__setitem__(k, f()))
                   for k, f in jobs.items()]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    else:
        results = {k: f() for k, f in jobs.items()}
    (ref, ref_usage), (got, got_usage) = results["whole"], results["stream"]
    same(ref, got, "choices")
    assert ref_usage == got_usage, ("usage differs", ref_usage, got_usage)
    for c in ref.values():  # a stop string cuts the probe's greedy text at its first match
        if c.get("stop_reason") in body.get("stop", []) and not body.get("echo"):
            stop = c["stop_reason"]
            cut = text.find(stop) + (len(stop) if body["include_stop_str_in_output"] else 0)
            assert text.find(stop) >= 0 and c["text"] == text[:cut], ("stop cut", text, c)
    for c in ref.values():  # echo puts the prompt first: not checked
        if fields is not None and not body.get("echo") and c.get("finish_reason") == "stop" \
                and c.get("stop_reason") is None:
            assert cfs.satisfies(fields, c["text"]), ("constraint broken", fields, c)
    shown = sorted(k for k, v in body.items() if v and k not in ("model", "temperature"))
    return f"ok {path} n={body['n']} {'dropped ' if 'dropped' in jobs else ''}{shown}"


def check_idle(server: ServerProcess) -> None:
    """The server answers; once idle, no request running or waiting and every KV block free.

    Raises:
        AssertionError: when the engine stays busy or blocks stay held for 10 s.
    """
    _post(server.url + "/v1/completions", {"model": "m", "prompt": [5, 6], "max_tokens": 2})
    deadline = time.monotonic() + 10
    while True:
        m = server.metrics()
        free = server.value(m, "kvflow:kv_cache_free_blocks")
        usable = server.value(m, "kvflow:kv_cache_usable_blocks")
        busy = server.value(m, "kvflow:num_requests_running") + \
            server.value(m, "kvflow:num_requests_waiting")
        if free == usable and not busy:
            return
        assert time.monotonic() < deadline, f"not idle: free {free}/{usable}, busy {busy}"
        time.sleep(0.2)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--start", type=int, default=0, help="first case seed")
    ap.add_argument("--n", type=int, default=40, help="cases per server configuration")
    ap.add_argument("--servers", default=",".join(SERVERS), help="configurations to run")
    ap.add_argument("--models", default=os.path.join(tempfile.gettempdir(), "kvflow_combo_fuzz"),
                    help="folder for the tiny models (built once, reused)")
    args = ap.parse_args()
    cf.build_models(args.models)
    logs = Path(tempfile.mkdtemp(prefix="kvflow_fuzz_server_"))
    failed = 0
    for name in args.servers.split(","):
        server = ServerProcess(os.path.join(args.models, "llama"),
                               ["--dtype", "float32", "--device", "cpu", "--served-model-name",
                                "m", "--chat-template", TINY_CHAT_TEMPLATE, *SERVERS[name]],
                               logs / f"{name}.log", env={"KVFLOW_CPU_ADAPTIVE_THREADS": "0"})
        try:
            server.wait_ready()
            for seed in range(args.start, args.start + args.n):
                t0 = time.perf_counter()
                try:
                    line = one_case(seed, server)
                    if (seed + 1) % 10 == 0 or seed == args.start + args.n - 1:
                        check_idle(server)
                except Exception as e:  # noqa: BLE001 - report the case and go on
                    failed += 1
                    line = f"FAIL {e!r}"[:3000]
                    traceback.print_exc(limit=4)
                print(f"{name} {seed} {time.perf_counter() - t0:.1f}s {line}", flush=True)
        finally:
            server.stop()
    print(f"{args.n} cases x {len(args.servers.split(','))} servers, {failed} failed "
          f"(server logs in {logs})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
