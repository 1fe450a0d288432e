"""Multiprocess executor: one worker process per rank on this machine.

```
engine process                                     worker process r (kvflow.executor.mp_worker)
  MultiprocExecutor                                  WorkerProc -> Worker -> ModelRunner
    XPUB  ipc://<dir>/broadcast  --- step/rpc/stop --->  SUB   (every rank, in order)
    PULL  ipc://<dir>/results    <-- ready/step/rpc/error --  PUSH  (step: driver rank only)
    PULL  ipc://<dir>/heartbeat  <------ every second ------  PUSH  (a thread of every rank)
    death pipe (write end)       ---------- EOF when the engine process is gone -->  exit
  torch.distributed between the workers: file:// rendezvous in <dir> (no port), gloo | nccl
```
A step's ``SchedulerOutput`` is msgspec-encoded once and published once; every rank receives
it, and only the driver rank (TP rank 0 of the last pipeline stage) sends the sampled tokens
back. Steps may be pipelined: up to ``pipeline_parallel_size`` are published before the first
result is read, and results come back in order. A draft model's step with constrained requests
is split in two messages (``Executor.splits_draft_steps``): ``propose`` (every rank launches
the step; the driver sends back the drafts its draft model proposed), then, once the engine
core filled the grammar rows after those drafts, ``verify`` (every rank samples; the driver
sends back the tokens).

Failure: while waiting for a reply the executor polls every worker's exit status; a worker
that died (or reported an exception) makes it kill the others, remove its directory and raise
:class:`~kvflow.executor.base.ExecutorError` naming the rank, within about a second. A worker
that is alive but sends no heartbeat for ``worker_heartbeat_timeout`` seconds (stopped,
frozen) fails the engine the same way (:mod:`kvflow.executor.heartbeat`). Workers exit by
themselves when the engine process dies (their death pipe reaches EOF).
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, NoReturn

import zmq

from kvflow.config import EngineConfig
from kvflow.executor.base import Executor, StepFuture
from kvflow.executor.heartbeat import (
    HEARTBEAT_INTERVAL_S,
    HeartbeatMonitor,
    describe_silence,
    drain_beats,
    process_state,
)
from kvflow.executor.mp_worker import WorkerArgs
from kvflow.executor.step_codec import StepCodec
from kvflow.executor.worker_procs import describe_exit, release_all, wait_or_kill
from kvflow.sched_output import DraftGrammar, GrammarBitmask, SchedulerOutput

logger = logging.getLogger(__name__)

_POLL_MS = 100  # how often a wait checks that every worker is alive


class MultiprocExecutor(Executor):
    """One worker process per rank (``--distributed-executor-backend mp``).

    Raises:
        ExecutorError: from the constructor if a worker fails to start (the message names the
            rank and its error), and from any later call if a worker fails.
    """

    splits_draft_steps = True

    def __init__(self, config: EngineConfig, source: Any, hf_config: Any, dtype: Any,
                 start_timeout_s: float = 1800.0) -> None:
        super().__init__(config, source, hf_config, dtype)
        self.world_size = config.parallel_config.world_size
        self.max_concurrent_batches = config.parallel_config.pipeline_parallel_size
        self.codec = StepCodec()
        self._heartbeat_timeout_s = config.parallel_config.worker_heartbeat_timeout
        self._procs: list[subprocess.Popen] = []
        self._sent = self._received = 0  # steps published / step results read
        self._results: dict[int, Any] = {}
        self._split = SplitStep()  # the split step in progress (launch_forward ... collect)
        self._heartbeats: HeartbeatMonitor | None = None  # set once every worker is ready
        try:
            self._init_ipc()
            self._start_workers()
            self._wait_started(start_timeout_s)
        except BaseException:
            self.shutdown()
            raise

    # ---- start-up ----------------------------------------------------------------------------
    def _init_ipc(self) -> None:
        self._dir = tempfile.mkdtemp(prefix="kvflow-mp-")
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.XPUB)
        self._pub.setsockopt(zmq.SNDHWM, 0)
        self._pub.setsockopt(zmq.XPUB_VERBOSE, 1)  # one subscription message per worker
        self._pub.bind(f"ipc://{os.path.join(self._dir, 'broadcast')}")
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.RCVHWM, 0)
        self._pull.bind(f"ipc://{os.path.join(self._dir, 'results')}")
        self._beats = self._ctx.socket(zmq.PULL)
        self._beats.bind(f"ipc://{os.path.join(self._dir, 'heartbeat')}")

    def _start_workers(self) -> None:
        args = WorkerArgs(self.config, self.source, self.hf_config, self.dtype,
                          f"file://{os.path.join(self._dir, 'dist_store')}",
                          f"ipc://{os.path.join(self._dir, 'broadcast')}",
                          f"ipc://{os.path.join(self._dir, 'results')}",
                          logging.getLogger("kvflow").getEffectiveLevel(),
                          f"ipc://{os.path.join(self._dir, 'heartbeat')}",
                          min(HEARTBEAT_INTERVAL_S, self._heartbeat_timeout_s / 4))
        args_path = os.path.join(self._dir, "worker_args.pkl")
        with open(args_path, "wb") as f:
            pickle.dump(args, f)
        read_fd, self._death_fd = os.pipe()
        try:
            for rank in range(self.world_size):
                self._procs.append(subprocess.Popen(
                    [sys.executable, "-m", "kvflow.executor.mp_worker", args_path, str(rank),
                     str(read_fd)], pass_fds=(read_fd,)))
        finally:
            os.close(read_fd)
        self._register_finalizer()
        logger.info("started %d worker processes (pids %s)", self.world_size,
                    [p.pid for p in self._procs])

    def _register_finalizer(self) -> None:
        """Release the sockets, workers and directory also when the executor is garbage
        collected without ``shutdown()`` (an ``LLM`` dropped) or at interpreter exit. The
        sockets are closed without lingering first: zmq's ``Context.__del__`` would wait
        for them (and a reply no one read) forever."""
        self._finalizer = weakref.finalize(self, release_all, list(self._procs), self._dir,
                                           self._ctx, [self._pub, self._pull, self._beats])

    def _wait_started(self, timeout_s: float) -> None:
        """Wait until every worker subscribed to the broadcast and reported ready."""
        deadline = time.monotonic() + timeout_s
        ready, subscribed = set(), 0
        poller = zmq.Poller()
        poller.register(self._pub, zmq.POLLIN)
        poller.register(self._pull, zmq.POLLIN)
        while len(ready) < self.world_size or subscribed < self.world_size:
            if time.monotonic() > deadline:
                self._fail(f"the workers did not start within {timeout_s:.0f} s")
            events = dict(poller.poll(_POLL_MS))
            if self._pub in events:
                subscribed += self._pub.recv()[:1] == b"\x01"
            if self._pull in events:
                kind, rank, payload = self._pull.recv_multipart()
                if kind == b"error":
                    self._fail_start(int(rank), payload.decode())
                ready.add(int(rank))
            self._check_alive()
        self._heartbeats = HeartbeatMonitor(self.world_size, self._heartbeat_timeout_s,
                                            time.monotonic())

    def _fail_start(self, rank: int, message: str) -> NoReturn:
        """Worker ``rank`` reported ``message`` ("Type: text") before it was ready: a
        ValueError (the model does not fit the configuration) is raised as one, anything
        else as a failed start.

        Raises:
            WorkerConfigError: for a ValueError.
            ExecutorError: otherwise.
        """
        if message.startswith("ValueError: "):
            self._fail_config(rank, message.removeprefix("ValueError: "))
        self._fail(f"worker rank {rank} failed to start: {message}")

    # ---- calls ---------------------------------------------------------------------------------
    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        """Call ``method(*args)`` on every worker; returns their results in rank order.

        Raises:
            RuntimeError: while steps are in flight (their replies would interleave).
            ExecutorError: if a worker died or reported an error.
        """
        while self._split.dropped:  # discarded split steps' results: read, not kept
            self._read_reply()
        if self._sent != self._received:
            raise RuntimeError("collective_rpc while steps are in flight")
        self._publish(b"rpc", pickle.dumps((method, args)))
        results: dict[int, Any] = {}
        while len(results) < self.world_size:
            kind, rank, payload = self._recv()
            if kind == b"rpc":
                results[int(rank)] = pickle.loads(payload)
        return [results[r] for r in range(self.world_size)]

    def execute_model_async(self, sched: SchedulerOutput,
                            grammar_bitmask: GrammarBitmask | None = None) -> StepFuture:
        self._publish(b"step", self.codec.encode((sched, grammar_bitmask)))
        seq, self._sent = self._sent, self._sent + 1
        return StepFuture(lambda: self._step_result(seq))

    def _step_result(self, seq: int) -> Any:
        while seq not in self._results:
            self._read_reply()
        return self._results.pop(seq)

    def _read_reply(self) -> None:
        """Read one reply of a step (kept by its sequence number unless it was discarded) or
        of a split step's proposal (counted, the latest kept), or answer the driver's request
        for the grammar rows of its next drafts (``rows``, to every rank); ignore an rpc
        reply."""
        kind, _, payload = self._recv()
        if kind == b"rows?":
            propose, drafts = self.codec.decode_rows_request(payload)
            if propose == self._split.drafts_sent:  # else a step given up: nobody waits
                self._publish(b"rows", self.codec.encode(self._split.draft_grammar(drafts)))
        elif kind == b"step":
            if self._received not in self._split.dropped:
                self._results[self._received] = self.codec.decode_result(payload)
            self._split.dropped.discard(self._received)
            self._received += 1
        elif kind == b"drafts":
            self._split.drafts = self.codec.decode_drafts(payload)
            self._split.drafts_received += 1

    # ---- a split step (a draft model's constrained requests: engine_steps) ----------------------
    def launch_forward(self, sched: SchedulerOutput,
                       first_grammar: GrammarBitmask | None = None,
                       draft_grammar: DraftGrammar | None = None) -> None:
        """Every rank launches the step (``propose``); the driver asks for the grammar rows of
        later drafts (answered from ``draft_grammar`` while ``proposed_drafts`` waits), then
        sends its drafts back."""
        self._publish(b"propose", self.codec.encode((sched, first_grammar,
                                                      draft_grammar is not None)))
        self._split.launched(draft_grammar)

    def proposed_drafts(self) -> dict[str, list[int]]:
        """The driver rank's proposal for the step launched last (waits for it)."""
        while self._split.drafts_received < self._split.drafts_sent:
            self._read_reply()
        return self._split.drafts

    def launch_sampling(self, grammar_bitmask: GrammarBitmask | None = None) -> None:
        """Every rank samples and collects the launched step (``verify``)."""
        self._publish(b"verify", self.codec.encode(grammar_bitmask))
        self._split.verifying, self._sent = self._sent, self._sent + 1

    def collect_output(self) -> Any:
        """The driver rank's sampled tokens of the verified step (waits for them)."""
        seq, self._split.verifying = self._split.verifying, None
        return self._step_result(seq)

    def discard_output(self) -> None:
        """Drop the split step: the ranks drop a launched one (``discard``); a verified
        one's result is dropped when it arrives. Nothing once a worker failed."""
        if self._failed is not None:
            return
        if self._split.verifying is None:
            self._publish(b"discard", b"")
        else:
            self._split.dropped.add(self._split.verifying)
            self._split.verifying = None

    def _publish(self, kind: bytes, payload: bytes) -> None:
        self._check_failed()
        self._pub.send_multipart([kind, payload])

    def _recv(self) -> list[bytes]:
        """The next reply; polls the workers' health while waiting.

        Raises:
            WorkerConfigError: if a worker raised ValueError before the first step (the
                engine's set-up calls: KV-cache specs, memory, allocation).
            ExecutorError: if a worker died or reported another error.
        """
        self._check_failed()
        while not self._pull.poll(_POLL_MS):
            self._check_alive()
        kind, rank, payload = self._pull.recv_multipart()
        if kind == b"error":
            message = payload.decode()
            if self._sent == 0 and message.startswith("ValueError: "):  # engine set-up RPCs
                self._fail_config(int(rank), message.removeprefix("ValueError: "))
            self._fail_from_error(int(rank), message)
        return [kind, rank, payload]

    # ---- failure and shutdown ------------------------------------------------------------------
    @property
    def health_check_interval_s(self) -> float:
        """A heartbeat period: a quarter of ``worker_heartbeat_timeout``, at most 1 s."""
        return min(HEARTBEAT_INTERVAL_S, self._heartbeat_timeout_s / 4)

    def check_health(self) -> None:
        """Check that every worker is alive and none has failed.

        Raises:
            ExecutorError: if a worker died or reported an error.
        """
        self._check_failed()
        self._check_alive()

    def _fail_from_error(self, rank: int, message: str) -> None:
        """A worker raised. When a peer died, the others fail inside a collective a moment
        later ("connection closed by peer"): name the dead rank as the cause if one exits
        within a second.

        Raises:
            ExecutorError: always.
        """
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            for other, proc in enumerate(self._procs):
                code = proc.poll()
                if other != rank and code is not None and code != 1:  # 1: reported an error
                    then = message if len(message) <= 80 else message[:77] + "..."
                    self._fail(f"worker rank {other} (pid {proc.pid}) died: "
                               f"{describe_exit(code)} (then rank {rank} failed: {then})")
            time.sleep(0.05)
        self._fail(f"worker rank {rank} failed: {message}")

    def _check_alive(self) -> None:
        """Fail (ExecutorError naming the rank) if a worker exited, or, once they all
        started, sent no heartbeat for ``worker_heartbeat_timeout`` seconds."""
        for rank, proc in enumerate(self._procs):
            code = proc.poll()
            if code is not None:
                self._fail(f"worker rank {rank} (pid {proc.pid}) died: {describe_exit(code)}")
        if self._heartbeats is not None:
            self._check_heartbeats()

    def _check_heartbeats(self) -> None:
        """Record every heartbeat received, then fail on the first silent rank."""
        drain_beats(self._beats, self._heartbeats)
        silent = self._heartbeats.silent_ranks(time.monotonic())
        if silent:
            rank, age = silent[0]
            pid = self._procs[rank].pid
            self._fail(describe_silence(rank, pid, age, self._heartbeat_timeout_s,
                                        process_state(pid)))

    def shutdown(self) -> None:
        """Ask the workers to stop, kill any that do not within 5 s, release the sockets and
        the private directory (idempotent). Workers still starting (the executor's start-up
        was interrupted: Ctrl-C of ``kvflow serve`` while the model loads) read no ``stop``
        until loaded: they are killed at once."""
        if getattr(self, "_pub", None) is not None and not self._pub.closed:
            started = getattr(self, "_heartbeats", None) is not None
            if self._failed is None and started:
                with contextlib.suppress(zmq.ZMQError):
                    self._pub.send_multipart([b"stop", b""], flags=zmq.NOBLOCK)
            wait_or_kill(self._procs, 5.0 if self._failed is None and started else 0.0)
            self._pub.close(linger=0)
            self._pull.close(linger=0)
            self._beats.close(linger=0)
            self._ctx.term()
        if getattr(self, "_death_fd", None) is not None:
            os.close(self._death_fd)
            self._death_fd = None
        if getattr(self, "_finalizer", None) is not None:
            self._finalizer()
        elif getattr(self, "_dir", None):
            shutil.rmtree(self._dir, ignore_errors=True)


@dataclass
class SplitStep:
    """The executor's side of split steps: proposals sent and read (a proposal whose reply
    was not read, its step aborted, is skipped), the latest proposal, the sequence number of
    the step being verified, and those of discarded steps whose results are dropped."""

    drafts_sent: int = 0
    drafts_received: int = 0
    drafts: dict[str, list[int]] = field(default_factory=dict)
    draft_grammar: DraftGrammar | None = None  # answers the driver's ``rows?``
    verifying: int | None = None
    dropped: set[int] = field(default_factory=set)

    def launched(self, draft_grammar: DraftGrammar | None) -> None:
        self.drafts_sent += 1
        self.drafts, self.verifying, self.draft_grammar = {}, None, draft_grammar
