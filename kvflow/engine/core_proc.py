"""The engine core in its own process: a busy loop around ``EngineCore.step`` fed over ZMQ.

The loop, once per iteration: take every pending input message (block only when there is no
work, waking every ``_IDLE_POLL_MS`` to check that the API process is still alive), run one
step if any request is unfinished, and send the step's outputs with fresh stats. A busy loop
also checks the API process every ``_PARENT_CHECK_S``: the core ends within about a second
of the API process's death (a SIGKILL, an OOM kill) with requests in flight, where it had
generated on for them, holding its device, until they finished (tens of seconds to minutes,
to nobody), and then only once its output socket's queue (1000 steps) had room. With
``--idle-batch-window-ms`` an idle engine's first step waits for input instead while the
scheduler's window is open (``Scheduler.batch_wait_s``). Aborts are
therefore applied (and their KV blocks freed) before the next step. Before it reports ready,
the process freezes its start-up heap (model, tokenizer) out of the garbage collector's reach
(``kvflow.runtime.gc_heap``; its imports' objects first thing, so that the collection before ready
walks only what loading made); from its start (before the model loads), a thread of its own
sends the API process a heartbeat every second (``kvflow/engine/core_heartbeat.py``), so that
a stopped or frozen core is found, while it starts too.
"""

from __future__ import annotations

import logging
import math
import multiprocessing
import os
import signal
import sys
import time
import traceback
from typing import Any, NoReturn

import msgspec
import zmq

from kvflow.config import EngineConfig
from kvflow.core.engine_core import EngineCore
from kvflow.core.request_errors import STRUCTURED_OUTPUTS
from kvflow.engine.core_heartbeat import start_core_heartbeat
from kvflow.engine.core_process_setup import (
    remove_folder_of_a_gone_parent,
    set_up_core_process,
    wait_for_go,
)
from kvflow.engine.core_stats import collect_stats
from kvflow.engine.forkserver_start import ParentState
from kvflow.engine.messages import (
    AbortRequests,
    AddLoRA,
    AddRequests,
    AdmissionVerdicts,
    CollectiveRPC,
    EngineFailed,
    EngineOutputs,
    EngineReady,
    Rejection,
    RemoveLoRA,
    ResetPrefixCache,
    Shutdown,
    Sleep,
    UtilityCall,
    UtilityResult,
    WakeUp,
    input_decoder,
)
from kvflow.engine_outputs import EngineCoreOutput
from kvflow.executor.base import ExecutorError
from kvflow.models.loader import resolve_eos_token_id
from kvflow.request import Request
from kvflow.runtime.gc_heap import freeze_import_heap, freeze_startup_heap

logger = logging.getLogger(__name__)

_IDLE_POLL_MS = 1000  # how often (at most) an idle core checks its parent and workers
_PARENT_CHECK_S = 1.0  # how often a busy core checks it (between steps)
_BUSY_RETRY_AFTER_S = 1.0  # Retry-After of a refusal for saturated grammar compiles


