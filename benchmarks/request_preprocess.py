"""Per-request cost of the API server's input guards, against doing without them, in one run.

For an ordinary prompt (``--chars`` characters of English-like text, tokenized inline as
before) it times, per request: the old path (``tokenizer.encode``) against the new one
(``preprocess.off_loop`` + ``encode_checked``, awaited on an event loop), and an ASGI request
passed through ``BodySizeLimitMiddleware`` against the bare app. Then, for ``--big-chars``
characters, how long the event loop is blocked: tokenized inline (the old path) against
``off_loop`` (a worker thread; the loop's longest pause is measured by a 1 ms ticker).

    .venv/bin/python benchmarks/request_preprocess.py --tokenizer out/smollm2-hf

Prints medians in microseconds (per request) and milliseconds (loop pauses), and ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from transformers import AutoTokenizer

from kvflow.entrypoints.body_limit import BodySizeLimitMiddleware
from kvflow.entrypoints.preprocess import encode_checked, off_loop

WORDS = "the quick brown fox jumps over a lazy dog while kvflow pages keys and values "


def _paired_us(old, new, repeats: int) -> tuple[float, float]:
    """Median microseconds of ``old()`` and ``new()``, called in turn (same machine load)."""
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeats):
        for fn, out in ((old, times[0]), (new, times[1])):
            start = time.perf_counter()
            fn()
            out.append(time.perf_counter() - start)
    return statistics.median(times[0]) * 1e6, statistics.median(times[1]) * 1e6


async def _asgi_once(app) -> None:
    scope = {"type": "http", "method": "POST", "path": "/v1/completions",
             "headers": [(b"content-type", b"application/json"), (b"content-length", b"600")]}

    async def receive() -> dict:
        return {"type": "http.request", "body": b"x" * 600, "more_body": False}

    async def send(_: dict) -> None:
        return None

    await app(scope, receive, send)


async def _bare_app(scope, receive, send) -> None:
    await receive()


async def _longest_pause(work) -> tuple[float, float]:
    """(the event loop's longest pause in ms while ``work`` runs, its wall time in s)."""
    pauses, done = [], asyncio.Event()

    async def ticker() -> None:
        last = time.perf_counter()
        while not done.is_set():
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            pauses.append(now - last)
            last = now

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0.01)
    start = time.perf_counter()
    await work()
    wall = time.perf_counter() - start
    done.set()
    await task
    return max(pauses) * 1e3, wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--chars", type=int, default=600)
    parser.add_argument("--big-chars", type=int, default=4_000_000)
    parser.add_argument("--repeats", type=int, default=2000)
    args = parser.parse_args()
    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    text = (WORDS * (args.chars // len(WORDS) + 1))[:args.chars]
    loop = asyncio.new_event_loop()

    async def encode_old() -> list[int]:  # the old handler's call, in a coroutine too
        return tok.encode(text, add_special_tokens=True)

    old, new = _paired_us(lambda: loop.run_until_complete(encode_old()),
                          lambda: loop.run_until_complete(off_loop(
                              len(text), encode_checked, tok, text, 2047, True)), args.repeats)
    guard = BodySizeLimitMiddleware(_bare_app, 32 * 2**20)
    bare, guarded = _paired_us(lambda: loop.run_until_complete(_asgi_once(_bare_app)),
                               lambda: loop.run_until_complete(_asgi_once(guard)), args.repeats)
    print(f"tokenize {args.chars} chars: encode {old:.1f} us, off_loop+encode_checked "
          f"{new:.1f} us (+{new - old:.1f} us, {new / old:.3f}x)")
    print(f"ASGI request: bare {bare:.1f} us, with the body limit {guarded:.1f} us "
          f"(+{guarded - bare:.1f} us)")

    big = WORDS * (args.big_chars // len(WORDS))

    async def inline() -> None:
        tok.encode(big)

    async def threaded() -> None:
        await asyncio.to_thread(tok.encode, big)

    for name, work in (("inline (old)", inline), ("worker thread (new)", threaded)):
        pause, wall = loop.run_until_complete(_longest_pause(work))
        print(f"tokenize {len(big)} chars {name}: event loop's longest pause {pause:.0f} ms "
              f"(tokenizing took {wall:.2f} s)")


if __name__ == "__main__":
    main()
