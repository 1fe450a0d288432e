"""The per-request arguments of :class:`kvflow.engine.async_llm.AsyncLLM`'s ``generate`` /
``add_request`` / ``add_pooling_request``, and the replica-wide calls' arguments, checked in
the API process: a value of another type reaches the engine-core process as a message its
decoder refuses, which it drops (logging it), so the caller's stream or call would wait for
an answer that never comes."""

from __future__ import annotations

import re
from typing import Any

import msgspec

from kvflow.lora.request import LoRARequest


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_request_args(request_id: Any, priority: Any, lora_request: Any = None,
                       data_parallel_rank: Any = None) -> None:
    """Raises ValueError naming the argument, what it got and what it must be, for a
    ``request_id`` that is not a string, a ``priority`` that is not an integer (a bool
    neither), a ``lora_request`` that is not a LoRARequest or None, or a
    ``data_parallel_rank`` that is not an integer or None."""
    checks = (
        ("request_id", request_id, isinstance(request_id, str), "a string"),
        ("priority", priority, _is_int(priority), "an integer"),
        ("lora_request", lora_request, lora_request is None
         or isinstance(lora_request, LoRARequest), "a LoRARequest or None"),
        ("data_parallel_rank", data_parallel_rank, data_parallel_rank is None
         or _is_int(data_parallel_rank), "an integer or None"),
    )
    for name, value, ok, what in checks:
        if not ok:
            raise ValueError(f"{name}={value!r:.60} must be {what}, got "
                             f"{type(value).__name__}")


def check_call(name: str, msg: msgspec.Struct) -> None:
    """Raises ValueError naming ``name`` (the AsyncLLM method), the argument and what it got
    when ``msg`` (a utility call) would not decode in the engine core as its type (a
    ``sleep`` level given as a string, ``wake_up`` tags as one string, a ``collective_rpc``
    method that is not a string, ...) or cannot be encoded at all."""
    try:
        msgspec.msgpack.decode(msgspec.msgpack.encode(msg), type=type(msg))
    except (msgspec.ValidationError, msgspec.EncodeError, TypeError, OverflowError) as e:
        path = re.search(r"at `\$\.(\w+)", str(e))
        field = path.group(1) if path else None
        value = f"={getattr(msg, field)!r:.60}" if field and hasattr(msg, field) else ""
        raise ValueError(f"{name}: {field or 'an argument'}{value} is invalid: "
                         f"{str(e).split(' - at ')[0]}") from None
