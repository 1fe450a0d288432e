"""Mixed concurrent load on one ``kvflow serve`` (a short soak): every request kind at once.

Starts ``kvflow serve`` on the tiny random Llama of ``combo_fuzz.py`` with two of its PEFT LoRA
adapters (``--enable-lora --lora-modules``), prefix caching, a small KV pool that preempts
(``--num-kv-blocks``), 4-token blocks, the priority policy; then ``--workers`` client tasks
(asyncio + httpx) draw requests for ``--minutes``: /v1/completions and /v1/chat/completions,
streamed or not, n 1-3, logprobs, a json_schema or regex constraint, ``tool_choice`` required,
the base model or an adapter, prompts sharing a long prefix, max_tokens 1 or up to the context,
priorities, a stream the client drops after a few chunks, a non-streamed request the client
gives up on (an abort), /v1/embeddings (not served by a generative model: a 4xx); beside them
/metrics and /health are polled.

Checks: no 5xx and no transport error; every 200 is valid (a finished json_schema output
passes ``json.loads`` + ``jsonschema``, a regex one ``re.fullmatch``, a required tool call
names a declared tool with JSON arguments; streamed deltas add up to usage's completion_tokens;
``length`` outputs have exactly max_tokens tokens); at the end the engine is idle (no request
running or waiting, every usable KV block free); the finished-sample counter
(``kvflow:request_success`` summed over reasons) equals the samples sent (sum of n over the
requests the server accepted, plus up to those of the requests the client gave up on); the server's RSS (API + engine core) over the second half grows
by at most ``--rss-tolerance``.

    PYTHONPATH=. .venv/bin/python benchmarks/mixstress_serve.py --minutes 3

Exit status 1 on any failed check; the server log is kept in ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import combo_fuzz as cf  # sets the thread environment and sys.path first
import httpx
import jsonschema
from soak_serve import rss_kib

from tests.conftest import TINY_CHAT_TEMPLATE
from tests.e2e.conftest import ServerProcess

WORDS = ["the", "quick", "brown", "fox", "kvflow", "pages", "keys", "prefix", "caching",
         "reuses", "them", "chunked"]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string",
          "maxLength": 6}}, "required": ["a", "b"], "additionalProperties": False}
REGEX = r"(yes|no) [0-9]{1,3}"
TOOLS = [{"type": "function", "function": {"name": name, "parameters": {
    "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}}
    for name in ("get_a", "get_b")]
SHARED = " ".join(WORDS * 2)  # several full 4-token blocks shared
# the tiny template, naming the tools itself (a template that ignores them gets the tool
# parser's instructions, longer than the tiny model's 256-token context)
TEMPLATE = ("{% if tools %}<tools>{% for t in tools %}{{ t['function']['name'] }} {% endfor %}\n"
            "{% endif %}" + TINY_CHAT_TEMPLATE)


def draw(rng: random.Random) -> tuple[str, dict[str, Any], str, str]:
    """(path, body, check kind, client behaviour: whole / stream / drop / giveup)."""
    chat = rng.random() < 0.5
    text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 20)))
    if rng.random() < 0.4:
        text = SHARED + " " + text
    max_tokens = rng.choice([1, 1, 4, 16, 40, 100])
    body: dict[str, Any] = {"model": rng.choice(["m", "m", "la", "lb"]), "max_tokens": max_tokens,
                            "n": rng.choice([1, 1, 2, 3]), "temperature": rng.choice([0, 0.8]),
                            "seed": rng.randint(0, 99), "ignore_eos": rng.random() < 0.5,
                            "priority": rng.randint(-2, 2)}
    kind = "plain"
    r = rng.random()
    if r < 0.15:
        kind = "json"
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "s",
                                                                          "schema": SCHEMA}}
        body["max_tokens"] = 60
        body["ignore_eos"] = False
    elif r < 0.25:
        kind = "regex"
        body["structured_outputs"] = {"regex": REGEX}
        body["ignore_eos"] = False
        body["max_tokens"] = 20
    elif r < 0.32 and chat:
        kind = "tools"
        body.update(tools=TOOLS, tool_choice="required", max_tokens=60, ignore_eos=False)
    if chat:
        body["messages"] = [{"role": "user", "content": text}]
        if rng.random() < 0.4:
            body.update(logprobs=True, top_logprobs=rng.randint(0, 3))
    else:
        body["prompt"] = text
        if rng.random() < 0.4:
            body["logprobs"] = rng.randint(0, 3)
    b = rng.random()
    mode = "stream" if b < 0.4 else "drop" if b < 0.5 else "giveup" if b < 0.55 else "whole"
    if mode != "whole":
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    if mode == "giveup":
        body.pop("stream"), body.pop("stream_options")
    return ("/v1/chat/completions" if chat else "/v1/completions"), body, kind, mode


def _content(choice: dict[str, Any]) -> str:
    msg = choice.get("message") or {}
    return choice.get("text") if "text" in choice else (msg.get("content") or "")


def check_choice(kind: str, body: dict[str, Any], choice: dict[str, Any], tokens: int) -> None:
    """One finished choice against its request.

    Raises:
        AssertionError: naming what is wrong.
    """
    reason = choice.get("finish_reason")
    assert reason in ("stop", "length", "tool_calls"), ("finish_reason", choice)
    if reason == "length":
        assert tokens == body["max_tokens"], ("length but", tokens, body["max_tokens"])
    assert tokens <= body["max_tokens"], ("too many tokens", tokens, body["max_tokens"])
    if kind == "tools":
        calls = (choice.get("message") or {}).get("tool_calls") or []
        if reason == "length":  # cut: the last call's arguments may be unfinished
            return
        assert calls, ("required tool call missing", choice)
        for call in calls:
            assert call["function"]["name"] in ("get_a", "get_b"), call
            assert isinstance(json.loads(call["function"]["arguments"]), dict), call
        return
    if reason != "stop":
        return
    text = _content(choice)
    if kind == "json":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), ("regex broken", text)


class Stats:
    """What the clients saw."""

    def __init__(self) -> None:
        self.codes: Counter[str] = Counter()
        self.samples = 0  # sum of n over requests the server accepted (200 / stream opened)
        self.maybe = 0  # samples of requests the client gave up on: 0 or n of each count
        self.failures: list[str] = []
        self.refusals: Counter[str] = Counter()  # 4xx messages (first 80 characters)

    def fail(self, what: str) -> None:
        self.failures.append(what[:2000])
        print("FAIL", what[:2000], flush=True)


async def one(client: httpx.AsyncClient, url: str, rng: random.Random, st: Stats) -> None:
    path, body, kind, mode = draw(rng)
    got: Any = None  # the response (or the streamed choices) for a failure's report
    try:
        if mode == "whole" or mode == "giveup":
            try:
                r = await client.post(url + path, json=body,
                                      timeout=rng.uniform(0.05, 1.0) if mode == "giveup"
                                      else 300)
            except httpx.TimeoutException:
                st.codes["giveup"] += 1
                st.maybe += body["n"]  # aborted once admitted, or never reached the engine
                return
            st.codes[str(r.status_code)] += 1
            if r.status_code != 200:
                if r.status_code >= 500:
                    st.fail(f"{r.status_code} {path} {body} {r.text}")
                st.refusals[r.text[:120]] += 1
                return
            st.samples += body["n"]
            data = got = r.json()
            for c in data["choices"]:
                st.codes[f"{kind} {c['finish_reason']}"] += 1
                tokens = len(c["logprobs"]["content" if "messages" in body else "tokens"]) \
                    if c.get("logprobs") else None
                if tokens is None:  # usage is summed over choices: only n=1 pins one
                    tokens = data["usage"]["completion_tokens"] if body["n"] == 1 else 0
                    if body["n"] > 1 and c["finish_reason"] == "length":
                        tokens = body["max_tokens"]
                check_choice(kind, body, c, tokens)
            if all(c.get("logprobs") for c in data["choices"]):
                total = sum(len(c["logprobs"]["content" if "messages" in body else "tokens"])
                            for c in data["choices"])
                assert total == data["usage"]["completion_tokens"], ("usage", total, data)
            return
        async with client.stream("POST", url + path, json=body, timeout=300) as r:
            st.codes[str(r.status_code)] += 1
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace")
                if r.status_code >= 500:
                    st.fail(f"{r.status_code} {path} {body} {text}")
                st.refusals[text[:120]] += 1
                return
            st.samples += body["n"]
            drop_after = rng.randint(1, 6) if mode == "drop" else None
            chunks, usage, counts = 0, None, Counter()
            texts: dict[int, str] = {}
            calls: dict[int, list] = {}
            reasons: dict[int, str] = {}
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                ev = json.loads(line[6:])
                assert "error" not in ev, ("stream error", ev)
                chunks += 1
                if ev.get("usage"):
                    usage = ev["usage"]
                for c in ev.get("choices", []):
                    i = c["index"]
                    d = c.get("delta") or {}
                    texts[i] = texts.get(i, "") + (c.get("text") or d.get("content") or "")
                    calls.setdefault(i, []).extend(d.get("tool_calls") or [])
                    lp = c.get("logprobs") or {}
                    counts[i] += len(lp.get("content") or lp.get("tokens") or [])
                    if c.get("finish_reason"):
                        reasons[i] = c["finish_reason"]
                if drop_after is not None and chunks >= drop_after:
                    st.codes["dropped"] += 1
                    return
            assert usage is not None, "no usage chunk"
            assert sorted(reasons) == list(range(body["n"])), ("finish reasons", reasons)
            if body.get("logprobs"):
                assert sum(counts.values()) == usage["completion_tokens"], (counts, usage)
            got = {"texts": texts, "calls": calls, "reasons": reasons, "usage": usage}
            for i, reason in reasons.items():
                st.codes[f"{kind} {reason}"] += 1
                choice = {"finish_reason": reason, "text": texts[i]}
                if kind == "tools":
                    choice = {"finish_reason": reason, "message": {"tool_calls": _merge(calls[i])}}
                tokens = counts[i] if body.get("logprobs") else (
                    usage["completion_tokens"] if body["n"] == 1 else
                    body["max_tokens"] if reason == "length" else 0)
                check_choice(kind, body, choice, tokens)
    except (httpx.TransportError, AssertionError, ValueError, KeyError,
            jsonschema.ValidationError) as e:
        st.fail(f"{type(e).__name__} {e!r} {path} {mode} {kind} {body} got {got}")


def _merge(deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Streamed tool-call deltas joined per index into whole calls."""
    out: dict[int, dict[str, Any]] = {}
    for d in deltas:
        call = out.setdefault(d.get("index", 0), {"function": {"name": "", "arguments": ""}})
        fn = d.get("function") or {}
        call["function"]["name"] += fn.get("name") or ""
        call["function"]["arguments"] += fn.get("arguments") or ""
    return [out[k] for k in sorted(out)]


