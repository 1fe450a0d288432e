"""vLLM's ``--sse-keep-alive-interval`` (the comment inserted while the body is idle, no chunk
lost or reordered), ``--enable-log-outputs`` (each finished sample logged, joined from the
deltas, cut to ``--max-log-len``; refused without ``--enable-log-requests``) and
``--disable-log-stats`` (accepted; its ``--no-`` form refused) without a model; served
effects are in tests/e2e/test_openai_serve_flags.py."""

from __future__ import annotations

import asyncio
import logging

import pytest

from kvflow import LLM
from kvflow.config import ServerConfig
from kvflow.entrypoints.cli import build_parser, main
from kvflow.entrypoints.output_log import OutputLog
from kvflow.entrypoints.sse_keep_alive import KEEP_ALIVE_COMMENT, with_keep_alive
from kvflow.outputs import CompletionOutput, RequestMetrics, RequestOutput


def _config(*argv: str) -> ServerConfig:
    return ServerConfig.from_cli_args(build_parser().parse_args(["serve", "m", *argv]), env={})


async def _body(gaps: list[float], closed: list[bool]):
    try:
        for i, gap in enumerate(gaps):
            await asyncio.sleep(gap)
            yield f"data: {i}\n\n"
    finally:
        closed.append(True)


def _collect(gaps: list[float], interval: float) -> tuple[list[str], list[bool]]:
    closed: list[bool] = []

    async def run() -> list[str]:
        return [chunk async for chunk in with_keep_alive(_body(gaps, closed), interval)]
    return asyncio.run(run()), closed


def test_keep_alive_while_idle():
    got, closed = _collect([0.0, 0.35, 0.0], 0.1)
    data = [c for c in got if c != KEEP_ALIVE_COMMENT]
    assert data == ["data: 0\n\n", "data: 1\n\n", "data: 2\n\n"]
    assert got[0] == "data: 0\n\n" and got[-2:] == ["data: 1\n\n", "data: 2\n\n"]
    assert 2 <= got.count(KEEP_ALIVE_COMMENT) <= 4  # 0.35 s idle, one per 0.1 s
    assert closed == [True]


def test_no_keep_alive_at_zero():
    closed: list[bool] = []
    body = _body([0.0], closed)
    assert with_keep_alive(body, 0) is body  # off: the body untouched
    assert _collect([0.2], 0)[0] == ["data: 0\n\n"]


def test_closing_early_closes_the_body():
    closed: list[bool] = []

    async def run() -> None:
        stream = with_keep_alive(_body([0.0, 5.0], closed), 0.05)
        assert await anext(stream) == "data: 0\n\n"
        assert await anext(stream) == KEEP_ALIVE_COMMENT
        await stream.aclose()  # the client left: the body's cleanup runs at once
    asyncio.run(asyncio.wait_for(run(), 3))
    assert closed == [True]


def _delta(index: int, text: str, ids: list[int], finish: str | None) -> RequestOutput:
    return RequestOutput("r", None, [1], [CompletionOutput(index, text, ids,
                                                           finish_reason=finish)],
                         finish is not None, RequestMetrics(0.0))


def test_output_log_joins_deltas_per_sample(caplog):
    log = OutputLog("cmpl-x-0", max_log_len=5)
    with caplog.at_level(logging.DEBUG, logger="kvflow.entrypoints.output_log"):
        log(_delta(0, "hel", [1, 2], None))
        log(_delta(1, "ab", [7], None))
        log(_delta(0, "lo world", [3, 4, 5, 6, 8, 9], "length"))
        log(_delta(1, "c", [9], "stop"))
    assert [r.getMessage() for r in caplog.records] == [
        "Generated response cmpl-x-0 details: output_token_ids: [1, 2, 3, 4, 5]",
        "Generated response cmpl-x-0: output: 'hello', finish_reason: length",
        "Generated response cmpl-x-0 (choice 1) details: output_token_ids: [7, 9]",
        "Generated response cmpl-x-0 (choice 1): output: 'abc', finish_reason: stop"]
    assert [r.levelno for r in caplog.records] == [logging.DEBUG, logging.INFO] * 2


def test_flags_parse_and_refusals(capsys):
    config = _config("--enable-log-requests", "--enable-log-outputs", "--disable-log-stats",
                     "--sse-keep-alive-interval", "15", "--return-tokens-as-token-ids")
    assert config.enable_log_outputs and config.disable_log_stats
    assert config.sse_keep_alive_interval == 15 and config.return_tokens_as_token_ids
    defaults = _config()
    assert not defaults.enable_log_outputs and defaults.sse_keep_alive_interval == 0
    assert not defaults.return_tokens_as_token_ids
    for argv, needle in [(["--enable-log-outputs"], "needs --enable-log-requests"),
                         (["--no-disable-log-stats"], "--no-disable-log-stats"),
                         (["--sse-keep-alive-interval", "-1"], "must be >= 0 seconds")]:
        assert main(["serve", "m", *argv]) == 2
        err = capsys.readouterr().err
        assert needle in err, err


def test_llm_takes_disable_log_stats(tiny_llama):
    """vLLM's offline rule: False keeps the metrics ``get_metrics`` reads (tests/
    test_llm_get_metrics.py), True or unset none."""
    for value in (True, None):
        kwargs = {} if value is None else {"disable_log_stats": value}
        llm = LLM(model=tiny_llama.path, num_kv_blocks=16, **kwargs)
        with pytest.raises(ValueError, match="disable_log_stats=False"):
            llm.get_metrics()
