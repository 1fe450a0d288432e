"""uvicorn's access log under vLLM's ``--disable-uvicorn-access-log`` and
``--disable-access-log-for-endpoints``: the ``uvicorn.Config`` keyword arguments, and the
filter that drops the lines of the listed paths."""

from __future__ import annotations

import copy
import logging
from typing import Any
from urllib.parse import urlsplit

from uvicorn.config import LOGGING_CONFIG


class AccessLogPathFilter(logging.Filter):
    """Drop ``uvicorn.access`` records whose request path (the query string left off) is one
    of ``excluded_paths``, matched exactly, as vLLM's filter does; every other record passes.

    uvicorn logs ``'%s - "%s %s HTTP/%s" %d'`` with (client, method, path with query, HTTP
    version, status) as the record's args.
    """

    def __init__(self, excluded_paths: list[str] | tuple[str, ...] = ()) -> None:
        super().__init__()
        self.excluded_paths = frozenset(excluded_paths)

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if record.name != "uvicorn.access" or not isinstance(args, tuple) or len(args) < 3:
            return True
        target = args[2]
        return not (isinstance(target, str) and urlsplit(target).path in self.excluded_paths)


def excluded_paths(value: str | None) -> tuple[str, ...]:
    """``--disable-access-log-for-endpoints``'s comma-separated paths (``"/health,/metrics"``),
    blanks around each and empty entries dropped, as vLLM splits them."""
    return tuple(p.strip() for p in (value or "").split(",") if p.strip())


def access_log_options(disable_access_log: bool, endpoints: str | None) -> dict[str, Any]:
    """``uvicorn.Config`` keyword arguments for the access log: ``access_log=False`` under
    ``--disable-uvicorn-access-log`` (no access line at all); with
    ``--disable-access-log-for-endpoints`` a ``log_config``, uvicorn's default one with
    :class:`AccessLogPathFilter` on its access handler; ``{}`` without either."""
    options: dict[str, Any] = {"access_log": False} if disable_access_log else {}
    paths = excluded_paths(endpoints)
    if paths:
        log_config = copy.deepcopy(LOGGING_CONFIG)
        log_config.setdefault("filters", {})["kvflow_access_paths"] = {
            "()": AccessLogPathFilter, "excluded_paths": list(paths)}
        # on the handler, not the logger: dictConfig makes new handlers each time, while a
        # logger's filters outlive it (a later server in the process would inherit them)
        log_config["handlers"]["access"]["filters"] = ["kvflow_access_paths"]
        options["log_config"] = log_config
    return options
