"""The streaming HTTP client of ``kvflow bench serve``: one OpenAI-compatible request per call,
timed on the client (aiohttp, Server-Sent Events).

Works against any server that speaks ``/v1/completions`` or ``/v1/chat/completions`` with
``stream: true``; token counts come from the final ``usage`` chunk when the server sends one
(``stream_options.include_usage``), else the caller counts them with a tokenizer.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import aiohttp

from kvflow.bench.datasets import BenchRequest

ENDPOINT_PATHS = MappingProxyType({"completions": "/v1/completions",
                                   "chat": "/v1/chat/completions"})


@dataclass
class RequestResult:
    """What the client saw of one request (times in seconds, ``time.perf_counter``).

    Attributes:
        success: a 200 response whose stream ended without an error event.
        start: when the request was sent.
        token_times: arrival of every chunk carrying generated tokens: every chunk with a
            choice but a chat role chunk (see ``_chunk_text``).
        end: when the response ended (after the usage chunk and ``[DONE]``).
        text: the generated text (a chat reply's reasoning and tool-call pieces included).
        prompt_tokens / completion_tokens: from the server's usage chunk (None if not sent).
        error: HTTP status and error body, or the exception, of a failed request.
    """

    success: bool = False
    start: float = 0.0
    token_times: list[float] = field(default_factory=list)
    end: float = 0.0
    text: str = ""
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    error: str = ""


def build_payload(req: BenchRequest, endpoint: str, model: str, ignore_eos: bool,
                  extra_body: dict[str, Any] | None = None) -> dict[str, Any]:
    """The JSON body of one streaming request (greedy, usage requested)."""
    body: dict[str, Any] = {"model": model, "max_tokens": req.output_len, "temperature": 0.0,
                            "stream": True, "stream_options": {"include_usage": True}}
    if endpoint == "chat":
        body["messages"] = req.messages or [{"role": "user", "content": req.prompt}]
    else:
        body["prompt"] = req.prompt
    if ignore_eos:
        body["ignore_eos"] = True  # vLLM/kvflow extension
    body.update(extra_body or {})
    return body


def _chunk_text(obj: dict[str, Any], endpoint: str) -> tuple[str, bool]:
    """Generated text of one stream chunk, and whether the chunk carries generated tokens.

    Every chunk with a choice does, its text possibly empty (vLLM's rule): a server streams
    a chunk for tokens that have no text yet (vLLM's, for part of a UTF-8 character or a
    skipped special token; kvflow's with ``logprobs`` or ``return_token_ids``), and the chunk
    that ends the choice carries its last tokens (an EOS: no text). A chat delta's tokens may
    also be reasoning (``reasoning_content``, or vLLM's newer ``reasoning``, under a
    reasoning parser) or a tool call's name and arguments (``tool_calls``, under a tool
    parser): their text is part of the generated text. Only a chat role chunk (a ``role``
    and no text: the reply's announcement, which some servers send before the prefill) and
    usage chunks carry none: one without choices, or one whose choice is empty (no text,
    token ids or finish reason: a server's final usage chunk with an empty choice)."""
    choices = obj.get("choices") or []
    if not choices:
        return "", False
    choice = choices[0]
    if endpoint == "chat":
        delta = choice.get("delta") or {}
        text = "".join(_delta_texts(delta))
        filled, role_chunk = bool(text or delta.get("tool_calls")), "role" in delta
    else:
        text = choice.get("text") or ""
        filled, role_chunk = bool(text), False
    if filled or choice.get("token_ids") or choice.get("finish_reason"):
        return text, True
    return text, not role_chunk and not obj.get("usage")  # empty: tokens without text yet


def _delta_texts(delta: dict[str, Any]) -> list[str]:
    """The generated text pieces of one chat delta: reasoning (``reasoning_content``, else
    ``reasoning``: a server may send both, the same text), content, then each tool call's
    name and arguments (non-string values are left out)."""
    reasoning = delta.get("reasoning_content")
    if not isinstance(reasoning, str):
        reasoning = delta.get("reasoning")
    pieces = [reasoning, delta.get("content")]
    for call in delta.get("tool_calls") or []:
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict):
            pieces += [function.get("name"), function.get("arguments")]
    return [p for p in pieces if isinstance(p, str)]


def _apply_event(result: RequestResult, data: str, endpoint: str, now: float) -> bool:
    """Fold one SSE ``data:`` payload into ``result``; False at ``[DONE]`` or an error event."""
    if data == "[DONE]":
        return False
    obj = json.loads(data)
    if "error" in obj:
        result.error = f"error event in stream: {json.dumps(obj['error'])}"
        return False
    text, has_tokens = _chunk_text(obj, endpoint)
    if has_tokens:
        result.token_times.append(now)
        result.text += text
    usage = obj.get("usage")
    if usage:
        result.prompt_tokens = usage.get("prompt_tokens")
        result.completion_tokens = usage.get("completion_tokens")
    return True


async def _read_stream(resp: aiohttp.ClientResponse, result: RequestResult,
                       endpoint: str) -> None:
    async for raw in resp.content:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue  # blank separators, comments, "event:" lines
        if not _apply_event(result, line[5:].strip().decode(), endpoint, time.perf_counter()):
            break


async def send_request(session: aiohttp.ClientSession, url: str, payload: dict[str, Any],
                       endpoint: str, headers: dict[str, str] | None = None) -> RequestResult:
    """POST ``payload`` to ``url`` and time the stream. Never raises for a failed request: the
    status and error body (or the exception) land in ``RequestResult.error``."""
    result = RequestResult(start=time.perf_counter())
    try:
        async with session.post(url, json=payload, headers=headers) as resp:
            if resp.status != 200:
                body = (await resp.text())[:2000]
                result.error = f"HTTP {resp.status}: {body}"
            else:
                await _read_stream(resp, result, endpoint)
                if not result.error and not result.token_times:
                    result.error = "stream ended without any generated token"
    except TimeoutError:
        result.error = (f"TimeoutError: no complete response within "
                        f"{session.timeout.total:g} s (--request-timeout)")
    except (aiohttp.ClientError, json.JSONDecodeError, UnicodeDecodeError) as e:
        result.error = f"{type(e).__name__}: {e}"
    result.end = time.perf_counter()
    result.success = not result.error
    return result
