"""AsyncLLM: the serving engine. EngineCore runs in its own process; this side does the rest.

```
API process (asyncio)                                 engine-core process (busy loop)
  add_request: InputProcessor -> Requests  --AddRequests-->  EngineCore.add_request
  abort:       OutputProcessor.abort       --AbortRequests-> EngineCore.abort_requests (frees KV)
  output loop: OutputProcessor.process     <--EngineOutputs--  EngineCore.step + stats
               (detokenize, stop strings)                     (every step with new tokens)
               -> per-request RequestStream (delta RequestOutputs)
```
Both channels are ZMQ PUSH/PULL pairs over ``ipc://`` sockets in a private temporary
directory, carrying msgspec/msgpack messages (``kvflow.engine.messages``). The HTTP event loop
only ever does non-blocking sends and awaits receives, so it never waits on the model.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import shutil
import tempfile
import time
from collections.abc import Callable

import msgspec
import zmq
import zmq.asyncio

from kvflow.config import EngineConfig
from kvflow.engine.core_proc import run_engine_core
from kvflow.engine.messages import (
    AbortRequests,
    AddRequests,
    EngineCoreRequest,
    EngineFailed,
    EngineOutputs,
    EngineReady,
    Shutdown,
    output_decoder,
)
from kvflow.engine_outputs import EngineStats
from kvflow.input_processor import InputProcessor
from kvflow.metrics import RequestStatsTracker, ServerMetrics
from kvflow.models.generation_config import load_sampling_defaults
from kvflow.models.loader import load_tokenizer, resolve_eos_token_id
from kvflow.models.model_resolver import ModelSource, resolve_model
from kvflow.output_processor import OutputProcessor
from kvflow.outputs import CompletionOutput, RequestOutput
from kvflow.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_POLL_MS = 1000  # how often the output loop checks that the core process is alive


class EngineDeadError(RuntimeError):
    """The engine-core process died or reported a fatal error; no request can proceed."""


class RequestStream:
    """Async iterator over one request's delta RequestOutputs; ends after the finished one.

    Raises:
        EngineDeadError: from iteration if the engine dies meanwhile.
    """

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.finished = False

    def put(self, item: RequestOutput | BaseException) -> None:
        self._queue.put_nowait(item)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        self.finished = item.finished
        return item


class AsyncLLM:
    """Engine client for the server: starts the engine-core process and streams outputs.

    Construction blocks until the model is loaded (call it before the event loop serves);
    then ``await start()`` inside the loop, ``add_request`` / ``abort`` per request, and
    ``await shutdown()`` at the end.

    Args:
        config: engine configuration (the core process builds its EngineCore from it).
        metrics: where to record request and engine metrics (default: a fresh ServerMetrics).
        start_timeout: seconds to wait for the core process to load the model.

    Raises:
        RuntimeError: if the core process fails to start or exceeds ``start_timeout``.
        ValueError: for a bad model or tokenizer.
    """

    def __init__(self, config: EngineConfig, metrics: ServerMetrics | None = None,
                 start_timeout: float = 600.0) -> None:
        self.config = config
        self.metrics = metrics or ServerMetrics(config.model_config.model)
        self.tracker = RequestStatsTracker(self.metrics)
        self.stats = EngineStats()
        self._streams: dict[str, RequestStream] = {}
        self._waiting: set[str] = set()  # accepted, no output yet
        self._dead: BaseException | None = None
        self._output_task: asyncio.Task | None = None
        # Called once (in the event loop) when the core process dies or fails; see start().
        self.on_dead: Callable[[EngineDeadError], None] | None = None
        self._init_ipc()
        try:
            mc = config.model_config
            source = resolve_model(mc.model, mc.download_dir)  # a Hub download happens here
            self.sampling_defaults = load_sampling_defaults(source, mc.generation_config)
            self._start_core_process()  # its resolve_model then finds the snapshot cached
            self._init_tokenizer(source)  # while the core process loads the model
            self._init_processors(self._wait_ready(start_timeout))
        except BaseException:
            self.close()
            raise

    # ---- start-up ----------------------------------------------------------------------------
    def _init_ipc(self) -> None:
        self._ipc_dir = tempfile.mkdtemp(prefix="kvflow-")
        self._ctx = zmq.Context()
        self._input_addr = f"ipc://{os.path.join(self._ipc_dir, 'input')}"
        self._output_addr = f"ipc://{os.path.join(self._ipc_dir, 'output')}"
        self._input = self._ctx.socket(zmq.PUSH)
        self._input.setsockopt(zmq.SNDHWM, 0)  # never block the event loop on a send
        self._input.bind(self._input_addr)
        self._output = self._ctx.socket(zmq.PULL)
        self._output.setsockopt(zmq.RCVHWM, 0)
        self._output.bind(self._output_addr)
        self._async_output: zmq.asyncio.Socket | None = None
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = output_decoder()

    def _start_core_process(self) -> None:
        ctx = multiprocessing.get_context("spawn")  # no forked CUDA or torch thread state
        self._proc = ctx.Process(
            target=run_engine_core, name="kvflow-engine-core", daemon=True,
            args=(self.config, self._input_addr, self._output_addr,
                  logging.getLogger("kvflow").getEffectiveLevel()))
        self._proc.start()
        logger.info("engine core process started (pid %d)", self._proc.pid)

    def _init_tokenizer(self, source: ModelSource) -> None:
        mc = self.config.model_config
        self.tokenizer = None if mc.skip_tokenizer_init else load_tokenizer(source, mc.tokenizer)

    def _wait_ready(self, timeout: float) -> EngineReady:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._output.poll(200):
                msg = self._decoder.decode(self._output.recv())
                if isinstance(msg, EngineFailed):
                    raise RuntimeError(f"engine core failed to start: {msg.message}")
                if isinstance(msg, EngineReady):
                    return msg
            elif not self._proc.is_alive():
                raise RuntimeError(f"engine core process exited with code "
                                   f"{self._proc.exitcode} while starting")
        raise RuntimeError(f"engine core did not start within {timeout:.0f} s")

    def _init_processors(self, ready: EngineReady) -> None:
        self.max_model_len = ready.max_model_len
        self.vocab_size = ready.vocab_size
        self.num_kv_blocks = ready.num_blocks
        self.stats = ready.stats
        self.metrics.record_engine_stats(ready.stats)
        self.processor = InputProcessor(self.tokenizer, ready.max_model_len, ready.vocab_size,
                                        resolve_eos_token_id(self.tokenizer, ready))
        self.output_processor = OutputProcessor(self.tokenizer)

    async def start(self) -> None:
        """Start the output loop on the running event loop. When the core process dies or
        fails, every open stream gets an ``EngineDeadError``, new requests are refused, and
        ``on_dead(error)`` (if set) is called once."""
        self._async_output = zmq.asyncio.Socket.from_socket(self._output)
        self._output_task = asyncio.create_task(self._output_loop(), name="kvflow-outputs")

    @property
    def core_pid(self) -> int | None:
        """The engine-core process id (None before it started)."""
        proc = getattr(self, "_proc", None)
        return None if proc is None else proc.pid

    async def restart(self, timeout: float = 600.0) -> None:
        """Replace a dead core process by a new one (same config; the model loads again) and
        serve again. Requests are refused (``EngineDeadError``) until it is ready.

        Raises:
            RuntimeError: if the new core fails to start (the engine stays dead).
        """
        self._stop_core()
        self._init_ipc()
        self._start_core_process()
        ready = await asyncio.to_thread(self._wait_ready, timeout)
        self._init_processors(ready)
        self._dead = None
        await self.start()

    # ---- requests ----------------------------------------------------------------------------
    @property
    def is_healthy(self) -> bool:
        return self._dead is None and self._proc.is_alive()

    @property
    def dead_error(self) -> BaseException | None:
        """Why the engine stopped (e.g. which worker rank died), or None while it runs."""
        return self._dead

    @property
    def num_waiting_requests(self) -> int:
        """Accepted requests that have not produced any token yet (queued or in prefill)."""
        return len(self._waiting)

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams, priority: int = 0) -> RequestStream:
        """Validate and queue one prompt (its ``n`` samples); returns its output stream.
        Fields ``params`` was not given take the model's sampling defaults
        (``sampling_defaults``, from its generation_config.json).

        Raises:
            ValueError: for a bad prompt or parameters, or a request id in use (nothing queued).
            EngineDeadError: if the engine is gone.
        """
        if not self.is_healthy:
            raise EngineDeadError("the engine core is not running")
        arrival = time.monotonic()
        params = params.with_defaults(self.sampling_defaults)
        requests = self.processor.make_requests(request_id, prompt_token_ids, params, arrival,
                                                priority)
        try:  # encode before registering anything, so a refusal leaves no state behind
            payload = self._encoder.encode(
                AddRequests([EngineCoreRequest.from_request(r) for r in requests]))
        except (msgspec.EncodeError, OverflowError, TypeError) as e:
            raise ValueError(f"request {request_id!r} cannot be encoded: {e}") from None
        self.output_processor.add_request(prompt, requests, delta=True)
        stream = RequestStream(request_id)
        self._streams[request_id] = stream
        self._waiting.add(request_id)
        self.tracker.start(request_id, arrival, len(prompt_token_ids), params.n)
        self._input.send(payload, flags=zmq.NOBLOCK)
        return stream

    def abort(self, request_id: str) -> None:
        """Stop a request now (no-op if it already finished); the core frees its KV blocks
        before its next step."""
        sample_ids = self.output_processor.abort(request_id)
        self._streams.pop(request_id, None)
        self._waiting.discard(request_id)
        if sample_ids:
            self.tracker.abort(request_id)
            self._send(AbortRequests(sample_ids))

    def _send(self, msg: AddRequests | AbortRequests | Shutdown) -> None:
        if self._dead is None:
            self._input.send(self._encoder.encode(msg), flags=zmq.NOBLOCK)

    # ---- outputs -----------------------------------------------------------------------------
    async def _output_loop(self) -> None:
        try:
            while True:
                if not await self._async_output.poll(_POLL_MS):
                    if not self._proc.is_alive():
                        raise EngineDeadError(f"engine core process exited with code "
                                              f"{self._proc.exitcode}")
                    continue
                msg = self._decoder.decode(await self._async_output.recv())
                if isinstance(msg, EngineFailed):
                    raise EngineDeadError(f"engine core failed: {msg.message}")
                if isinstance(msg, EngineOutputs):
                    self._handle_outputs(msg)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - any failure here ends every request
            error = e if isinstance(e, EngineDeadError) else EngineDeadError(str(e))
            logger.error("engine core lost (%s): ending %d open requests with an error; new "
                         "requests get 503", error, len(self._streams))
            self._fail_all(error)
            if self.on_dead is not None:
                self.on_dead(error)

    def _handle_outputs(self, msg: EngineOutputs) -> None:
        self.stats = msg.stats
        self.metrics.record_engine_stats(msg.stats)
        outputs, stopped = self.output_processor.process(msg.outputs)
        if stopped:  # stop strings matched: free their KV blocks now
            self._send(AbortRequests(stopped))
        now = time.monotonic()
        for out in outputs:
            self.tracker.observe(out, now)
            self._waiting.discard(out.request_id)
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.put(out)
                if out.finished:
                    del self._streams[out.request_id]

    def _fail_all(self, error: EngineDeadError) -> None:
        self._dead = error
        for request_id, stream in self._streams.items():
            self.tracker.abort(request_id)
            stream.put(error)
        self._streams.clear()
        self._waiting.clear()

    # ---- shutdown ----------------------------------------------------------------------------
    async def shutdown(self) -> None:
        """Stop the output loop and the core process; release the sockets."""
        if self._output_task is not None:
            self._output_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._output_task
            self._output_task = None
        self.close()

    def close(self) -> None:
        """Synchronous teardown (idempotent): ask the core to stop, then make sure it does."""
        self._stop_core()

    def _stop_core(self) -> None:
        """Stop the core process (Shutdown, then kill after 5 s); release the sockets."""
        proc = getattr(self, "_proc", None)
        if proc is not None and proc.is_alive():
            with contextlib.suppress(zmq.ZMQError):
                self._input.send(self._encoder.encode(Shutdown()), flags=zmq.NOBLOCK)
            proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        for sock in (self._async_output, self._input, self._output):
            if sock is not None and not sock.closed:
                sock.close(linger=0)
        if not self._ctx.closed:
            self._ctx.term()
        shutil.rmtree(self._ipc_dir, ignore_errors=True)


async def collect(stream: RequestStream) -> RequestOutput:
    """Drain a stream and merge its deltas into one cumulative, finished RequestOutput.

    Raises:
        EngineDeadError: if the engine dies before the request finishes.
    """
    merged: dict[int, CompletionOutput] = {}
    texts: dict[int, list[str]] = {}
    last, prompt_logprobs = None, None
    async for delta in stream:
        last = delta
        prompt_logprobs = prompt_logprobs or delta.prompt_logprobs
        for c in delta.outputs:
            m = merged.setdefault(c.index, CompletionOutput(
                c.index, logprobs=None if c.logprobs is None else []))
            texts.setdefault(c.index, []).append(c.text)
            m.token_ids.extend(c.token_ids)
            if c.logprobs:
                m.logprobs.extend(c.logprobs)
            m.cumulative_logprob = c.cumulative_logprob
            m.finish_reason, m.stop_reason = c.finish_reason, c.stop_reason
    for index, m in merged.items():
        m.text = "".join(texts[index])
    return RequestOutput(last.request_id, last.prompt, last.prompt_token_ids,
                         [merged[i] for i in sorted(merged)], True, last.metrics,
                         prompt_logprobs)
