"""Find per-request state left behind: every container reachable from an engine, an
``AsyncLLM`` or a server's ``app.state`` that still holds one of a set of request ids.

A container holds an id when a dict has it as a key or value, or a set, list or deque has it
as an item; an object with a ``request_id`` attribute (a ``Request``, a stream) counts as
its id. Only kvflow's own objects are looked into (their ``__dict__`` / ``__slots__``), and
the dicts, lists, sets, tuples and deques they reach; tensors, modules, functions and other
libraries' objects are not. The tests in tests/test_request_state_leaks.py run requests to
every kind of end, then assert that nothing holds their ids: the per-request containers are
found by the walk, not listed by hand, so one added later is covered too.
"""

from __future__ import annotations

import asyncio
import collections
import types
from collections.abc import Iterable
from typing import Any

import torch

_OPAQUE = (torch.Tensor, torch.nn.Module, type, types.ModuleType, types.FunctionType,
           types.MethodType, str, bytes, int, float, bool)
_SEQUENCES = (set, frozenset, list, tuple, collections.deque)


def _holds(x: Any, ids: set[str]) -> bool:
    if isinstance(x, str):
        return x in ids
    if not (type(x).__module__ or "").startswith("kvflow"):
        return False
    rid = getattr(x, "request_id", None)
    return isinstance(rid, str) and rid in ids


def holders(root: Any, ids: Iterable[str], max_depth: int = 12) -> list[tuple[str, list]]:
    """``(path, some held ids or objects)`` of each container reachable from ``root`` that
    holds one of ``ids``; ``path`` is written from ``root`` (``root.engine.core...``)."""
    wanted, seen, found = set(ids), set(), []

    def visit(obj: Any, path: str, depth: int) -> None:
        if id(obj) in seen or depth > max_depth or isinstance(obj, _OPAQUE) or obj is None:
            return
        seen.add(id(obj))
        if isinstance(obj, dict):
            items = list(obj.items())  # a snapshot: another thread may change it meanwhile
            held = [x for kv in items for x in kv if _holds(x, wanted)]
            children = [(f"{path}[{k!r}]", v) for k, v in items]
        elif isinstance(obj, _SEQUENCES):
            items = list(obj)
            held = [x for x in items if _holds(x, wanted)]
            children = [(f"{path}[{i}]", v) for i, v in enumerate(items)]
        elif (type(obj).__module__ or "").startswith("kvflow"):
            held = []
            fields = getattr(obj, "__dict__", None)
            if fields is None:
                fields = {s: getattr(obj, s, None) for s in getattr(type(obj), "__slots__", ())}
            children = [(f"{path}.{k}", v) for k, v in list(fields.items())]
        else:
            return
        if held:
            found.append((path, held[:3]))
        for child_path, child in children:
            visit(child, child_path, depth + 1)

    visit(root, "root", 0)
    return found


async def wait_until_idle(engine) -> None:
    """Wait (up to 10 s) until an ``AsyncLLM``'s core reports no request and every KV block
    free (the stats of the step after the last abort reach this process).

    Raises:
        AssertionError: if the core is not idle by then.
    """
    for _ in range(200):
        stats = engine.stats[0]
        if (stats.num_running, stats.num_waiting, stats.num_free_blocks) == \
                (0, 0, stats.num_usable_blocks):
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"the core did not go idle: {engine.stats[0]}")