def run_engine_core(config: EngineConfig, input_addr: str, output_addr: str,
                    log_level: int = logging.WARNING, env: dict[str, str] | None = None,
                    go: str | None = None, parent: ParentState | None = None,
                    generation: int = 0) -> None:
    """Process entry point: build the EngineCore, report ready (or failed), serve until told
    to shut down or until the parent process dies.

    Args:
        config: the engine configuration.
        input_addr / output_addr: ZMQ addresses bound by the API process (PUSH -> our PULL,
            our PUSH -> its PULL).
        log_level: logging level of this process.
        env: environment variables to set first (``core_client.core_process_env``).
        go: a file path, or None. The API process starts the core before it has checked
            config.json, so that this process's imports (torch, the engine: seconds) overlap
            that check; the core reads nothing of the model until the API process creates
            ``go`` (:func:`wait_for_go`), and ends quietly on ``Shutdown`` meanwhile. (A
            file in the API process's private IPC folder rather than a ``multiprocessing``
            Event, whose semaphores the resource tracker reported leaked at every Ctrl-C.)
        parent: for a core forked from the forkserver, the API process's environment and
            standard output and error, applied before anything else
            (``kvflow/engine/forkserver_start.py``); None otherwise.
        generation: how many cores this replica had before (``CoreProcess.generation``):
            a restarted core (above 0) tells KV cache event subscribers that the dead
            core's blocks are gone (``EngineCore.mark_restarted``).
    """
    tag = set_up_core_process(config, log_level, env, parent)
    freeze_import_heap()  # kvflow/runtime/gc_heap.py: the collection before ready skips the imports
    ctx = zmq.Context()
    inp, out = _connect(ctx, input_addr, output_addr)
    encoder = msgspec.msgpack.Encoder()
    index = config.parallel_config.data_parallel_rank
    core = None
    # from here, not from ready: a core frozen while it loads is found (StartupLiveness)
    heartbeat = start_core_heartbeat(index, output_addr,
                                     config.parallel_config.engine_heartbeat_timeout)
    try:
        core = _build_core(config, inp, out, encoder, index, go)
        if core is None:
            return
        if generation > 0:
            core.mark_restarted()
        freeze_startup_heap(f"engine {tag}")  # kvflow/runtime/gc_heap.py: no 0.2 s pauses in steps
        out.send(encoder.encode(_ready(core, index)))
        EngineCoreProc(core, inp, out, index).run()
    except Exception as e:  # noqa: BLE001 - report anything fatal to the API process
        logger.error("engine core failed: %s", traceback.format_exc())
        out.send(encoder.encode(EngineFailed(f"{type(e).__name__}: {e}", index)))
    finally:  # from here SIGTERM (CoreProcess.stop after its grace) waits for the clean-up
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        heartbeat.stop()
        if core is not None:
            core.shutdown()  # the executor's worker processes, if any
        inp.close(linger=0)
        out.close(linger=2000)
        ctx.term()


def _connect(ctx: zmq.Context, input_addr: str, output_addr: str
             ) -> tuple[zmq.Socket, zmq.Socket]:
    """The core's two sockets, connected to the API process's: (PULL from ``input_addr``,
    PUSH to ``output_addr``)."""
    inp, out = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    inp.connect(input_addr)
    out.connect(output_addr)
    return inp, out


def _build_core(config: EngineConfig, inp: zmq.Socket, out: zmq.Socket,
                encoder: msgspec.msgpack.Encoder, index: int, go: str | None
                ) -> EngineCore | None:
    """The EngineCore, once the API process lets it start (``go``: :func:`wait_for_go`);
    None when it was told to shut down first, or when ``config`` was refused as bad input
    (then reported on ``out`` as ``EngineFailed(bad_input=True)``: one line, no traceback,
    which the API process prints and re-raises). Any other error propagates."""
    if go is not None and not wait_for_go(go, inp):
        return None
    try:
        return EngineCore(config)
    except ValueError as e:  # bad input: one line, no traceback (the caller re-raises it)
        logger.debug("engine core: %s", e)  # the API process prints it
        out.send(encoder.encode(EngineFailed(str(e), index, bad_input=True)))
        return None


def engine_core_process(*args: Any) -> NoReturn:
    """The engine-core process's target: :func:`run_engine_core` (same arguments), then exit
    at once, as forked multiprocessing children do. A spawned child would run the
    interpreter's teardown, which with torch loaded takes seconds (4 s on 2 busy cores):
    ``kvflow serve`` stopped that much later on Ctrl-C, and past the API process's 5 s grace
    the core was killed (its workers and folder left to the death pipe)."""
    status = 0
    try:
        run_engine_core(*args)
    except SystemExit as e:  # SIGTERM (unwind_on_sigterm), cleaned up on the way out
        status = e.code if isinstance(e.code, int) else 1
    remove_folder_of_a_gone_parent(args[2])
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _ready(core: EngineCore, engine_index: int = 0) -> EngineReady:
    return EngineReady(core.max_model_len, core.hf_config.vocab_size,
                       resolve_eos_token_id(None, core.hf_config), core.num_blocks,
                       core.config.cache_config.block_size, collect_stats(core), engine_index,
                       core.task, core.pooler_config, core.hf_config.hidden_size,
                       core.max_model_len_note, core.kv_cache_manager.enable_prefix_caching)


