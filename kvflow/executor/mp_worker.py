"""The worker process of the multiprocess executor: ``python -m kvflow.executor.mp_worker``.

One process per rank, started by :class:`kvflow.executor.multiproc.MultiprocExecutor` with
``subprocess`` (so it works under a daemonic engine-core process too). It reads its start-up
arguments from a pickle in the executor's private directory, builds its
:class:`~kvflow.worker.worker.Worker`, reports ``ready`` (or ``error``), then serves messages
from the executor's broadcast socket in order:

* ``step``: a msgspec-encoded ``(SchedulerOutput, GrammarBitmask | None)``; the driver rank
  replies with the runner's result, the others stay silent;
* ``propose``: a split step's first part (a draft model's constrained requests): the step,
  the grammar rows before draft 1 and whether to ask for later drafts' rows; the Worker
  launches it (the driver asking ``rows?`` with the drafts so far before each later draft,
  every rank reading the engine's ``rows`` answer, or ``discard``, from the broadcast) and
  the driver rank replies ``drafts`` with the proposed draft tokens;
* ``verify``: the split step's msgspec-encoded ``GrammarBitmask | None``: the Worker samples
  and collects; the driver rank replies ``step`` with the result;
* ``discard``: drop a launched split step that will not be verified (no reply);
* ``rpc``: a pickled ``(method, args)`` call on the Worker; every rank replies;
* ``stop``: leave the process groups and exit (status 0, at once: ``os._exit`` after the
  logs are flushed).

Once ready, a thread sends a heartbeat every second (:mod:`kvflow.executor.heartbeat`), so the
executor finds a worker that is alive but does not run (stopped, frozen). Any exception is
reported as ``error`` (rank and message) and ends the process. A watchdog
thread ends it too as soon as the executor's process is gone (the death pipe whose write end
the executor holds reaches EOF), even while the main thread waits inside a collective.
"""

from __future__ import annotations

import logging
import os
import pickle
import shutil
import signal
import sys
import threading
import traceback
from dataclasses import dataclass
from typing import Any

import zmq

from kvflow.config import EngineConfig
from kvflow.executor.heartbeat import HeartbeatSender
from kvflow.executor.step_codec import StepCodec
from kvflow.sched_output import GrammarBitmask
from kvflow.worker.worker import Worker

logger = logging.getLogger(__name__)


@dataclass
class WorkerArgs:
    """What every worker process needs (pickled once by the executor)."""

    config: EngineConfig
    source: Any
    hf_config: Any
    dtype: Any
    distributed_init_method: str
    broadcast_addr: str
    results_addr: str
    log_level: int
    heartbeat_addr: str
    heartbeat_interval_s: float


def _watch_parent(death_fd: int, folder: str) -> None:
    """Block until the executor's end of the death pipe closes, then remove the executor's
    private ``folder`` and exit at once. The executor removes the folder itself when it shuts
    down; a killed one cannot (an ``LLM`` script ended by SIGTERM or SIGKILL, an engine-core
    process killed), and its ``/tmp/kvflow-mp-*`` folder, with the sockets and the pickled
    worker arguments, was left behind."""
    try:
        while os.read(death_fd, 1):
            pass
    except OSError:
        pass
    shutil.rmtree(folder, ignore_errors=True)
    os._exit(1)


class StepDiscarded(Exception):
    """The engine dropped the split step whose draft was waiting for grammar rows."""


