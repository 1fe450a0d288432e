"""OpenMP settings that must be in the environment before the OpenMP runtime loads.

libgomp (the OpenMP runtime of torch's Linux CPU wheels, shared by kvflow's native kernels)
reads ``OMP_WAIT_POLICY`` and ``GOMP_SPINCOUNT`` once, when it is loaded, which is when
``import torch`` runs. By default a thread that reaches the end of a parallel region spins for
300,000 iterations (a few hundred microseconds) before it sleeps. An engine step runs hundreds of
short parallel regions; with another process busy on the same cores, a spinning thread holds
its core while the thread everyone waits for is descheduled, and a 2-thread step took 8x longer
than a 1-thread one under load (docs/benchmarks.md). A short spin keeps back-to-back regions
fast on a quiet machine and hands the core back at once on a busy one.

:func:`set_openmp_defaults` runs when ``kvflow`` is imported (``kvflow/__init__.py``), so it
applies to every process that imports kvflow before torch: the CLI, the server's engine-core
process, and scripts that ``from kvflow import LLM`` first. A value the user set wins.
"""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping

# Spin iterations before a waiting OpenMP thread sleeps (see docs/benchmarks.md,
# "CPU threads beside a busy process").
DEFAULT_SPINCOUNT = "10000"


def set_openmp_defaults(environ: MutableMapping[str, str] | None = None,
                        modules: dict | None = None) -> bool:
    """Set ``GOMP_SPINCOUNT`` to :data:`DEFAULT_SPINCOUNT` unless ``OMP_WAIT_POLICY`` or
    ``GOMP_SPINCOUNT`` is already set. Returns True when the OpenMP runtime of this process
    will see the setting (torch not imported yet); child processes started later see it
    either way."""
    environ = os.environ if environ is None else environ
    modules = sys.modules if modules is None else modules
    if "OMP_WAIT_POLICY" not in environ and "GOMP_SPINCOUNT" not in environ:
        environ["GOMP_SPINCOUNT"] = DEFAULT_SPINCOUNT
    return "torch" not in modules
