"""A worker process that dies mid-run: the engine names the rank, stops every other worker
within seconds (no hang, no orphan) and refuses further work with the same error. A worker
that finds the configuration does not fit the model while it starts is bad input: one line,
exit status 2."""

from __future__ import annotations

import os
import signal
import threading
import time
from types import SimpleNamespace

import msgspec
import pytest

from kvflow import LLM, SamplingParams
from kvflow.executor import ExecutorError

LONG = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)


def test_killed_worker_is_reported_and_the_rest_shut_down(tiny_model_factory):
    llm = LLM(model=tiny_model_factory("llama").path, dtype="float32", num_kv_blocks=256,
              tensor_parallel_size=2)
    executor = llm.engine.core.executor
    procs = list(executor._procs)
    victim = procs[1].pid
    killed_at: list[float] = []

    def kill() -> None:
        killed_at.append(time.monotonic())
        os.kill(victim, signal.SIGKILL)

    timer = threading.Timer(1.0, kill)  # well inside the 8 x 200-token run
    timer.start()
    try:
        with pytest.raises(ExecutorError) as err:
            llm.generate([[5, 6, 7, 8]] * 8, LONG, use_tqdm=False)
        reported_after = time.monotonic() - killed_at[0]
    finally:
        timer.cancel()
        llm.shutdown()
    assert f"worker rank 1 (pid {victim}) died: killed by signal SIGKILL" in str(err.value)
    assert reported_after < 5.0
    assert all(p.poll() is not None for p in procs)  # rank 0 was stopped and reaped too
    with pytest.raises(ExecutorError, match="worker rank 1"):  # no silent half-engine
        llm.generate([[5, 6, 7]], LONG, use_tqdm=False)
    assert not os.path.exists(executor._dir)


def test_a_worker_start_up_value_error_is_one_cli_line_exit_2(tiny_llama, capfd):
    """A configuration the model does not fit, found only while the workers build their part
    (int4 groups of 64 columns, but TP=2 leaves o_proj 32 input columns per rank): ``kvflow
    generate`` exits 2 with one line naming what and why, as one process does with a
    ValueError; no worker traceback on stderr (was: every rank's traceback, then the
    engine's, exit 1)."""
    from kvflow.entrypoints.cli import main

    rc = main(["generate", "--model", tiny_llama.path, "--prompt", "hi", "--max-tokens", "2",
               "--dtype", "float32", "--tensor-parallel-size", "2", "--quantization", "int4",
               "--quantization-group-size", "64"])
    # warnings (KVFLOW_NATIVE_CPU=0: each rank's "attention backend 'cpu' unavailable") aside
    err = [line for line in capfd.readouterr().err.splitlines()
           if line.strip() and not line.startswith("WARNING ")]
    assert rc == 2 and len(err) == 1, err
    assert "--quantization-group-size=64 does not divide the 32 input columns each of " \
           "--tensor-parallel-size=2 ranks" in err[0]


class _OneReply:
    """A results socket holding one reply."""

    def __init__(self, *frames: bytes) -> None:
        self.frames = list(frames)

    def poll(self, timeout_ms: int) -> int:
        return 1

    def recv_multipart(self) -> list[bytes]:
        return self.frames


@pytest.mark.parametrize("steps_sent, is_value_error", [(0, True), (3, False)])
def test_a_value_error_during_engine_set_up_is_bad_input(monkeypatch, steps_sent,
                                                         is_value_error):
    """A worker's ValueError in the engine's set-up calls (before any step: e.g. a quantized
    KV cache for an MLA model, found when the KV cache is laid out) is raised as a ValueError
    naming the rank (was ExecutorError: a traceback and exit 1 from ``kvflow``); once steps
    run, a worker's error is an engine failure as before. No process: the executor's reply
    socket is replaced."""
    from kvflow.executor import WorkerConfigError
    from kvflow.executor.multiproc import MultiprocExecutor

    executor = MultiprocExecutor.__new__(MultiprocExecutor)
    executor._failed, executor._procs, executor._sent = None, [], steps_sent
    executor._pull = _OneReply(b"error", b"1", b"ValueError: kv_cache_dtype='int8' is not "
                                               b"supported for MLA")
    monkeypatch.setattr(executor, "shutdown", lambda: None)
    with pytest.raises(ExecutorError, match="kv_cache_dtype='int8' is not supported for MLA"
                       ) as err:
        executor._recv()
    assert isinstance(err.value, ValueError) is is_value_error
    assert isinstance(err.value, WorkerConfigError) is is_value_error
    assert ("worker rank 1, at engine start-up" in str(err.value)) is is_value_error


