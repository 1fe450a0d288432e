"""OpenAI's chat fields about the platform rather than the reply (``store``,
``service_tier``): declared on ``ChatCompletionRequest``, accepted where kvflow already does
what they ask, else a 400 naming the field (never silently ignored). Where OpenAI has no
such field (completions, embeddings) ``unknown_fields.UNSUPPORTED`` refuses the same values."""

from __future__ import annotations

from kvflow.entrypoints.openai_errors import OpenAIError
from kvflow.entrypoints.protocol import ChatCompletionRequest


def refuse_platform_options(req: ChatCompletionRequest) -> None:
    """Raises OpenAIError 400 (``unsupported_value``) for ``store: true`` (kvflow keeps no
    completions) and a ``service_tier`` other than ``auto`` / ``default`` (kvflow has one
    tier; its ``priority`` field orders the queue)."""
    if req.store:
        raise OpenAIError("store=true is not supported: kvflow does not store completions "
                          "(send false or leave it out)", param="store",
                          code="unsupported_value")
    if req.service_tier not in (None, "auto", "default"):
        raise OpenAIError(f"service_tier={req.service_tier!r} is not supported: kvflow "
                          "serves every request on one tier (send auto or default; "
                          "kvflow's priority field orders the queue under --policy "
                          "priority)", param="service_tier", code="unsupported_value")


def served_tier(req: ChatCompletionRequest) -> str | None:
    """The ``service_tier`` a chat reply carries: OpenAI's names the tier that served the
    request when the request set one (``auto`` resolves to the tier used), so ``"default"``,
    kvflow's one tier, for ``auto`` or ``default``; None (no field in the reply) when the
    request set none. Call after :func:`refuse_platform_options`."""
    return None if req.service_tier is None else "default"