async def worker(url: str, seed: int, end: float, st: Stats) -> None:
    rng = random.Random(seed)
    async with httpx.AsyncClient() as client:
        while time.monotonic() < end:
            await one(client, url, rng, st)


async def poller(url: str, end: float, st: Stats) -> None:
    async with httpx.AsyncClient(timeout=30) as client:
        while time.monotonic() < end:
            for path in ("/metrics", "/health"):
                try:
                    r = await client.get(url + path)
                    if r.status_code != 200:
                        st.fail(f"GET {path} {r.status_code}")
                except httpx.TransportError as e:
                    st.fail(f"GET {path} {e!r}")
            r = await client.post(url + "/v1/embeddings", json={"model": "m", "input": "hi"})
            st.codes[f"emb {r.status_code}"] += 1
            if r.status_code >= 500:
                st.fail(f"embeddings {r.status_code} {r.text}")
            await asyncio.sleep(0.3)


async def rss_sampler(pid: int, end: float, samples: list[tuple[float, int]]) -> None:
    while time.monotonic() < end:
        samples.append((time.monotonic(), rss_kib(pid)))
        await asyncio.sleep(2.0)


def metric_sum(server: ServerProcess, name: str) -> float:
    return sum(v for (n, _), v in server.metrics().items() if n == name)