class _RayTaskError(Exception):
    """Ray's wrapper of an actor method's exception (the original is ``cause``)."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(f"ray::RayWorkerWrapper.init_worker() (pid=1)\n  Traceback: {cause}")
        self.cause = cause


class _RayActorError(Exception):
    """Ray's error for a call whose actor died (its process killed)."""


class _FakeRay:
    """``ray.wait`` / ``ray.get`` over refs that are the values (or errors) themselves."""

    exceptions = SimpleNamespace(RayActorError=_RayActorError)

    def wait(self, refs: list, num_returns: int, timeout: float) -> tuple[list, list]:
        return refs[:num_returns], refs[num_returns:]

    def get(self, ref: object) -> object:
        if isinstance(ref, BaseException):
            raise ref
        return ref


@pytest.mark.parametrize("steps_sent, is_value_error", [(0, True), (2, False)])
def test_ray_worker_value_error_at_start_up_is_bad_input(monkeypatch, steps_sent,
                                                         is_value_error):
    """Under ``--distributed-executor-backend ray`` a worker's ValueError while it builds its
    part of the model (or in the engine's set-up calls) is raised as WorkerConfigError naming
    the rank, so ``kvflow`` prints one line and exits 2 as with ``mp`` (was ExecutorError
    carrying Ray's task-error text: a traceback and exit 1); after the first step a worker's
    error is an engine failure. No Ray: its ``wait``/``get`` are faked."""
    from kvflow.executor import WorkerConfigError
    from kvflow.executor.ray import RayExecutor

    executor = RayExecutor.__new__(RayExecutor)
    executor._heartbeats = None  # no actor started: no heartbeat to judge
    executor._failed, executor.ray, executor._sent = None, _FakeRay(), steps_sent
    monkeypatch.setattr(executor, "shutdown", lambda: None)
    bad = ValueError("quantization_group_size=64 does not divide the 32 input columns")
    with pytest.raises(ExecutorError, match="does not divide the 32 input columns") as err:
        executor._wait([None, _RayTaskError(bad)], starting=steps_sent == 0)
    assert isinstance(err.value, WorkerConfigError) is is_value_error
    assert ("worker rank 1, at engine start-up" in str(err.value)) is is_value_error
    if is_value_error:
        assert str(err.value).startswith("quantization_group_size=64")  # no Ray task text


def test_ray_killed_actor_is_named_not_the_peer_its_death_broke(monkeypatch):
    """A killed Ray actor (rank 1) breaks its peers' collective at once: rank 0's call fails
    with gloo's connection error before Ray reports rank 1's death. The error names rank 1,
    the cause, with rank 0's failure after it (was: "worker rank 0 failed: RuntimeError:
    ... Connection reset by peer"). A rank's own error with no dead peer still names it.
    No Ray: its ``wait``/``get`` are faked (the real kill: test_slow_ray_and_real_models)."""
    from kvflow.executor.ray import RayExecutor

    executor = RayExecutor.__new__(RayExecutor)
    executor._heartbeats = None  # no actor started: no heartbeat to judge
    executor._failed, executor.ray, executor._sent = None, _FakeRay(), 3
    monkeypatch.setattr(executor, "shutdown", lambda: None)
    reset = _RayTaskError(RuntimeError("[gloo/pair.cc:537] Read error: Connection reset by peer"))
    died = _RayActorError("The actor died unexpectedly before finishing this task.")
    with pytest.raises(ExecutorError) as err:
        executor._wait([reset, died, None])
    assert str(err.value).startswith(
        "worker rank 1 failed: _RayActorError: The actor died unexpectedly before finishing "
        "this task. (then rank 0 failed: RuntimeError: [gloo/pair.cc:537] Read error: "
        "Connection reset by peer)")

    executor._failed = None
    own = _RayTaskError(RuntimeError("batched processor raised"))
    with pytest.raises(ExecutorError, match=r"^worker rank 1 failed: RuntimeError: batched "
                                            r"processor raised; the engine's workers"):
        executor._wait(["rank 0 result", own, "rank 2 result"])


