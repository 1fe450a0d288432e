"""Publishers of KV cache event batches: ZeroMQ (a PUB socket, an optional ROUTER socket for
replay) and null. The engine core hands each step's batch to ``publish``; a thread of the
ZeroMQ publisher encodes and sends it, so a step never waits on the network (only on a full
queue, ``max_queue_size`` batches). The thread is an ``ExitJoinedThread``: a process that exits
without ``shutdown`` (an ``LLM`` script's end) still sends what is queued, for up to 2 s (was:
every batch not yet sent was lost, and what the thread had sent but ZeroMQ had not yet
written too, the context never closed: a short script's subscriber got nothing).

Replay protocol (vLLM 0.32's): a DEALER client sends ``[b"", start]``, ``start`` the first
sequence number it wants (8 bytes big-endian); the ROUTER answers with one ``[b"", topic, seq,
payload]`` message per buffered batch from that number on (at most the ``buffer_steps``
latest: the live message's three frames after the empty one), then ``[b"", b"", -1 as 8
signed big-endian bytes, b""]`` as the end marker. (vLLM 0.10-0.11 sent no topic frame: ``[b"",
seq, payload]``, ``[b"", -1, b""]``.) A REQ client may ask, but takes only the first answer
unless ``ZMQ_REQ_RELAXED`` is set.
"""

from __future__ import annotations

import logging
import queue
from collections import deque

import msgspec
import zmq

from kvflow.config.kv_events import KVEventsConfig
from kvflow.core.kv_events import EventBatch
from kvflow.runtime.exit_threads import ExitJoinedThread

logger = logging.getLogger(__name__)

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
_POLL_S = 0.05  # how long the thread waits for a batch before it looks at replay requests
_SHUTDOWN_S = 2.0  # how long shutdown (and the exit) waits for queued batches to go out
_LINGER_MS = 1000  # how long closing the PUB socket waits for ZeroMQ to write what it holds


class NullEventPublisher:
    """Drops every batch (``publisher: "null"``: events recorded, nothing sent)."""

    def publish(self, batch: EventBatch) -> None:
        return

    def shutdown(self) -> None:
        return


class ZmqEventPublisher:
    """Sends batches as ``[topic, seq (8 bytes big-endian), msgpack(batch)]`` on a PUB socket
    from a thread of its own, keeping the latest ``buffer_steps`` for replay.

    Args:
        config: the endpoints and sizes.
        data_parallel_rank: this replica's rank: stamped on batches that carry none, and
            added to TCP ports (``offset_endpoint``).

    Raises:
        ValueError: if a socket cannot bind or connect (the address named).
    """

    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0) -> None:
        self._rank = data_parallel_rank
        self._topic = config.topic.encode()
        self._queue: queue.Queue[EventBatch | None] = queue.Queue(config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._replay: zmq.Socket | None = None
        self.endpoint = offset_endpoint(config.endpoint, data_parallel_rank)
        self.replay_endpoint = offset_endpoint(config.replay_endpoint, data_parallel_rank)
        try:
            _open(self._pub, self.endpoint, "endpoint")
            if self.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                _open(self._replay, self.replay_endpoint, "replay_endpoint", bind=True)
        except ValueError:
            self._close_sockets()
            raise
        self._thread = ExitJoinedThread(self._run, name="kv-event-publisher",
                                        exit_timeout_s=_SHUTDOWN_S)
        self._thread.start()
        logger.info("KV cache events: publishing on %s%s", self.endpoint,
                    f", replay on {self.replay_endpoint}" if self._replay else "")

    def publish(self, batch: EventBatch) -> None:
        """Queue a batch (blocks while ``max_queue_size`` batches wait).

        Raises:
            RuntimeError: after ``shutdown``.
        """
        if not self._thread.is_alive():
            raise RuntimeError("the KV event publisher is shut down")
        if batch.data_parallel_rank is None:
            batch.data_parallel_rank = self._rank
        self._queue.put(batch)

    def shutdown(self) -> None:
        """Send what is queued (waiting up to 2 s), stop the thread, which closes the sockets
        (idempotent)."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(_SHUTDOWN_S)
            if self._thread.is_alive():
                logger.warning("KV event publisher: %d batches unsent at shutdown",
                               self._queue.qsize())

    def _close_sockets(self, linger_ms: int = 0) -> None:
        """Close the sockets, the PUB socket's held messages written for up to
        ``linger_ms``, and the context."""
        self._pub.close(linger=linger_ms)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._ctx.term()

    # ---- the thread: the only user of the sockets once started ------------------------------
    def _run(self) -> None:
        """Send batches until ``shutdown``, or until the queue is empty once the interpreter
        exits (``ExitJoinedThread.stop``); then close the sockets."""
        try:
            self._send_batches()
        finally:
            self._close_sockets(_LINGER_MS)

    def _send_batches(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        seq = 0
        while True:
            if self._replay is not None:
                while self._replay.poll(0):
                    self._answer_replay()
            try:
                batch = self._queue.get(timeout=_POLL_S)
            except queue.Empty:
                if self._thread.stop.is_set():
                    return  # the interpreter exits: everything queued was sent
                continue
            if batch is None:
                return
            payload = encoder.encode(batch)
            try:
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            except zmq.ZMQError as e:  # keep the batch for replay; the subscriber asks
                logger.warning("KV event batch %d not sent: %s", seq, e)
            self._buffer.append((seq, payload))
            seq += 1

    def _answer_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            logger.warning("KV event replay: ignored a request of %d frames (want identity, "
                           "empty, 8-byte start sequence number)", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in self._buffer:
            if seq >= first:
                self._replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"),
                                             payload))
        self._replay.send_multipart((client, b"", b"", END_OF_REPLAY, b""))


def _open(sock: zmq.Socket, address: str, field: str, bind: bool | None = None) -> None:
    """Bind ``sock`` (an address with ``*``, ``ipc://``, ``inproc://``, or ``bind``) or
    connect it.

    Raises:
        ValueError: naming ``field`` and the address, when ZeroMQ refuses it.
    """
    if bind is None:
        bind = "*" in address or address.startswith(("ipc://", "inproc://"))
    try:
        sock.bind(address) if bind else sock.connect(address)
    except zmq.ZMQError as e:
        raise ValueError(f"kv_events_config {field}={address!r}: cannot "
                         f"{'bind' if bind else 'connect'}: {e}") from None


def offset_endpoint(endpoint: str | None, data_parallel_rank: int) -> str | None:
    """The endpoint of data-parallel replica ``data_parallel_rank``: its TCP port plus the
    rank, an ``inproc://`` or ``ipc://`` name with ``_dp{rank}`` appended (rank 0 and None
    unchanged)."""
    if endpoint is None or data_parallel_rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        host, port = endpoint.rsplit(":", 1)
        return f"{host}:{int(port) + data_parallel_rank}"
    return f"{endpoint}_dp{data_parallel_rank}"


def make_kv_event_publisher(config: KVEventsConfig, data_parallel_rank: int = 0
                            ) -> ZmqEventPublisher | NullEventPublisher:
    """The publisher ``config.publisher`` names.

    Raises:
        ValueError: if the ZeroMQ sockets cannot be opened (see ZmqEventPublisher).
    """
    if config.publisher == "zmq":
        return ZmqEventPublisher(config, data_parallel_rank)
    return NullEventPublisher()