class WorkerProc:
    """The message loop of one rank."""

    def __init__(self, rank: int, args: WorkerArgs) -> None:
        self.rank = rank
        self.codec = StepCodec()
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.RCVHWM, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(args.broadcast_addr)
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.setsockopt(zmq.SNDHWM, 0)
        self.push.connect(args.results_addr)
        self.worker: Worker | None = None
        self.stepped = False  # a step message has arrived (the engine is set up)
        self.proposes = 0  # propose messages so far (a rows? request names its propose)
        self.args = args
        self.heartbeat = HeartbeatSender(rank, args.heartbeat_addr, args.heartbeat_interval_s)

    def reply(self, kind: bytes, payload: bytes = b"") -> None:
        self.push.send_multipart([kind, str(self.rank).encode(), payload])

    def run(self) -> None:
        """Start the worker, then serve messages until ``stop``; report any failure."""
        try:
            a = self.args
            self.worker = Worker(a.config, self.rank, self.rank, a.distributed_init_method,
                                 a.source, a.hf_config, a.dtype)
            self.reply(b"ready")
            self.heartbeat.start()
            while self._handle(*self.sub.recv_multipart()):
                pass
        except Exception as e:  # noqa: BLE001 - reported to the executor, which stops all
            # a ValueError before the first step (building the model, sizing or allocating
            # the KV cache) is a configuration the model does not fit: the executor raises
            # it as one line, so its traceback is only debug output here
            config_error = not self.stepped and isinstance(e, ValueError)
            logger.log(logging.DEBUG if config_error else logging.ERROR,
                       "worker rank %d failed: %s", self.rank, traceback.format_exc())
            self.reply(b"error", f"{type(e).__name__}: {e}".encode())
            self.close(linger_ms=2000)
            os._exit(1)
        self.worker.shutdown()
        self.close(linger_ms=2000)

    def _handle(self, kind: bytes, payload: bytes) -> bool:
        """Apply one message; False on ``stop``."""
        worker = self.worker
        if kind == b"rpc":
            method, args = pickle.loads(payload)
            self.reply(b"rpc", pickle.dumps(getattr(worker, method)(*args)))
        elif kind == b"step":
            self.stepped = True
            self._reply_driver(b"step", worker.execute_model(*self.codec.decode_step(payload)))
        elif kind == b"propose":
            self.stepped, self.proposes = True, self.proposes + 1
            sched, first_grammar, asks_rows = self.codec.decode_propose(payload)
            try:
                worker.launch_forward(sched, first_grammar,
                                      self._draft_rows if asks_rows else None)
                drafts = worker.proposed_drafts()
            except StepDiscarded:  # the engine gave the step up while the draft proposed
                worker.discard_output()
                drafts = {}  # still one reply per propose: the engine counts them
            self._reply_driver(b"drafts", drafts)
        elif kind == b"verify":
            worker.launch_sampling(self.codec.decode_bitmask(payload))
            self._reply_driver(b"step", worker.collect_output())
        elif kind == b"discard":
            worker.discard_output()
        return kind != b"stop"

    def _draft_rows(self, drafts: dict[str, list[int]]) -> GrammarBitmask | None:
        """``DraftGrammar`` in a worker: the driver asks the engine (``rows?``), every rank
        reads the answer (``rows``) from the broadcast.

        Raises:
            StepDiscarded: if the engine sent ``discard`` instead (it gave the step up).
        """
        if self.worker.is_driver:
            self.reply(b"rows?", self.codec.encode((self.proposes, drafts)))
        kind, payload = self.sub.recv_multipart()
        if kind == b"discard":
            raise StepDiscarded
        if kind != b"rows":
            raise RuntimeError(f"expected the grammar rows of the next drafts, got {kind!r}")
        return self.codec.decode_bitmask(payload)

    def _reply_driver(self, kind: bytes, value: Any) -> None:
        """Send ``value`` (msgspec-encoded) from the driver rank only."""
        if self.worker.is_driver:
            self.reply(kind, self.codec.encode(value))

    def close(self, linger_ms: int) -> None:
        self.heartbeat.stop()
        self.sub.close(linger=0)
        self.push.close(linger=linger_ms)
        self.ctx.term()


def main(argv: list[str]) -> None:
    """Entry point: ``mp_worker <args pickle> <rank> <death pipe fd>``."""
    args_path, rank, death_fd = argv[1], int(argv[2]), int(argv[3])
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the executor's to handle
    threading.Thread(target=_watch_parent, args=(death_fd, os.path.dirname(args_path)),
                     daemon=True, name="kvflow-parent-watch").start()
    with open(args_path, "rb") as f:
        args: WorkerArgs = pickle.load(f)
    logging.basicConfig(level=args.log_level,
                        format=f"%(levelname)s %(name)s [rank {rank}]: %(message)s")
    WorkerProc(rank, args).run()
    # stopped cleanly: skip the interpreter's teardown, as multiprocessing's children do
    # (with torch loaded it took seconds, past the executor's 5 s grace: the workers were
    # killed, and a killed engine-core process left its folder behind)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv)