class _Actor:
    """A Ray actor handle whose ``getpid.remote()`` ref is ``answer`` (an error: raised)."""

    def __init__(self, answer: object) -> None:
        self.getpid = SimpleNamespace(remote=lambda: answer)


def test_ray_idle_engine_finds_a_killed_actor(monkeypatch):
    """An idle engine calls ``check_health`` every second: the Ray executor pings every
    actor and, at the next call, fails naming the rank whose ping raised (its actor died),
    without waiting (was: not checked at all, so a killed actor of an idle engine went
    unnoticed until the next request failed on it). No Ray: refs are faked."""
    from kvflow.executor.ray import RayExecutor

    executor = RayExecutor.__new__(RayExecutor)
    executor._heartbeats = None  # no actor started: no heartbeat to judge
    executor._failed, executor.ray, executor._pings = None, _FakeRay(), {}
    monkeypatch.setattr(executor, "shutdown", lambda: None)
    executor.actors = [_Actor(101), _Actor(102)]
    executor.check_health()
    assert sorted(executor._pings.values()) == [0, 1]  # pinged, not waited for
    executor.check_health()  # both answered: pinged again
    executor.actors[1] = _Actor(_RayActorError("The actor died unexpectedly before finishing "
                                               "this task."))
    executor.check_health()  # the answers to the last pings; rank 1's next ping will fail
    with pytest.raises(ExecutorError, match=r"^worker rank 1 failed: _RayActorError: The actor "
                                            r"died unexpectedly before finishing this task\."):
        executor.check_health()
    with pytest.raises(ExecutorError, match="worker rank 1 failed"):  # and from then on
        executor.check_health()


