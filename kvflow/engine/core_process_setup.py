"""Setting up the engine core's process (kvflow/engine/core_proc.py runs in it): its
environment, signal handlers, name and logging; the start gate it waits at and the config
imports it makes meanwhile; and what it leaves behind when its API process is gone."""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import logging
import multiprocessing
import os
import shutil
import signal
from typing import Any, NoReturn

import zmq

from kvflow.config import EngineConfig
from kvflow.engine.forkserver_start import ParentState

_PR_SET_NAME = 15  # prctl option (linux/prctl.h)


def set_up_core_process(config: EngineConfig, log_level: int, env: dict[str, str] | None,
                    parent: ParentState | None) -> str:
    """The core process's environment (the forkserver's child takes its API process's first),
    signal handlers, name and logging; returns its log tag ("core" or "core <replica>")."""
    if parent is not None:
        parent.apply()
    os.environ.update(env or {})
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the API process, which stops us
    signal.signal(signal.SIGTERM, unwind_on_sigterm)
    dp = config.parallel_config
    tag = "core" if dp.data_parallel_size == 1 else f"core {dp.data_parallel_rank}"
    own = multiprocessing.parent_process() is not None  # a core process, not a test's call
    if own:
        name_process(f"kvflow-{tag.replace(' ', '-')}")  # what ps -o comm / top show
    # force: a forked core has the API process's root handlers (kvflow/engine/start_method.py)
    logging.basicConfig(level=log_level, format=f"%(levelname)s %(name)s [{tag}]: %(message)s",
                        force=own)
    return tag


def name_process(name: str) -> None:
    """Set this process's name as the kernel shows it (``/proc/<pid>/comm``: ``ps -o comm``,
    ``top``; at most 15 bytes kept), as vLLM names its ``EngineCore`` process: a forked core's
    command line is the API process's. Linux's ``prctl(PR_SET_NAME)``; elsewhere a no-op."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)


# transformers 5.x: most of AutoConfig's imports (-> torch.distributed.tensor), then AutoConfig
# and transformers.models' lazy index: 1.9-4.2 s on 2 busy cores, before a config is read
CONFIG_IMPORTS = ("transformers.activations", "transformers.models.auto.configuration_auto")


def import_config_modules() -> None:
    """Import :data:`CONFIG_IMPORTS` (what reading a model's config.json needs), those that
    exist. A gated core does it while it waits for the go (it spent them after it, on the way
    to ready); ``ReplicaSet.start`` before it forks cores, which then inherit them, since the
    API process's config check needs them next (was: both processes imported them at once, on
    the same cores)."""
    for name in CONFIG_IMPORTS:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)


def wait_for_go(go: str, inp: zmq.Socket, poll_ms: int = 20) -> bool:
    """Wait until the file ``go`` exists (True), or until the API process sends
    ``Shutdown`` on ``inp`` or exits (False: its config check failed, or it is gone; nothing
    was loaded). Polls every ``poll_ms`` milliseconds."""
    parent = multiprocessing.parent_process()
    if not os.path.exists(go):  # meanwhile, the imports its config load will need
        import_config_modules()
    while not os.path.exists(go):
        if inp.poll(poll_ms) or (parent is not None and not parent.is_alive()):
            return False  # only Shutdown is ever sent to a core before it is ready
    return True


def remove_folder_of_a_gone_parent(output_addr: str) -> None:
    """Where the API process is gone (killed: an ``LLM`` script with data-parallel replicas
    ended by SIGTERM or SIGKILL), remove its private IPC folder, the one holding
    ``output_addr`` (``ipc://<folder>/output``): it cannot any more, and the folder with its
    sockets was left in the temporary directory. Where it is alive, it removes the folder
    itself (``ReplicaSet.close``); every replica of a gone one tries (no error if another
    did)."""
    parent = multiprocessing.parent_process()
    if parent is None or parent.is_alive() or not output_addr.startswith("ipc://"):
        return
    shutil.rmtree(os.path.dirname(output_addr.removeprefix("ipc://")), ignore_errors=True)


def unwind_on_sigterm(signum: int, frame: Any) -> NoReturn:
    """SIGTERM (the API process stops a core that is still loading the model: it reads no
    ``Shutdown`` until loaded): raise SystemExit so that what was started unwinds (a
    tensor-parallel executor's start-up stops its workers and removes its folder) and the
    process exits with 128 + SIGTERM."""
    raise SystemExit(128 + signum)