def idle_poll_ms(executor: Any) -> int:
    """Milliseconds between an idle core's wake-ups (each checks the API process and the
    workers): ``_IDLE_POLL_MS``, or less where the executor's workers need checking more
    often (``Executor.health_check_interval_s``: a quarter of a short
    ``worker_heartbeat_timeout``; at 1 s a 2 s timeout was never judged while idle, every
    check coming more than half a timeout after the previous one)."""
    if executor is None:
        return _IDLE_POLL_MS
    return max(1, min(_IDLE_POLL_MS, round(executor.health_check_interval_s * 1000)))


class EngineCoreProc:
    """The busy loop. ``run`` returns on ``Shutdown`` or when the parent process is gone and
    raises what ``EngineCore.step`` raises (and, while idle, ``EngineCore.check_health``:
    a dead worker process)."""

    def __init__(self, core: EngineCore, inp: zmq.Socket, out: zmq.Socket,
                 engine_index: int = 0) -> None:
        self.core, self.inp, self.out = core, inp, out
        self.engine_index = engine_index
        self._decoder = input_decoder()
        self._encoder = msgspec.msgpack.Encoder()
        self._parent = multiprocessing.parent_process()
        self._errors: list[EngineCoreOutput] = []  # requests refused by the core
        self._admission_control = core.config.scheduler_config.admission_control
        self._verdicts = AdmissionVerdicts([], [])
        self._idle_poll_ms = idle_poll_ms(getattr(core, "executor", None))

    def run(self) -> None:
        next_parent_check = time.monotonic() + _PARENT_CHECK_S
        while True:
            busy = self.core.has_unfinished_requests()
            handled = self._handle_inputs(block=not busy)
            if handled is None:
                return
            if busy and time.monotonic() >= next_parent_check:
                if not self._parent_alive():
                    logger.warning("API process is gone; engine core exiting (its "
                                   "unfinished requests dropped)")
                    return
                next_parent_check = time.monotonic() + _PARENT_CHECK_S
            if self._verdicts.accepted or self._verdicts.rejected:  # answer before the step
                self.out.send(self._encoder.encode(self._verdicts))
                self._verdicts = AdmissionVerdicts([], [])
            wait_s = self.core.scheduler.batch_wait_s()
            if wait_s > 0 and not self._errors:  # an idle engine's first step: let a burst in
                self.inp.poll(max(1, math.ceil(wait_s * 1e3)))  # up to the window's end
                continue
            outputs = self.core.step() if self.core.has_unfinished_requests() else []
            if outputs or handled or self._errors:
                outputs, self._errors = self._errors + outputs, []
                self.out.send(self._encoder.encode(EngineOutputs(
                    outputs, collect_stats(self.core), self.engine_index)))

    def _handle_inputs(self, block: bool) -> int | None:
        """Apply every pending message, first waiting for one if ``block``; returns how many
        were applied (None: stop the loop)."""
        if block:
            while not self.inp.poll(self._idle_poll_ms):
                if not self._parent_alive():
                    logger.warning("API process is gone; engine core exiting")
                    return None
                self.core.check_health()  # a dead worker ends the loop (EngineFailed)
        handled = 0
        while self.inp.poll(0):
            try:
                msg = self._decoder.decode(self.inp.recv())
            except msgspec.DecodeError as e:
                logger.error("dropping an undecodable message: %s", e)
                continue
            if isinstance(msg, Shutdown):
                return None
            self._apply(msg)
            handled += 1
        return handled

    def _apply(self, msg: AddRequests | AbortRequests | UtilityCall) -> None:
        if isinstance(msg, AbortRequests):
            self.core.abort_requests(msg.request_ids, stopped=msg.stopped)
            return
        if not isinstance(msg, AddRequests):
            self._call(msg)
            return
        requests = [spec.to_request() for spec in msg.requests]
        if self._admission_control and requests and not self._admit(requests):
            return
        for request in requests:
            busy = self._compiles_busy(request)
            if busy is not None:
                self._errors.append(busy)
                continue
            error = self._add(request)
            if error is not None:
                self._errors.append(error)

    def _add(self, request: Request) -> EngineCoreOutput | None:
        """Queue ``request``; None once queued, else the output that ends it with why (the
        caller's error: a 400 over HTTP, or a 500 for an unexpected exception), leaving
        nothing of it in the scheduler. A worker's failure (``ExecutorError``) is the
        engine's, not the request's: raised, it ends the loop (``EngineFailed``)."""
        rid = request.request_id
        try:
            self.core.add_request(request)
        except ExecutorError:
            raise
        except ValueError as e:  # the API process validates what it can; the rest is here
            logger.warning("refused request %s: %s", rid, e)
            return EngineCoreOutput(rid, [], None, "abort", error=str(e),
                                    error_field=getattr(e, "field", None))
        except Exception as e:  # noqa: BLE001 - one request's failure, not the engine's
            logger.error("request %s failed in the engine core: %s", rid,
                         traceback.format_exc())
            self._forget(request)
            return EngineCoreOutput(rid, [], None, "abort", internal_error=True,
                                    error=f"the engine failed on request {rid!r}: "
                                          f"{type(e).__name__}: {e}")
        return None

    def _forget(self, request: Request) -> None:
        """Finish ``request`` (freeing its KV blocks) if the scheduler holds it: an
        exception raised after it was queued. Another request of the same id is left alone."""
        if self.core.scheduler.requests.get(request.request_id) is request:
            self.core.abort_requests([request.request_id])

    def _compiles_busy(self, request) -> EngineCoreOutput | None:
        """The refusal of a constrained request whose grammar needs a compile while
        timed-out compiles fill every compile thread (``StructuredOutputManager.
        busy_message``): the API answers it with a 429 rather than have it wait for threads
        that may run for minutes. None to queue the request."""
        structured = request.sampling_params.structured_outputs
        message = structured and self.core.structured_output.busy_message(structured)
        if message is None:
            return None
        logger.warning("refused request %s: %s", request.request_id, message)
        return EngineCoreOutput(request.request_id, [], None, "abort", error=message,
                                retry_after_s=_BUSY_RETRY_AFTER_S,
                                error_field=STRUCTURED_OUTPUTS)

    def _admit(self, requests: list) -> bool:
        """Admission control for one user request's samples: record the verdict; False when
        they are refused (nothing is queued)."""
        parent = requests[0].parent_id
        retry_after = self.core.admission_verdict(requests)
        if retry_after is None:
            self._verdicts.accepted.append(parent)
            return True
        self._verdicts.rejected.append(Rejection(
            parent, retry_after, "the server cannot meet this request's time-to-first-token "
            "target now (its predicted TTFT is longer); retry later"))
        return False

    def _call(self, msg: UtilityCall) -> None:
        """Run a call from the API process and answer it; a ValueError (or results that
        cannot be sent) is the answer, not a failure of the engine."""
        error = result = None
        try:
            if isinstance(msg, AddLoRA):
                self.core.add_lora(msg.lora_request)
            elif isinstance(msg, RemoveLoRA):
                self.core.remove_lora(msg.lora_int_id)
            elif isinstance(msg, Sleep):
                self.core.sleep(msg.level)
            elif isinstance(msg, WakeUp):
                self.core.wake_up(msg.tags)
            elif isinstance(msg, CollectiveRPC):
                result = self.core.collective_rpc(msg.method, tuple(msg.args), msg.kwargs)
            elif isinstance(msg, ResetPrefixCache):
                result = self.core.reset_prefix_cache()
        except ValueError as e:
            error = str(e)
        try:
            payload = self._encoder.encode(UtilityResult(msg.call_id, error, result))
        except (TypeError, msgspec.EncodeError) as e:
            payload = self._encoder.encode(UtilityResult(
                msg.call_id, f"{msg.method}'s results cannot be sent back: {e}"))
        self.out.send(payload)

    def _parent_alive(self) -> bool:
        return self._parent is None or self._parent.is_alive()