class _Proc:
    """A worker process that is running (``poll`` is None)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def poll(self) -> None:
        return None


class _Beats:
    """A heartbeat socket holding some messages."""

    def __init__(self, messages: list[bytes]) -> None:
        self.messages = messages

    def recv(self, flags: int = 0) -> bytes:
        import zmq

        if not self.messages:
            raise zmq.Again()
        return self.messages.pop(0)


def _first_failure(executor, check, clock: list[float], stray: list[bytes] = ()
                   ) -> tuple[int | None, str]:
    """Step the faked ``clock`` through t = 1..11 s: at each, ``executor``'s heartbeat socket
    holds ``stray`` messages, rank 0's beat of t - 0.5 and rank 1's until t = 2; returns the
    first t at which ``check()`` raised ExecutorError and its message (None, "" if none)."""
    from kvflow.executor.heartbeat import encode_beat

    for t in range(1, 12):
        clock[0] = float(t)
        executor._beats = _Beats([*stray, encode_beat(0, t - 0.5)] +
                                 ([encode_beat(1, t - 0.5)] if t <= 2 else []))
        try:
            check()
        except ExecutorError as e:
            return t, str(e)
    return None, ""


def test_a_silent_worker_fails_the_engine_naming_its_rank(monkeypatch):
    """A worker that is alive but sends no heartbeat (SIGSTOP: no exit status, its peers
    wait in a collective) fails the engine after ``worker_heartbeat_timeout`` naming the rank
    and pid (was: a hang until gloo's 600 s timeout); ranks that beat do not. The clock,
    sockets and processes are faked: rank 0 beats every second, rank 1 stops after t=2."""
    from kvflow.executor import heartbeat
    from kvflow.executor.heartbeat import HeartbeatMonitor
    from kvflow.executor.multiproc import MultiprocExecutor

    executor = MultiprocExecutor.__new__(MultiprocExecutor)
    executor._failed, executor._procs = None, [_Proc(4100), _Proc(4101)]
    executor._heartbeat_timeout_s = 5.0
    executor._heartbeats = HeartbeatMonitor(2, 5.0, now=0.0)
    monkeypatch.setattr(executor, "shutdown", lambda: None)
    monkeypatch.setattr("kvflow.executor.multiproc.process_state",
                        lambda pid: "stopped (SIGSTOP or SIGTSTP)" if pid == 4101 else None)
    assert heartbeat.process_state(os.getpid()) is None  # this process runs
    clock = [0.0]
    monkeypatch.setattr("kvflow.executor.multiproc.time.monotonic", lambda: clock[0])
    failed_at, message = _first_failure(executor, executor._check_alive, clock)
    assert failed_at == 7  # last beat at 1.5 s: silent for more than 5 s at t = 7
    assert message.startswith("worker rank 1 (pid 4101) sent no heartbeat for 5.5 s "
                              "(worker_heartbeat_timeout=5): the process is stopped")


@pytest.mark.parametrize("same_node", [True, False])
def test_a_silent_ray_actor_fails_the_engine_naming_its_rank(monkeypatch, same_node):
    """A Ray actor that is alive but sends no heartbeat (SIGSTOP: Ray sees no death, its
    peers wait in a collective) fails the engine at ``check_health`` after
    ``worker_heartbeat_timeout``, naming rank and pid (was: not detected; a hang up to
    torch.distributed's 600 s). On the executor's node it is SIGKILLed and its state named;
    elsewhere ``/proc`` says nothing about it. Clock, socket and Ray faked: rank 0 beats every
    second, rank 1 stops after t=2 (the real SIGSTOP: test_slow_ray_and_real_models)."""
    from kvflow.executor.heartbeat import HeartbeatMonitor
    from kvflow.executor.ray import RayExecutor

    executor = RayExecutor.__new__(RayExecutor)
    executor._failed, executor._pings, executor.actors = None, {}, []
    executor.ray = SimpleNamespace(get_runtime_context=lambda: SimpleNamespace(
        get_node_id=lambda: "here"))
    executor._heartbeat_timeout_s = 5.0
    executor._heartbeats = HeartbeatMonitor(2, 5.0, now=0.0)
    executor._whereabouts = [("here", 4100), ("here" if same_node else "there", 4101)]
    monkeypatch.setattr(executor, "shutdown", lambda: None)
    monkeypatch.setattr("kvflow.executor.ray.process_state",
                        lambda pid: "stopped (SIGSTOP or SIGTSTP)" if pid == 4101 else None)
    killed = []
    monkeypatch.setattr("kvflow.executor.ray.os.kill", lambda pid, sig: killed.append((pid, sig)))
    clock = [0.0]
    monkeypatch.setattr("kvflow.executor.ray.time.monotonic", lambda: clock[0])
    failed_at, message = _first_failure(executor, executor.check_health, clock,
                                        stray=[b"not a beat"])  # dropped
    assert failed_at == 7  # last beat at 1.5 s: silent for more than 5 s at t = 7
    expected = "worker rank 1 (pid 4101) sent no heartbeat for 5.5 s (worker_heartbeat_timeout=5)"
    if same_node:
        assert message.startswith(f"{expected}: the process is stopped (SIGSTOP or SIGTSTP);")
        assert killed == [(4101, signal.SIGKILL)]
    else:
        assert message.startswith(f"{expected}; the engine's workers were shut down")
        assert killed == []


class _PolledBeats(_Beats):
    """A heartbeat socket that can be polled."""

    def poll(self, timeout_ms: int) -> int:
        return len(self.messages)


def test_ray_start_up_waits_for_every_actors_first_heartbeat(monkeypatch):
    """The Ray executor's start-up waits for a first heartbeat from every actor (sent before
    the wait began: still counted); one whose heartbeats never arrive (an actor on a node
    that cannot reach this one's port) fails the start-up within the timeout naming the rank
    and the address, instead of failing the running engine later as a silent rank. Socket
    faked, real clock (0.3 s timeout)."""
    from kvflow.executor.heartbeat import encode_beat
    from kvflow.executor.ray import RayExecutor

    executor = RayExecutor.__new__(RayExecutor)
    executor._failed, executor.world_size = None, 2
    executor._heartbeat_timeout_s, executor._heartbeat_addr = 0.3, "tcp://10.0.0.1:5555"
    monkeypatch.setattr(executor, "shutdown", lambda: None)
    before = time.monotonic() - 1.0
    executor._beats = _PolledBeats([encode_beat(1, before), b"stray", encode_beat(0, before)])
    executor._await_first_beats()
    assert executor._heartbeats.silent_ranks(time.monotonic()) == []

    executor._heartbeats = None
    executor._beats = _PolledBeats([encode_beat(0, before), encode_beat(7, before)])
    start = time.monotonic()
    with pytest.raises(ExecutorError, match=r"^worker rank\(s\) \[1\] started but sent no "
                                            r"heartbeat to tcp://10\.0\.0\.1:5555 within 0\.3 s"):
        executor._await_first_beats()
    assert 0.3 <= time.monotonic() - start < 2.0


def test_heartbeat_monitor_forgives_a_gap_in_its_own_checks():
    """If the engine process itself did not run for a while (it was stopped with its
    workers, or an offline engine sat idle with nobody checking), stale stamps are not
    judged: every rank counts as heard from at the first check after the gap."""
    from kvflow.executor.heartbeat import HeartbeatMonitor

    monitor = HeartbeatMonitor(2, 4.0, now=0.0)
    monitor.beat(0, 1.0)
    assert monitor.silent_ranks(1.5) == []
    assert monitor.silent_ranks(60.0) == []  # 58.5 s gap > 2 s: forgiven
    monitor.beat(0, 61.0)
    assert monitor.silent_ranks(62.0) == []
    assert monitor.silent_ranks(63.5) == []  # rank 1 silent 3.5 s < 4 s
    assert monitor.silent_ranks(65.0) == [(1, 5.0)]  # rank 1 silent since 60 s
    monitor.beat(7, 64.0)  # an unknown rank is ignored


def test_heartbeat_sender_thread_beats_and_stops(tmp_path):
    """The worker's heartbeat thread sends (rank, its monotonic clock) on its own socket and
    stops promptly; a real zmq socket, no process."""
    import zmq

    from kvflow.executor.heartbeat import HeartbeatSender, decode_beat

    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    address = f"ipc://{tmp_path}/heartbeat"
    pull.bind(address)
    sender = HeartbeatSender(3, address, interval_s=0.01)
    before = time.monotonic()
    sender.start()
    try:
        assert pull.poll(5000)
        beats = [decode_beat(pull.recv())]
        assert pull.poll(5000)
        beats.append(decode_beat(pull.recv()))
    finally:
        sender.stop()
        pull.close(linger=0)
        ctx.term()
    assert [rank for rank, _ in beats] == [3, 3]
    assert before <= beats[0][1] < beats[1][1] <= time.monotonic()
    assert not sender._thread.is_alive()


@pytest.mark.parametrize("value", [0.0, -1.0, float("nan")])
def test_worker_heartbeat_timeout_must_be_positive(value):
    from kvflow.config.parallel import ParallelConfig

    with pytest.raises(ValueError, match="worker_heartbeat_timeout=.* must be > 0"):
        ParallelConfig(worker_heartbeat_timeout=value)


def test_an_executor_dropped_without_shutdown_is_collected_without_a_hang(tmp_path):
    """``del llm`` of a multi-process engine: garbage collection releases the executor's
    sockets, workers and folder (was: ``gc.collect()`` hung forever in zmq's
    ``Context.__del__``, the workers alive, found with benchmarks/worker_faults.py llm-gc).
    No worker process: a worker's sockets in this process, with a reply left unread."""
    import gc

    import zmq

    from kvflow.executor.multiproc import MultiprocExecutor

    executor = MultiprocExecutor.__new__(MultiprocExecutor)
    executor._procs = []
    executor._init_ipc()
    executor._register_finalizer()
    folder = executor._dir
    worker_ctx = zmq.Context()
    push = worker_ctx.socket(zmq.PUSH)
    push.connect(f"ipc://{folder}/results")
    push.send_multipart([b"ready", b"0", b""])
    time.sleep(0.1)
    executor.cycle = executor  # collected by gc, as the engine's objects are
    del executor
    collect = threading.Thread(target=gc.collect, daemon=True)
    collect.start()
    collect.join(10)
    push.close(linger=0)
    worker_ctx.term()
    assert not collect.is_alive(), "gc.collect() hung"
    assert not os.path.exists(folder)


def test_the_engine_core_process_exits_at_once_after_its_loop(monkeypatch):
    """The spawned engine-core process ends with ``os._exit(0)`` once ``run_engine_core``
    has shut its workers down (was: the interpreter's teardown, 4 s with torch on 2 busy
    cores, so Ctrl-C of ``kvflow serve`` took that much longer, or past the API process's
    5 s grace the core was killed; benchmarks/worker_faults.py serve-sigint). Faked: the
    loop and ``os._exit``."""
    from kvflow.engine import core_client, core_proc

    calls: list = []
    monkeypatch.setattr(core_proc, "run_engine_core", lambda *a: calls.append(("run", a)))

    def exit_now(code: int) -> None:
        calls.append(("exit", code))
        raise SystemExit(code)

    monkeypatch.setattr(core_proc.os, "_exit", exit_now)
    with pytest.raises(SystemExit):
        core_proc.engine_core_process("config", "in", "out", 20, {})
    assert calls == [("run", ("config", "in", "out", 20, {})), ("exit", 0)]
    assert core_client.engine_core_process is core_proc.engine_core_process  # the target


def test_an_executor_stopped_while_its_workers_start_kills_them_at_once():
    """Ctrl-C of ``kvflow serve --tensor-parallel-size 2`` while the model loads: the
    executor's start-up is interrupted before any worker subscribed, so none can read
    ``stop``; they are killed at once and the folder removed (was: a 5 s wait, past which the
    API process had killed the engine core and the folder stayed;
    benchmarks/server_signals.py sigint-loading). A ``sleep`` stands in for a loading
    worker."""
    import subprocess

    from kvflow.executor.multiproc import MultiprocExecutor

    executor = MultiprocExecutor.__new__(MultiprocExecutor)
    executor._failed, executor._heartbeats = None, None  # start-up not finished
    executor._procs = [subprocess.Popen(["sleep", "30"])]
    executor._init_ipc()
    folder = executor._dir
    started = time.monotonic()
    executor.shutdown()
    assert time.monotonic() - started < 2.0
    assert executor._procs[0].poll() is not None and not os.path.exists(folder)


class _FakeCoreProcess:
    """A core process that exits when it has been sent ``Shutdown`` and then joined (it read
    it between steps) unless ``mid_step``, or when it gets SIGTERM; records the calls."""

    def __init__(self, mid_step: bool) -> None:
        self.mid_step, self.calls, self.exited = mid_step, [], False

    def is_alive(self) -> bool:
        return not self.exited

    def join(self, timeout: float) -> None:
        self.calls.append(("join", timeout))
        if self.mid_step and timeout < 1:
            time.sleep(timeout)
        self.exited = self.exited or not self.mid_step

    def terminate(self) -> None:
        self.calls.append("terminate")
        self.exited = True

    def kill(self) -> None:
        self.calls.append("kill")
        self.exited = True


@pytest.mark.parametrize(("mid_step", "hurry"), [(False, False), (True, False), (True, True)])
def test_a_core_still_in_its_step_after_the_grace_gets_sigterm(mid_step, hurry):
    """``CoreProcess.stop`` sends ``Shutdown`` and waits ``STEP_GRACE_S`` (1 s) for the core to
    read it between steps; a core still running its step then gets SIGTERM (unwinding it
    between two Python operations) instead of running on until SIGKILL 5 s later (was: a
    long prefill delayed Ctrl-C by 5 s, then the core was killed). A core that read
    ``Shutdown`` in time is not signalled; with ``hurry()`` true (a second Ctrl-C) a core in
    its step gets SIGTERM without the grace. Faked: the process; the socket is real (inproc)."""
    import zmq

    from kvflow.engine import core_client

    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.bind("inproc://core-input")  # a message sent is in pull's queue at once (no I/O thread)
    core = core_client.CoreProcess.__new__(core_client.CoreProcess)
    core.input = ctx.socket(zmq.PUSH)
    core.input.connect("inproc://core-input")
    fake = _FakeCoreProcess(mid_step)
    core.proc, core.state = fake, core_client.ReplicaState.LIVE
    started = time.monotonic()
    core.stop(b"shutdown", lambda: hurry)
    took = time.monotonic() - started
    assert pull.poll(2000) and pull.recv() == b"shutdown"
    pull.close(linger=0)
    ctx.term()
    assert core_client.STEP_GRACE_S == 1.0 and core.input.closed
    if not mid_step:
        assert fake.calls == [("join", 0.05)]
    elif hurry:
        assert fake.calls == ["terminate", ("join", 5)] and took < 0.5
    else:  # waited the grace in slices (a second Ctrl-C can cut it short), then SIGTERM
        grace, rest = fake.calls[:-2], fake.calls[-2:]
        assert set(grace) == {("join", 0.05)} and rest == ["terminate", ("join", 5)]
        assert 0.95 < took < 2.0


def test_replicas_in_long_steps_share_one_grace(tmp_path):
    """``ReplicaSet.close`` asks every core to stop at once, so they share one
    ``STEP_GRACE_S``: two data-parallel replicas both in long steps get SIGTERM after about
    1 s in all (was: 1 s each, in turn). Faked: the processes; the sockets are real."""
    import zmq

    from kvflow.engine import core_client
    from kvflow.engine.replica_set import ReplicaSet

    replicas = ReplicaSet.__new__(ReplicaSet)
    replicas.ctx, replicas.hurry, replicas.ipc_dir = zmq.Context(), False, str(tmp_path)
    replicas._started_ray = False
    replicas.encoder = msgspec.msgpack.Encoder()
    replicas.output = replicas.ctx.socket(zmq.PULL)
    pulls, fakes, replicas.cores = [], [], []
    for i in range(2):
        pulls.append(replicas.ctx.socket(zmq.PULL))
        pulls[-1].bind(f"inproc://core-{i}")
        core = core_client.CoreProcess.__new__(core_client.CoreProcess)
        core.input = replicas.ctx.socket(zmq.PUSH)
        core.input.connect(f"inproc://core-{i}")
        fakes.append(_FakeCoreProcess(mid_step=True))
        core.proc, core.state = fakes[-1], core_client.ReplicaState.LIVE
        replicas.cores.append(core)
    for pull in pulls:
        pull.close(linger=0)
    started = time.monotonic()
    replicas.close()
    took = time.monotonic() - started
    assert all(fake.calls[-2:] == ["terminate", ("join", 5)] for fake in fakes)
    assert 0.95 < took < 1.6, took


def test_a_second_ctrl_c_hurries_the_engine_cores():
    """``AbortingServer.handle_exit``: the first SIGINT starts the shutdown (the cores get
    their grace), a second (uvicorn's ``force_exit``) calls ``AsyncLLM.hurry_shutdown``, which
    sets ``ReplicaSet.hurry`` so ``close`` gives a core still in a long step SIGTERM at once;
    SIGTERM twice is not Ctrl-C twice (uvicorn forces only on SIGINT). The engine is an
    ``AsyncLLM`` without its processes (its ``replicas`` a stand-in)."""
    import types

    import uvicorn

    from kvflow.engine.async_llm import AsyncLLM
    from kvflow.entrypoints.server_shutdown import AbortingServer

    for second, hurried in ((signal.SIGINT, True), (signal.SIGTERM, False)):
        engine = AsyncLLM.__new__(AsyncLLM)
        engine.replicas = types.SimpleNamespace(hurry=False)
        server = AbortingServer(uvicorn.Config(app=None), engine)
        server.handle_exit(signal.SIGINT, None)
        assert server.should_exit and engine.replicas.hurry is False
        assert engine.replicas.stopping is True  # begin_shutdown: a core's end is expected
        server.handle_exit(second, None)
        assert engine.replicas.hurry is hurried


def test_a_loading_engine_core_is_terminated_at_once_and_unwinds(monkeypatch):
    """A core still loading reads no ``Shutdown``: ``CoreProcess.stop`` sends it SIGTERM at
    once (was: 5 s, then SIGKILL), which the core turns into SystemExit(143) so that what it
    started unwinds (a tensor-parallel executor's start-up stops its workers), then it exits
    with that status. Faked: the process and the core's loop."""
    import zmq

    from kvflow.engine import core_client, core_proc, core_process_setup

    calls: list = []

    class LoadingProcess:
        def is_alive(self) -> bool:
            return not calls

        def terminate(self) -> None:
            calls.append("terminate")

        def join(self, timeout: float) -> None:
            calls.append(("join", timeout))

    core = core_client.CoreProcess.__new__(core_client.CoreProcess)
    ctx = zmq.Context()
    core.input = ctx.socket(zmq.PUSH)
    core.proc, core.state = LoadingProcess(), core_client.ReplicaState.STARTING
    core.stop(b"shutdown")
    ctx.term()
    assert calls == ["terminate", ("join", 5)]

    with pytest.raises(SystemExit) as unwound:
        core_process_setup.unwind_on_sigterm(signal.SIGTERM, None)
    assert unwound.value.code == 128 + signal.SIGTERM

    def run(*args: object) -> None:
        raise SystemExit(143)

    def exit_now(code: int) -> None:
        calls.append(("exit", code))
        raise RuntimeError("exited")

    monkeypatch.setattr(core_proc, "run_engine_core", run)
    monkeypatch.setattr(core_proc.os, "_exit", exit_now)
    with pytest.raises(RuntimeError, match="exited"):
        core_proc.engine_core_process("config", "in", "out", 20, {})
    assert calls[-1] == ("exit", 143)
