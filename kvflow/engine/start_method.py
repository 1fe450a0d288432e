"""How the API process starts its engine-core processes: ``fork`` or ``spawn``.

A spawned core is a new interpreter: it imports torch, transformers and the engine again,
2.5-3 s of CPU on the 2-core EPYC (docs/benchmarks.md, session 41), while the API process has
imported all of that already. A forked core starts with the API process's modules in memory
(copy-on-write), so ``kvflow serve`` takes less CPU to start and a loaded machine starts it
sooner. Forking is only safe before the API process has computed anything: GNU OpenMP (torch's
runtime on Linux) leaves a child forked after a parallel region hanging at its next one, and a
forked CUDA context cannot be used. vLLM forks by default
(``VLLM_WORKER_MULTIPROC_METHOD``, falling back to spawn once CUDA is initialised); kvflow forks
where it knows the process is fresh and spawns otherwise:

* ``kvflow serve`` and ``kvflow run-batch`` run as their own process fork their cores at the
  first start (they have imported modules and read the model's config, nothing more);
* a core restarted after a failure (``--engine-failure restart``) is spawned: the API process
  has been serving by then (threads, tokenizer pools, perhaps torch work for images);
* ``AsyncLLM`` or ``kvflow serve`` called inside a longer-lived process (a test, a notebook),
  and the offline ``LLM``'s data-parallel replicas, spawn.

``KVFLOW_WORKER_MULTIPROC_METHOD`` (vLLM's name) overrides: ``spawn`` always spawns, ``fork``
forks every first start (the caller vouches that its process ran no OpenMP or CUDA work),
``auto`` (the default) is the rule above. Tensor-parallel worker processes are new
interpreters either way (``kvflow/executor/multiproc.py``).
"""

from __future__ import annotations

import os
import sys
import threading

from kvflow.config.device import flag_or_env_choice

START_METHOD_VARIABLE = "KVFLOW_WORKER_MULTIPROC_METHOD"
START_METHOD_CHOICES = ("auto", "fork", "spawn")


def core_start_method(fresh_process: bool) -> str:
    """``"fork"`` or ``"spawn"``: how to start engine-core processes from this process (read
    again by :func:`method_now` when they start).

    Args:
        fresh_process: the caller vouches that this process has run no torch computation
            (``kvflow serve`` / ``run-batch`` as their own process, before their cores start).

    Raises:
        ValueError: when ``KVFLOW_WORKER_MULTIPROC_METHOD`` is set to something other than
            auto, fork or spawn (naming the variable and the choices).
    """
    choice = flag_or_env_choice(os.environ.get(START_METHOD_VARIABLE) or "auto",  # empty: auto
                                START_METHOD_VARIABLE, START_METHOD_VARIABLE, "auto",
                                START_METHOD_CHOICES)
    if choice == "spawn" or not sys.platform.startswith("linux"):
        return "spawn"
    return "fork" if choice == "fork" or fresh_process else "spawn"


def method_now(method: str) -> str:
    """``method``, or ``"spawn"`` where this process can no longer fork safely: it has
    initialised CUDA (a forked child could not use it), started Ray (its threads) or started
    Python threads (a Hugging Face download's progress monitor, say: a lock one of them holds
    at the fork stays held in the child). Neither torch nor ray is imported for the check."""
    if method != "fork":
        return method
    torch, ray = sys.modules.get("torch"), sys.modules.get("ray")
    unsafe = (torch is not None and torch.cuda.is_initialized()) \
        or (ray is not None and ray.is_initialized()) or threading.active_count() > 1
    return "spawn" if unsafe else "fork"


__all__ = ["START_METHOD_CHOICES", "START_METHOD_VARIABLE", "core_start_method", "method_now"]
