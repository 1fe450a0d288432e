"""``kvflow run-batch``: an OpenAI Batch file (JSONL) run offline through one engine.

Every accepted line is POSTed, in-process, to the very FastAPI app ``kvflow serve`` serves
(``api_server.build_app``, through httpx's ``ASGITransport``: no socket), so a line's
response body is byte for byte what the server answers, validation, 4xx error bodies and
``--served-model-name`` / ``--lora-modules`` / chat-template options included. All lines are
in flight at once (or ``--max-concurrency`` of them) over one AsyncLLM, so the scheduler
batches them continuously as it batches concurrent HTTP clients. Output lines are written in
input order as soon as every line before them is answered. The line formats are in
``batch_lines``, the files in ``batch_files``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import signal
import sys
import threading
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import httpx
from fastapi import FastAPI

from kvflow.config import EngineConfig, ServerConfig
from kvflow.config.options import add_field_arg
from kvflow.entrypoints.batch_files import BatchInput, BatchOutput, LineReader
from kvflow.entrypoints.batch_lines import BatchRequest, LineError, parse_line, response_line

logger = logging.getLogger(__name__)

# the ServerConfig fields that mean something without a socket (no host, port, API key,
# keep-alive, log level, overload limit or engine-failure policy)
BATCH_SERVER_FIELDS = ("served_model_name", "max_n", "max_logprobs", "max_request_body_size",
                       "engine_start_timeout", "tool_call_parser",
                       "exclude_tools_when_tool_choice_none", "reasoning_parser",
                       "reasoning_config", "structured_outputs_config",
                       "chat_template", "trust_request_chat_template",
                       "ignore_unknown_fields", "lora_modules",
                       "enable_prompt_tokens_details", "response_role",
                       "default_chat_template_kwargs", "chat_template_content_format",
                       "enable_auto_tool_choice", "enable_log_requests",
                       "disable_log_requests", "max_log_len", "enable_log_outputs",
                       "return_tokens_as_token_ids")


class EngineDiedDuringBatch(RuntimeError):
    """The engine core died while the batch ran; every line still got its output line."""


@dataclasses.dataclass
class BatchCounts:
    """Output lines written: ``succeeded`` got status 200; ``failed`` = ``refused`` (the
    batch's own ``error``) + ``error_responses`` (status other than 200)."""

    succeeded: int = 0
    refused: int = 0
    error_responses: int = 0

    @property
    def failed(self) -> int:
        return self.refused + self.error_responses

    def add(self, line: dict[str, Any]) -> None:
        if line["response"] is None:
            self.refused += 1
        elif line["response"]["status_code"] == 200:
            self.succeeded += 1
        else:
            self.error_responses += 1

    def summary(self) -> str:
        return (f"kvflow run-batch: {self.succeeded + self.failed} lines: {self.succeeded} "
                f"succeeded, {self.failed} failed ({self.error_responses} with an error "
                f"response, {self.refused} refused by the batch format)")


class BatchClient:
    """POSTs batch lines to ``app`` in-process (httpx ``ASGITransport``), as an HTTP client of
    ``kvflow serve`` would; :meth:`aclose` when done."""

    def __init__(self, app: FastAPI) -> None:
        # an exception the app's handlers did not turn into a response is answered as 500
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        self._http = httpx.AsyncClient(transport=transport, base_url="http://run-batch",
                                       timeout=None)
        self._unknown = app.state.unknown_fields

    async def aclose(self) -> None:
        await self._http.aclose()

    async def answer(self, request: BatchRequest | LineError) -> dict[str, Any]:
        """The output line of one parsed input line: a ``LineError``'s own, or the app's
        response to ``request.body`` POSTed to ``request.url``. Never raises (but for
        cancellation): a failure of kvflow's own is a status-500 line, so no line is lost."""
        if isinstance(request, LineError):
            return request.output()
        if request.ignored:  # --ignore-unknown-fields: logged once per name, as body fields
            self._unknown.log.note_names(request.ignored, "run-batch lines",
                                         "batch line keys kvflow does not know")
        try:
            resp = await self._http.post(request.url, content=json.dumps(request.body),
                                         headers={"content-type": "application/json"})
            return response_line(request.custom_id, resp.status_code, _body(resp))
        except Exception as e:  # one line's failure must not end the batch
            logger.exception("line %d failed", request.line)
            error = {"message": f"internal error: {type(e).__name__}: {e}",
                     "type": "internal_server_error", "param": None, "code": None}
            return response_line(request.custom_id, 500, {"error": error})


def _body(resp: httpx.Response) -> Any:
    """The response's JSON body (every route the batch reaches answers JSON); text otherwise
    (not expected: kept rather than lost)."""
    try:
        return resp.json()
    except ValueError:
        return resp.text


async def run_lines(lines: Iterator[bytes],
                    answer: Callable[[BatchRequest | LineError], Any],
                    write: Callable[[dict[str, Any]], None],
                    max_concurrency: int | None = None,
                    ignore_unknown: bool = False) -> BatchCounts:
    """Parse and answer every line of ``lines`` concurrently, and ``write`` each output line
    in input order as soon as the lines before it are written (``ignore_unknown``: a line's
    keys beyond the four pass, ``batch_lines.parse_line``). At most ``max_concurrency``
    lines (None: no bound) are read but not yet written: a slow line holds back the reading
    of further lines, so memory stays bounded on a huge file. Lines are read by a thread of
    their own (``batch_files.LineReader``: stdin may block); while it waits for the next
    line, the lines answered meanwhile are written (a pipe's writer sees each answer
    without sending another line first).

    Returns:
        The counts of what was written (one output line per input line).
    """
    seen_ids: set[str] = set()
    counts = BatchCounts()
    pending: deque[asyncio.Future] = deque()
    number, reader = 0, LineReader(lines)
    next_line: asyncio.Future | None = None

    def write_next(result: dict[str, Any]) -> None:
        counts.add(result)
        write(result)

    try:
        while True:
            next_line = asyncio.ensure_future(reader.next())
            await _write_answered(pending, next_line, write_next)
            if (raw := next_line.result()) is None:
                break
            number += 1
            request = parse_line(raw, number, seen_ids, ignore_unknown)
            pending.append(asyncio.ensure_future(answer(request)))
            while pending and len(pending) >= (max_concurrency or float("inf")):
                write_next(await pending.popleft())
        while pending:
            write_next(await pending.popleft())
    finally:  # an error or Ctrl-C: the requests still in flight are cancelled (aborted)
        for future in pending:
            future.cancel()
        if next_line is not None:
            next_line.cancel()  # a no-op once done
    return counts


async def _write_answered(pending: deque[asyncio.Future], waiting: asyncio.Future,
                          write_next: Callable[[dict[str, Any]], None]) -> None:
    """Until ``waiting`` (the next line's read) is done, write each line at the head of
    ``pending`` as soon as it is answered (input order: only the head is written)."""
    while True:
        while pending and pending[0].done():
            write_next(pending.popleft().result())
        if waiting.done():
            return
        await asyncio.wait([waiting, *([pending[0]] if pending else [])],
                           return_when=asyncio.FIRST_COMPLETED)


async def run_batch(app: FastAPI, lines: Iterator[bytes], write: Callable[[dict], None],
                    max_concurrency: int | None = None) -> BatchCounts:
    """Start ``app``'s engine (``api_server.start_app``: its output loop, the
    ``--lora-modules`` adapters), run every line through the app (:func:`run_lines`), and
    shut the engine down.

    Raises:
        ValueError: for a ``--lora-modules`` adapter the engine refuses.
        EngineDiedDuringBatch: when the engine core died meanwhile (the lines answered
            after it hold 503 bodies, code ``engine_dead``, as the server's would).
    """
    from kvflow.entrypoints.api_server import start_app

    await start_app(app)
    try:
        client = BatchClient(app)
        try:
            counts = await run_lines(lines, client.answer, write, max_concurrency,
                                     app.state.unknown_fields.ignore)
        finally:
            await client.aclose()
    finally:
        await app.state.engine.shutdown()
    if app.state.engine_died:
        raise EngineDiedDuringBatch("the engine core process died during the batch; the "
                                    "lines answered after it hold 503 (engine_dead) "
                                    "responses")
    return counts


def add_run_batch_parser(sub: argparse._SubParsersAction) -> None:
    """``kvflow run-batch``: ``-i``, ``-o``, ``--max-concurrency``, ``--no-progress``, every
    engine flag and the server flags in ``BATCH_SERVER_FIELDS``."""
    parser = sub.add_parser(
        "run-batch", help="run an OpenAI batch file (JSONL) offline",
        description="Run every request of an OpenAI Batch input file (JSONL: one "
        '{"custom_id", "method": "POST", "url", "body"} per line; url /v1/chat/completions, '
        "/v1/completions, /v1/embeddings, /v1/responses, /v1/score (or /score), /v1/rerank "
        "(or /rerank, /v2/rerank) or /v1/classify) through "
        "one engine, "
        "concurrently, and write one output line per input line, in input order, each "
        "holding the body kvflow serve would answer (4xx error bodies included). Lines that "
        "are not valid batch requests (not JSON, missing fields or other keys, other methods "
        "or urls, a "
        "repeated custom_id, stream: true, a /v1/responses previous_response_id: lines run "
        "concurrently and no stored reply outlives the batch) get an output line with an "
        "'error' instead. Exit status 0 once the "
        "whole file is processed, whatever the lines' statuses; 2 with one 'kvflow: error:' "
        "line for bad options, an input that cannot be read or an output that cannot be "
        "written (checked before the model loads); 1 if the engine fails.")
    parser.add_argument("-i", "--input-file", required=True, metavar="FILE",
                        help="the batch input file (JSONL), or - for stdin")
    parser.add_argument("-o", "--output-file", required=True, metavar="FILE",
                        help="the output file (JSONL; written whole or not at all: a "
                        "temporary file renamed at the end), or - for stdout")
    parser.add_argument("--max-concurrency", type=int, default=None, metavar="N",
                        help="at most N lines read but not yet written (in flight or "
                        "waiting for an earlier line); default: no bound")
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress bar on stderr")
    EngineConfig.add_cli_args(parser)
    group = parser.add_argument_group("ServerConfig")
    for f in dataclasses.fields(ServerConfig):
        if f.name in BATCH_SERVER_FIELDS:
            add_field_arg(group, f)
    parser.set_defaults(func=cmd_run_batch)


def cmd_run_batch(args: argparse.Namespace) -> int:
    """Run ``kvflow run-batch``; returns the exit status (0: every line has its output line;
    1: the engine did not start or reading / writing failed mid-batch (no output written),
    or the engine died during the batch (the output written, its later lines 503s)). The
    summary line goes to stderr.

    Raises:
        ValueError: for bad options (``--admission-control`` too: offline lines are never
            refused), an input that cannot be read or an output that cannot be written (all
            checked before the model loads).
    """
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency {args.max_concurrency}: must be >= 1")
    engine_config = EngineConfig.from_cli_args(args)
    if engine_config.scheduler_config.admission_control:  # as LLM() and kvflow generate
        raise ValueError("--admission-control is a kvflow serve option: run-batch answers "
                         "every line (a line refused with 503 would be lost, never retried)")
    server_config = ServerConfig(**{name: getattr(args, name) for name in BATCH_SERVER_FIELDS})
    if server_config.log_requests:  # each line's request logged at INFO, as kvflow serve logs
        logging.getLogger("kvflow.entrypoints.serving_base").setLevel(logging.INFO)
    if server_config.enable_log_outputs:  # each sample's output too (--enable-log-outputs)
        logging.getLogger("kvflow.entrypoints.output_log").setLevel(logging.INFO)
    source = BatchInput(args.input_file)
    try:
        sink = BatchOutput(args.output_file)
    except ValueError:
        source.close()
        raise
    try:
        with _sigterm_exits():
            counts = _run(engine_config, server_config, source, sink, args)
        sink.commit()
    except RuntimeError as e:
        if isinstance(e, EngineDiedDuringBatch):
            sink.commit()  # every line was answered (503 after the engine died)
        print(f"kvflow: error: {e}", file=sys.stderr)
        return 1
    finally:  # also on Ctrl-C / SIGTERM: the output path keeps what it held
        sink.discard()
        source.close()
    print(counts.summary(), file=sys.stderr)
    return 0


@contextlib.contextmanager
def _sigterm_exits() -> Iterator[None]:
    """SIGTERM raises SystemExit(143) (128 + SIGTERM) in the main thread, so the clean-up
    Ctrl-C gets runs for it too (engine processes stopped, the temporary output removed)
    instead of the process ending mid-write; the previous handler is put back after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def _exit_143(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, _exit_143)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _run(engine_config: EngineConfig, server_config: ServerConfig, source: BatchInput,
         sink: BatchOutput, args: argparse.Namespace) -> BatchCounts:
    """Load the model as ``kvflow serve`` does (the options checked first), then run the
    batch with a progress bar on stderr."""
    from tqdm import tqdm

    from kvflow.chat_template_source import load_chat_template, warn_if_model_template_broken
    from kvflow.engine.async_llm import AsyncLLM
    from kvflow.engine.start_method import core_start_method
    from kvflow.entrypoints.api_server import build_app
    from kvflow.entrypoints.preload_checks import check_lora_modules
    from kvflow.metrics.server import ServerMetrics

    names = server_config.model_names(engine_config.model_config.model)
    model_name = names[0]
    check_lora_modules(server_config.lora_modules or (), engine_config, names)
    template = None if server_config.chat_template is None else \
        load_chat_template(server_config.chat_template)
    total = source.count_lines()
    engine = AsyncLLM(engine_config, ServerMetrics(model_name),
                      server_config.engine_start_timeout,
                      on_tokenizer=warn_if_model_template_broken if template is None else None,
                      start_method=core_start_method(getattr(args, "fresh_process", False)))
    try:
        app = build_app(engine, server_config, model_name, template)
        app.state.chat.cli_command = "kvflow run-batch"  # as its errors name the flag
        with tqdm(total=total, desc="run-batch", unit="line", disable=args.no_progress,
                  file=sys.stderr) as bar:
            def write(line: dict[str, Any]) -> None:
                sink.write(line)
                bar.update(1)

            return asyncio.run(run_batch(app, source.lines(), write, args.max_concurrency))
    finally:
        engine.close()
