"""One engine-core replica seen from the API process: its process and its input socket.

A ``ReplicaSet`` (``engine/replica_set.py``, used by ``AsyncLLM`` and ``DPCoreClient``) runs
one ``CoreProcess`` per data-parallel replica (one without data parallelism). Each has a PUSH
socket of its own, bound in the API process's private IPC directory (``input-<index>``);
every replica's core pushes to the one output socket that the ``ReplicaSet`` binds, tagging
its messages with its index.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import logging
import multiprocessing
import os
import sys
import time
from collections.abc import Callable

import msgspec
import zmq

from kvflow.config import EngineConfig
from kvflow.config.parallel import DEFAULT_ENGINE_HEARTBEAT_TIMEOUT
from kvflow.engine.core_heartbeat import StartupLiveness, declare_dead
from kvflow.engine.core_proc import engine_core_process
from kvflow.engine.forkserver_start import PRELOAD, ParentState, current_environment
from kvflow.engine.messages import EngineFailed, EngineHeartbeat, EngineReady

logger = logging.getLogger(__name__)

STEP_GRACE_S = 1.0  # how long ``CoreProcess.stop`` lets a core finish its step and read Shutdown


class ReplicaState(enum.Enum):
    STARTING = "starting"  # process started, model loading (no EngineReady yet)
    LIVE = "live"  # takes requests
    DEAD = "dead"  # exited or failed; its requests were failed


def replica_config(config: EngineConfig, index: int) -> EngineConfig:
    """``config`` for data-parallel replica ``index`` (its ``data_parallel_rank``)."""
    parallel = dataclasses.replace(config.parallel_config, data_parallel_rank=index)
    return dataclasses.replace(config, parallel_config=parallel)


def core_process_env(config: EngineConfig) -> dict[str, str]:
    """Environment variables an engine-core process needs beyond the ones it inherits: with
    ``--distributed-executor-backend ray``, ``RAY_ADDRESS`` of the Ray cluster this process
    is connected to (``ray.init`` ran here and ``RAY_ADDRESS`` is unset), so that every
    data-parallel replica places its workers in that cluster instead of starting a local
    one of its own."""
    ray = sys.modules.get("ray")  # never imported here for this check
    if config.parallel_config.executor_backend != "ray" or os.environ.get("RAY_ADDRESS") \
            or ray is None or not ray.is_initialized():
        return {}
    return {"RAY_ADDRESS": ray.get_runtime_context().gcs_address}


def start_ray_for_replicas(config: EngineConfig) -> bool:
    """Start a local Ray cluster in this process for data-parallel replicas under
    ``--distributed-executor-backend ray`` when none is named (``RAY_ADDRESS`` unset) nor
    connected (``ray.init`` not run here), so that :func:`core_process_env` hands its address
    to every replica and they share it. (Was: each replica's executor started a local cluster
    of its own; each cluster counts every GPU of the machine as its own and Ray gives each
    replica's first rank GPU 0, so on GPUs the replicas shared device 0.) Returns whether it
    started one (the caller stops it: :func:`stop_ray`).

    Raises:
        ValueError: if Ray is not installed, or the local cluster cannot hold every
            replica's workers (one CPU or GPU each; it is stopped again).
    """
    pc = config.parallel_config
    if pc.executor_backend != "ray" or pc.data_parallel_size == 1 \
            or os.environ.get("RAY_ADDRESS"):
        return False
    from kvflow.executor.ray_cluster import check_cluster_fits, import_ray, worker_bundle

    ray = import_ray()
    if ray.is_initialized():
        return False
    ray.init(log_to_driver=True)
    try:  # every replica's workers, in this local cluster
        check_cluster_fits(ray, worker_bundle(ray, config),
                           pc.data_parallel_size * pc.world_size, local=True, timeout_s=0)
    except ValueError:
        ray.shutdown()
        raise
    logger.info("started a local Ray cluster for the %d data-parallel replicas (%s)",
                pc.data_parallel_size, ray.get_runtime_context().gcs_address)
    return True


def stop_ray() -> None:
    """Stop the Ray cluster :func:`start_ray_for_replicas` started (its replicas stopped)."""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()


class CoreProcess:
    """A data-parallel replica: an engine-core process fed through a PUSH socket.

    Args:
        ctx: the API process's ZMQ context.
        ipc_dir: the private directory holding the sockets.
        config: the engine config; ``parallel_config.data_parallel_rank`` is the replica.
        output_addr: the output socket every replica's core pushes to.
        generation: how many times this replica was started before (a restarted replica
            gets a fresh input socket: a PUSH socket would hand the new core whatever was
            queued for the dead one).
    """

    def __init__(self, ctx: zmq.Context, ipc_dir: str, config: EngineConfig,
                 output_addr: str, generation: int = 0) -> None:
        self.config, self.output_addr, self.generation = config, output_addr, generation
        self.index = config.parallel_config.data_parallel_rank
        name = f"input-{self.index}-{generation}"
        self.input_addr = f"ipc://{os.path.join(ipc_dir, name)}"
        self.input = ctx.socket(zmq.PUSH)
        self.input.setsockopt(zmq.SNDHWM, 0)  # never block the event loop on a send
        self.input.bind(self.input_addr)
        self.proc: multiprocessing.process.BaseProcess | None = None
        self.method: str | None = None  # how start() started it
        self.state = ReplicaState.STARTING
        self.death: BaseException | None = None  # why it died

    def start(self, log_level: int, go: str | None = None, method: str = "spawn") -> None:
        """Start the core process (it loads the model, then reports ``EngineReady``; with
        ``go``, a file path, only once that file exists: ``run_engine_core``). ``method``:
        multiprocessing's ``"spawn"`` (a new interpreter), ``"fork"`` (only where
        ``kvflow.engine.start_method.core_start_method`` says this process may fork) or
        ``"forkserver"`` (forked from the forkserver, which imports
        ``kvflow.engine.forkserver_start.PRELOAD`` first; the core takes this process's
        environment and standard output and error with it: ``ParentState``)."""
        ctx = multiprocessing.get_context(method)
        parent = None
        if method == "forkserver":
            ctx.set_forkserver_preload(list(PRELOAD))  # read when the forkserver starts
            parent = ParentState(current_environment())
        name = "kvflow-engine-core" + ("" if self.config.parallel_config.data_parallel_size
                                       == 1 else f"-{self.index}")
        self.method = method
        self.proc = ctx.Process(target=engine_core_process, name=name, daemon=True,
                                args=(self.config, self.input_addr, self.output_addr,
                                      log_level, core_process_env(self.config), go, parent,
                                      self.generation))
        self.proc.start()
        self.state = ReplicaState.STARTING
        self.death = None
        logger.debug("engine core process %sstarted (pid %d)",
                     "" if name == "kvflow-engine-core" else f"{self.index} ", self.proc.pid)

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    @property
    def is_alive(self) -> bool:
        return self.proc is not None and self.proc.is_alive()

    @property
    def is_live(self) -> bool:
        """Takes requests: ready and its process running."""
        return self.state is ReplicaState.LIVE and self.is_alive

    def send(self, payload: bytes) -> None:
        """Queue an encoded message for the core (never blocks). A core whose process has
        ended (its socket has no peer left: ``zmq.Again``) gets nothing; its open requests and
        calls fail once the output loop finds it dead. (Was: the error reached the caller, so
        SIGTERM to the server and its core at once, as ``pkill -f "kvflow serve"`` or a
        systemd stop sends, ended the server's shutdown with a traceback and exit status 1.)"""
        try:
            self.input.send(payload, flags=zmq.NOBLOCK)
        except zmq.Again:
            logger.debug("engine core %d is gone: a message to it was dropped", self.index)

    def kill(self) -> None:
        """SIGKILL the process now, without waiting (a stopped one dies too; it is reaped by
        the next ``is_alive`` or ``stop``): a core taken for dead while it is frozen."""
        if self.proc is not None and self.proc.is_alive():
            self.proc.kill()

    def ask_to_stop(self, shutdown_payload: bytes) -> None:
        """Send ``Shutdown`` without waiting (``stop`` then waits)."""
        if self.is_alive and not self.input.closed:
            with contextlib.suppress(zmq.ZMQError):
                self.input.send(shutdown_payload, flags=zmq.NOBLOCK)

    def stop(self, shutdown_payload: bytes, hurry: Callable[[], bool] = lambda: False) -> None:
        """Ask the core to stop (``Shutdown``), close the socket (idempotent). A core reads
        ``Shutdown`` between steps: one still running a step after ``STEP_GRACE_S`` (a long
        prefill: seconds on a CPU) or once ``hurry()`` is true (a second Ctrl-C), or still
        loading the model (it reads no message until loaded: at once), gets SIGTERM, which
        unwinds it between two Python operations (``core_process_setup.unwind_on_sigterm``; its
        clean-up still runs); SIGKILL 5 s later (was: SIGKILL after 5 s, so Ctrl-C during a
        long step waited that long and left a tensor-parallel core's workers to their death
        pipe)."""
        proc = self.proc
        if proc is not None and proc.is_alive():
            if self.state is not ReplicaState.STARTING and not self.input.closed:
                with contextlib.suppress(zmq.ZMQError):
                    self.input.send(shutdown_payload, flags=zmq.NOBLOCK)
                deadline = time.monotonic() + STEP_GRACE_S
                while proc.is_alive() and time.monotonic() < deadline and not hurry():
                    proc.join(0.05)
            if proc.is_alive():
                proc.terminate()
                proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        if not self.input.closed:
            self.input.close(linger=0)


def replica_name(index: int, num_replicas: int) -> str:
    """How logs and errors call replica ``index``: "engine core" (one replica) or
    "engine core 1 of 2"."""
    return "engine core" if num_replicas == 1 else f"engine core {index} of {num_replicas}"


def main_guard_hint(core: CoreProcess) -> str:
    """The likeliest cause of a core that exited with status 1 before it reported, when it was
    spawned or forked from the forkserver by a script run by path: such a child runs the
    script's top level again (``multiprocessing``), and one without the ``__main__`` guard
    starts an engine there, which ``multiprocessing`` refuses (its message is in the child's
    stderr, above). "" otherwise."""
    main = sys.modules.get("__main__")
    script = getattr(main, "__file__", None)
    if core.proc.exitcode != 1 or core.method not in ("spawn", "forkserver") or not script \
            or getattr(main, "__spec__", None) is not None:
        return ""
    return (f" (it ran {os.path.basename(script)}'s top level again, as a spawned or "
            "forkserver process does: a script that starts engine processes needs that code "
            "under `if __name__ == \"__main__\":`; README, \"Several processes\")")


def wait_ready(output: zmq.Socket, decoder: msgspec.msgpack.Decoder, cores: list[CoreProcess],
               timeout: float,
               on_ready: Callable[[EngineReady], None] | None = None,
               heartbeat_timeout: float = DEFAULT_ENGINE_HEARTBEAT_TIMEOUT,
               ) -> dict[int, EngineReady]:
    """Block until every replica in ``cores`` reported ``EngineReady`` on ``output``; marks
    them live and returns their messages by replica index. A core silent for
    ``heartbeat_timeout`` seconds meanwhile (``core_heartbeat.StartupLiveness``: stopped, or
    frozen while it loads) is killed.

    Raises:
        ValueError: a replica's start-up found a bad model or configuration (its message).
        RuntimeError: naming the replica, if one reported another ``EngineFailed``, its
            process exited while starting, or it was silent for ``heartbeat_timeout``
            seconds (killed), or if they did not all report within ``timeout`` seconds.
    """
    deadline, ready, n = time.monotonic() + timeout, {}, len(cores)
    liveness = StartupLiveness(n, heartbeat_timeout, time.monotonic())
    def _take(msg: object) -> None:
        if isinstance(msg, EngineHeartbeat):
            liveness.beat(msg)
        failed = msg if isinstance(msg, EngineFailed) else None
        if failed is not None and failed.bad_input:
            raise ValueError(failed.message)
        if failed is not None:
            raise RuntimeError(f"{replica_name(failed.engine_index, n)} failed to start: "
                               f"{failed.message}")
        if isinstance(msg, EngineReady):
            ready[msg.engine_index] = msg
            cores[msg.engine_index].state = ReplicaState.LIVE
            if on_ready is not None:
                on_ready(msg)

    while len(ready) < n and time.monotonic() < deadline:
        if output.poll(min(200, int(1000 * liveness.timeout_s / 4))):
            _take(decoder.decode(output.recv()))
        for core in cores:
            if not core.is_alive and core.index not in ready:
                while output.poll(0):  # its last words (EngineFailed) may wait behind a beat
                    _take(decoder.decode(output.recv()))
                raise RuntimeError(f"{replica_name(core.index, n)} process exited with code "
                                   f"{core.proc.exitcode} while starting{main_guard_hint(core)}")
        starting = [core for core in cores if core.index not in ready]
        for core, silent_s in liveness.silent(starting, time.monotonic()):
            why = declare_dead(core, silent_s, replica_name(core.index, n), liveness.timeout_s,
                               starting=True)
            raise RuntimeError(f"{why}; its start-up was abandoned (a core that loads slowly "
                               "but runs is waited for up to --engine-start-timeout)")
    if len(ready) < n:
        raise RuntimeError(f"engine core did not start within {timeout:.0f} s")
    return ready
