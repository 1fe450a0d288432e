"""Request-body fields kvflow does not know: ignored, as vLLM ignores them, and logged once per
field name for the whole server, whichever endpoint they come to (a field kvflow declares is
honoured or rejected with a 400 naming it; see ``protocol``)."""

from __future__ import annotations

import logging

from kvflow.entrypoints.protocol import RequestBody

logger = logging.getLogger(__name__)


class UnknownFieldLog:
    """The unknown field names logged so far; one per server, shared by every endpoint."""

    def __init__(self) -> None:
        self._logged: set[str] = set()

    def note(self, req: RequestBody, endpoint: str) -> list[str]:
        """Log the names among ``req.unknown_fields`` that no request has sent before (with
        the endpoint of the first one to send them); returns those names, sorted."""
        new = sorted(set(req.unknown_fields) - self._logged)
        if new:
            self._logged.update(new)
            logger.warning("ignoring request fields kvflow does not know: %s (first sent to "
                           "%s; each name is logged once)", ", ".join(new), endpoint)
        return new
