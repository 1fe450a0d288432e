"""Keeping CPython's cyclic garbage collector off the start-up heap of kvflow's own processes.

A collection of the oldest generation walks every object the collector tracks. A process that
has loaded a model tracks hundreds of thousands of them (torch modules and parameters,
transformers' tokenizer and configs, FastAPI's routes): a full collection took 160-220 ms in
each process of ``kvflow serve`` holding SmolLM2-135M (300,000-370,000 objects; 2-core AVX512
EPYC; ``benchmarks/gc_pause.py``). CPython starts one whenever the objects promoted to the
oldest generation grow by a quarter of those already there, so a served run of 64 requests met
one in the engine-core process (one step 179 ms longer, every running request's next token
that much later; docs/benchmarks.md, session 20), and a long-running server meets another
each time that many more objects have been promoted.

``gc.freeze()`` (Python 3.7+, `gc module docs <https://docs.python.org/3/library/gc.html#gc.freeze>`_)
moves every tracked object into a permanent generation that collections skip; objects created
later are collected as before (cyclic garbage of requests and steps included), and a full
collection then walks only those. vLLM's engine core, workers and API server freeze their
start-up heap for the same reason. kvflow freezes only processes it owns (the engine-core
process, the workers of a multi-process or Ray executor, ``kvflow serve``'s API process): the
offline ``LLM`` runs in the caller's process: it freezes the caller's heap only while one of its
calls steps the engine (:func:`caller_heap_frozen`), and hands it back when the call returns.

The engine-core process freezes twice: its imports' objects first thing
(:func:`freeze_import_heap`, no full collection), then, before it reports ready, the rest
after one full collection (:func:`freeze_startup_heap`), which then walks only what loading
the model made: 3-21 ms instead of 0.24-0.82 s with SmolLM2-135M on 2 busy cores
(docs/benchmarks.md, session 49).
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager

logger = logging.getLogger(__name__)


def freeze_startup_heap(process: str, level: int = logging.INFO) -> int:
    """Collect every generation once, then freeze what is left (``gc.freeze``).

    Args:
        process: the process's name for the log line (``"engine core"``, ``"rank 1"``).
        level: the log line's level (DEBUG for an early freeze that a later one reports).

    Returns:
        The number of frozen objects (``gc.get_freeze_count()``).
    """
    start = time.perf_counter()
    gc.collect()
    collect_ms = (time.perf_counter() - start) * 1e3
    gc.freeze()
    frozen = gc.get_freeze_count()
    logger.log(level, "froze %d start-up objects of the %s process out of the garbage "
               "collector's reach (a full collection of them took %.0f ms)", frozen, process,
               collect_ms)
    return frozen


def freeze_import_heap() -> int:
    """Freeze what a process holds before it loads the model, mostly its imports' objects
    (torch, transformers, kvflow: about 300,000 of an engine core's 360,000 start-up objects
    with SmolLM2-135M), after a collection of the two young generations only (cheap: they
    hold only the objects made since the last automatic collection). The full collection of
    :func:`freeze_startup_heap`, before the process reports ready, then walks only what
    loading the model made. What the oldest generation held as garbage is frozen with the
    rest (a few dozen objects after the imports: module-level cycles); the model's own
    garbage is made later and still collected.

    Returns:
        The number of frozen objects (``gc.get_freeze_count()``).
    """
    gc.collect(1)
    gc.freeze()
    return gc.get_freeze_count()


@contextmanager
def caller_heap_frozen() -> Iterator[bool]:
    """Freeze the caller's heap while an offline call (``LLM.generate``, ``embed``, ...) steps
    the engine in the caller's process, and hand it back when the call returns or raises.

    CPython (3.8-3.13, ``Modules/gcmodule.c``) collects the oldest generation once the objects
    promoted into it since its last collection exceed a quarter of that collection's
    survivors. Loading a model promotes hundreds of thousands of objects, so the first
    ``generate`` after it met a full collection of the whole start-up heap: one 162 ms pause in
    the first CPU-W1 run on the 2-core Zen 4 EPYC, none in later runs (docs/benchmarks.md,
    session 38). Frozen (``gc.freeze``: every tracked object moves to the permanent
    generation, O(1)), a collection during the call walks only the objects made since it
    began; ``gc.unfreeze`` (O(1)) puts the others back in the oldest generation, so the
    caller's garbage is collected as before, after the call. Objects made during the call
    are collected as usual. A caller that froze objects itself (``gc.get_freeze_count() >
    0``) is left alone: unfreezing would hand its objects back too.

    Yields:
        Whether this call froze the heap.
    """
    if gc.get_freeze_count():
        yield False
        return
    gc.freeze()
    try:
        yield True
    finally:
        gc.unfreeze()


def unfreeze_heap() -> None:
    """Hand the frozen objects back to the collector (``gc.unfreeze``), for a loop that froze
    the heap of a process that lives on (a test's, or ``kvflow serve`` called in-process)."""
    gc.unfreeze()
