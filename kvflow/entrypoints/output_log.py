"""vLLM's ``--enable-log-outputs``: each finished sample's generated text and finish reason
logged at INFO (its token ids at DEBUG), the text cut to ``--max-log-len`` characters, as
vLLM's ``RequestLogger.log_outputs`` writes them; streamed and whole replies alike (the
stream's deltas joined)."""

from __future__ import annotations

import logging

from kvflow.outputs import RequestOutput

logger = logging.getLogger(__name__)


class OutputLog:
    """Observer of one engine request's delta outputs (``RequestStream.observer``): joins
    each sample's text and token ids and logs them once the sample finishes.

    Args:
        request_id: the engine request's id (as the ``received request`` line names it).
        max_log_len: characters of text / token ids logged (None: all).
    """

    def __init__(self, request_id: str, max_log_len: int | None) -> None:
        self.request_id = request_id
        self.max_log_len = max_log_len
        self._texts: dict[int, list[str]] = {}
        self._ids: dict[int, list[int]] = {}

    def __call__(self, output: RequestOutput) -> None:
        for c in output.outputs:
            self._texts.setdefault(c.index, []).append(c.text)
            self._ids.setdefault(c.index, []).extend(c.token_ids)
            if c.finish_reason is not None:
                self._log(c.index, c.finish_reason)

    def _log(self, index: int, finish_reason: str) -> None:
        text = "".join(self._texts.pop(index, []))
        ids = self._ids.pop(index, [])
        if self.max_log_len is not None:
            text, ids = text[:self.max_log_len], ids[:self.max_log_len]
        name = f"{self.request_id} (choice {index})" if index else self.request_id
        logger.debug("Generated response %s details: output_token_ids: %s", name, ids)
        logger.info("Generated response %s: output: %r, finish_reason: %s", name, text,
                    finish_reason)
