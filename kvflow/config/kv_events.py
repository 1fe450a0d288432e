"""KV cache events (``KVEventsConfig``, vLLM's keys): what the block pool reports to a
KV-aware router, and where the publisher sends it."""

from __future__ import annotations

import re
from dataclasses import dataclass

from kvflow.config.options import json_config_dict, unknown_fields

KV_EVENT_PUBLISHERS = ("null", "zmq")
# tcp://HOST:PORT (HOST may be * or a bracketed IPv6 address), ipc://PATH, inproc://NAME
_ENDPOINT = re.compile(r"tcp://(\*|\[[0-9a-fA-F:.]+\]|[A-Za-z0-9_.\-]+):([0-9]{1,5})"
                       r"|ipc://.+|inproc://.+")


@dataclass
class KVEventsConfig:
    """KV cache events (``--kv-events-config`` JSON / ``LLM(kv_events_config=...)``): every
    block the prefix cache indexes (``BlockStored``), drops (``BlockRemoved``) or all of them
    at once (``AllBlocksCleared``), published after each engine step as vLLM publishes them
    (``kvflow/core/kv_events.py`` has the wire format).

    Attributes:
        enable_kv_cache_events: record events at all (off: the block pool creates none).
        publisher: ``zmq`` (a ZeroMQ PUB socket) or ``null`` (events recorded and dropped);
            default: ``zmq`` when events are on, else ``null`` (as vLLM).
        endpoint: the PUB socket's address: bound when it holds ``*`` (``tcp://*:5557``) or is
            ``ipc://`` / ``inproc://``, else connected to. Data-parallel replica ``r`` adds
            ``r`` to a TCP port (``inproc://`` names get ``_dp{r}``).
        replay_endpoint: a ROUTER socket's address (bound) that answers a request for the
            batches from a sequence number on, or None (no replay).
        buffer_steps: how many of the latest batches the replay socket can send (>= 1).
        hwm: the PUB socket's high-water mark, in messages (0: unbounded).
        max_queue_size: batches waiting for the publisher thread before a step blocks (>= 1).
        topic: the first frame of every message; a subscriber filters on its prefix.

    Raises:
        ValueError: from the constructor, naming the field, for an unknown publisher, an
            endpoint that is not ``tcp://HOST:PORT`` / ``ipc://`` / ``inproc://``, or a size
            out of range.
    """

    enable_kv_cache_events: bool = False
    publisher: str | None = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.enable_kv_cache_events, bool):
            raise ValueError(  # noqa: TRY004 (bad input is a ValueError throughout kvflow)
                f"kv_events_config enable_kv_cache_events="
                f"{self.enable_kv_cache_events!r} must be true or false")
        if self.publisher is None:
            self.publisher = "zmq" if self.enable_kv_cache_events else "null"
        if self.publisher not in KV_EVENT_PUBLISHERS:
            raise ValueError(f"kv_events_config publisher={self.publisher!r} is invalid; "
                             f"choose one of {list(KV_EVENT_PUBLISHERS)}")
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if (value is not None or name == "endpoint") and not _valid_endpoint(value):
                raise ValueError(f"kv_events_config {name}={value!r} is not a ZeroMQ address: "
                                 "use tcp://*:PORT (bind), tcp://HOST:PORT (connect), "
                                 "ipc://PATH or inproc://NAME")
        for name, least in (("buffer_steps", 1), ("hwm", 0), ("max_queue_size", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"kv_events_config {name}={value!r} must be an integer "
                                 f">= {least}")
        if not isinstance(self.topic, str):
            raise ValueError(  # noqa: TRY004 (bad input is a ValueError throughout kvflow)
                f"kv_events_config topic={self.topic!r} must be a string")

    @classmethod
    def from_value(cls, value: KVEventsConfig | dict | str | None) -> KVEventsConfig | None:
        """A config from a dict, a JSON object string (the flag's form) or None (off; so is
        the JSON text ``null``).

        Raises:
            ValueError: for text that is not a JSON object, an unknown key (named), or a bad
                value (see the class).
        """
        if value is None or isinstance(value, cls):
            return value
        value = json_config_dict("kv_events_config", value, '{"enable_kv_cache_events": '
                                 'true, "endpoint": "tcp://*:5557"}')
        if value is None:
            return None
        unknown, known = unknown_fields(cls, value)
        if unknown:
            raise ValueError(f"kv_events_config has unknown key(s) {unknown}; valid: {known}")
        return cls(**value)


def _valid_endpoint(value: object) -> bool:
    if not isinstance(value, str):
        return False
    m = _ENDPOINT.fullmatch(value)
    return m is not None and (m.group(2) is None or 0 < int(m.group(2)) < 65536)
