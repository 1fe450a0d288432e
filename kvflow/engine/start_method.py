"""How the API process starts its engine-core processes: ``fork``, ``forkserver`` or ``spawn``.

A spawned core is a new interpreter: it imports torch, transformers and the engine again,
2.5-3 s of CPU on the 2-core EPYC (docs/benchmarks.md, session 41), while the API process has
imported all of that already. A forked core starts with the API process's modules in memory
(copy-on-write), so ``kvflow serve`` takes less CPU to start and a loaded machine starts it
sooner. Forking is only safe before the API process has computed anything: GNU OpenMP (torch's
runtime on Linux) leaves a child forked after a parallel region hanging at its next one, and a
forked CUDA context cannot be used. Where the process is not known to be fresh, Python's
forkserver does the same job from a process that is: started once (a new interpreter that
imports the engine's modules and computes nothing, ``kvflow/engine/forkserver_start.py``), it
forks every later core, so only the first one pays the imports. vLLM forks by default
(``VLLM_WORKER_MULTIPROC_METHOD``, falling back to spawn once CUDA is initialised); kvflow:

* ``kvflow serve`` and ``kvflow run-batch`` run as their own process fork their cores at the
  first start (they have imported modules and read the model's config, nothing more);
* ``AsyncLLM`` or ``kvflow serve`` called inside a longer-lived process (a test, a notebook),
  and the offline ``LLM``'s data-parallel replicas, start their cores from the forkserver on
  Linux (spawn elsewhere). A core is spawned instead where the forkserver cannot serve it: its
  environment at start differs from this process's now in a variable read at import (anything
  but ``KVFLOW_*`` / ``PYTEST_*``: :func:`kvflow.engine.forkserver_start.forkserver_usable`);
* a core restarted after a failure (``--engine-failure restart``) starts as the first one did
  if that was from the forkserver (still running, so a restart costs a fork), and is spawned
  if that was a fork: the API process has been serving by then (threads, tokenizer pools,
  perhaps torch work for images), and starting a forkserver for one restart would cost the
  imports that spawning costs, plus a process kept for nothing.

``KVFLOW_WORKER_MULTIPROC_METHOD`` (vLLM's name; Python's third start method added) overrides:
``spawn`` always spawns, ``fork`` forks every first start (the caller vouches that its process
ran no OpenMP or CUDA work), ``forkserver`` uses the forkserver for every start where it can
(restarts too), ``auto`` (the default) is the rule above. Tensor-parallel worker processes are
new interpreters either way (``kvflow/executor/multiproc.py``: an engine core is a daemonic
process, and daemonic processes cannot start ``multiprocessing`` children).
"""

from __future__ import annotations

import os
import sys
import threading

from kvflow.config.kernel_choices import flag_or_env_choice
from kvflow.engine.forkserver_start import forkserver_usable

START_METHOD_VARIABLE = "KVFLOW_WORKER_MULTIPROC_METHOD"
START_METHOD_CHOICES = ("auto", "fork", "forkserver", "spawn")


def core_start_method(fresh_process: bool) -> str:
    """``"fork"``, ``"forkserver"`` or ``"spawn"``: how to start engine-core processes from this
    process (read again by :func:`method_now` when they start).

    Args:
        fresh_process: the caller vouches that this process has run no torch computation
            (``kvflow serve`` / ``run-batch`` as their own process, before their cores start).

    Raises:
        ValueError: when ``KVFLOW_WORKER_MULTIPROC_METHOD`` is set to something other than
            auto, fork, forkserver or spawn (naming the variable and the choices).
    """
    choice = flag_or_env_choice(os.environ.get(START_METHOD_VARIABLE) or "auto",  # empty: auto
                                START_METHOD_VARIABLE, START_METHOD_VARIABLE, "auto",
                                START_METHOD_CHOICES)
    if choice == "spawn" or not sys.platform.startswith("linux"):
        return "spawn"
    if choice != "auto":
        return choice
    return "fork" if fresh_process else "forkserver"


def restart_method(method: str) -> str:
    """How a core restarted after a failure starts when the first ones started with
    ``method``: as they did, but a fork becomes a spawn (module docstring)."""
    return "spawn" if method == "fork" else method


def method_now(method: str) -> str:
    """``method``, or ``"spawn"`` where it cannot be used now. ``"forkserver"``: where
    :func:`~kvflow.engine.forkserver_start.forkserver_usable` says no. ``"fork"``: where this
    process has initialised CUDA (a forked child could not use it), started Ray (its threads) or
    started Python threads (a Hugging Face download's progress monitor, say: a lock one of them
    holds at the fork stays held in the child). Neither torch nor ray is imported for the
    check."""
    if method == "forkserver":
        return method if forkserver_usable() else "spawn"
    if method != "fork":
        return method
    torch, ray = sys.modules.get("torch"), sys.modules.get("ray")
    unsafe = (torch is not None and torch.cuda.is_initialized()) \
        or (ray is not None and ray.is_initialized()) or threading.active_count() > 1
    return "spawn" if unsafe else "fork"


__all__ = ["START_METHOD_CHOICES", "START_METHOD_VARIABLE", "core_start_method", "method_now",
           "restart_method"]
