"""Per-request faults inside a batched step: what the runner records when the work of ONE
request raises (its image in the vision encoder, its LoRA adapter read again at its first
schedule, its per-request logits processor; in the engine core, its grammar matcher), so
that only that request ends with the error and the step's other requests go on.

The rule, stated once: an exception is the request's when the runner raised it while working
on that request's own data alone (one image encoded by itself, one request's adapter, one
row's processor). A ValueError is the request's bad input (a 400); another exception is
reported as the engine's failure on that request (a 500) but still ends only that request.
Running out of memory is never the request's: it is raised (the step fails), as is anything
raised where no single request can be named (a batched encoder call that fails for every
image alone, a batched logits processor). Over several ranks a request fails when it failed
on any of them: ``worker/rank_failures.py``.
"""

from __future__ import annotations

import logging

import torch

from kvflow.runner_output import RequestFailure

logger = logging.getLogger(__name__)

# request id -> why the step failed for it (ModelRunnerOutput.failed)
Failures = dict[str, RequestFailure]


def is_request_fault(error: BaseException) -> bool:
    """Whether ``error``, raised while the runner worked on one request's data alone, may be
    charged to that request: an ``Exception`` other than running out of (host or device)
    memory, which is the engine's state, not the request's."""
    return isinstance(error, Exception) and \
        not isinstance(error, (MemoryError, torch.OutOfMemoryError))


def failure_of(what: str, error: Exception, field: str | None) -> RequestFailure:
    """The failure of a request whose ``what`` (e.g. ``"image 1"``) raised ``error``: the
    request's (not internal) for a ValueError, else internal."""
    internal = not isinstance(error, ValueError)
    message = f"{what}: {error}" if not internal else \
        f"{what} failed: {type(error).__name__}: {error}"
    return RequestFailure(message, field, internal)


def request_failure(request_id: str, what: str, error: Exception,
                    field: str | None) -> RequestFailure:
    """:func:`failure_of`, logged for ``request_id`` (with the traceback for an unexpected
    exception)."""
    failure = failure_of(what, error, field)
    logger.warning("request %s fails alone in its step: %s", request_id, failure.message,
                   exc_info=error if failure.internal else None)
    return failure