def wait_idle(server: ServerProcess, st: Stats, timeout: float = 30.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        state = {k: metric_sum(server, f"kvflow:{k}") for k in (
            "kv_cache_free_blocks", "kv_cache_usable_blocks", "num_requests_running",
            "num_requests_waiting", "kv_cache_usage_perc")}
        state["finished_samples"] = metric_sum(server, "kvflow:request_success_total")
        for name in ("num_preemptions", "prefix_cache_hits"):  # that the load reached them
            state[name] = metric_sum(server, f"kvflow:{name}_total")
        idle = state["kv_cache_free_blocks"] == state["kv_cache_usable_blocks"] and \
            not state["num_requests_running"] and not state["num_requests_waiting"]
        if (idle and state["finished_samples"] >= st.samples) or time.monotonic() > deadline:
            if not idle:
                st.fail(f"not idle at the end: {state}")
            return state
        time.sleep(0.5)


async def soak(server: ServerProcess, args: argparse.Namespace, st: Stats) -> list:
    end = time.monotonic() + args.minutes * 60
    samples: list[tuple[float, int]] = []
    await asyncio.gather(rss_sampler(server.proc.pid, end, samples), poller(server.url, end, st),
                         *(worker(server.url, args.seed * 1000 + i, end, st)
                           for i in range(args.workers)))
    return samples


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=3.0)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-kv-blocks", type=int, default=96)
    ap.add_argument("--rss-tolerance", type=float, default=0.05)
    ap.add_argument("--models", default=os.path.join(tempfile.gettempdir(), "kvflow_combo_fuzz"))
    ap.add_argument("--out", default=tempfile.mkdtemp(prefix="kvflow_mixstress_"))
    args = ap.parse_args()
    adapters = cf.build_models(args.models)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    server = ServerProcess(os.path.join(args.models, "llama"), [
        "--dtype", "float32", "--device", "cpu", "--served-model-name", "m",
        "--chat-template", TEMPLATE, "--block-size", "4", "--enable-prefix-caching",
        "--num-kv-blocks", str(args.num_kv_blocks), "--max-num-seqs", "8",
        "--max-num-batched-tokens", "64", "--policy", "priority", "--enable-lora",
        "--max-loras", "2", "--max-lora-rank", "8", "--lora-modules",
        f"la={adapters[0].lora_path}", f"lb={adapters[1].lora_path}"],
        Path(args.out) / "server.log", env={"KVFLOW_CPU_ADAPTIVE_THREADS": "0"})
    st = Stats()
    try:
        server.wait_ready()
        samples = asyncio.run(soak(server, args, st))
        state = wait_idle(server, st)
        print("server state at the end:", state, flush=True)
        if not st.samples <= state["finished_samples"] <= st.samples + st.maybe:
            st.fail(f"finished samples {state['finished_samples']} not in sent {st.samples} "
                    f"+ given up {st.maybe}")
        half = [r for _, r in samples[len(samples) // 2:]]
        q = max(1, len(half) // 4)
        first, last = sum(half[:q]) / q, sum(half[-q:]) / q
        growth = (last - first) / first if first else 0.0
        print(f"RSS second half: {first / 1024:.1f} -> {last / 1024:.1f} MiB "
              f"({growth:+.1%})", flush=True)
        if growth > args.rss_tolerance:
            st.fail(f"RSS grew {growth:.1%} over the second half")
    finally:
        server.stop()
    print("responses and finished choices:", dict(st.codes), "samples sent:", st.samples)
    for text, count in st.refusals.most_common():
        print(f"  4xx x{count}: {text}")
    print(f"{len(st.failures)} failures (server log {args.out}/server.log)")
    return 1 if st.failures else 0


if __name__ == "__main__":
    sys.exit(main())
