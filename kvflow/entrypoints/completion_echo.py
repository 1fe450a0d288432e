"""``echo`` with ``max_tokens`` 0 on /v1/completions: the prompt alone, the legacy OpenAI
API's and vLLM's way to score a prompt (the engine samples one token, which the reply
leaves out)."""

from __future__ import annotations

import dataclasses

from kvflow.entrypoints.openai_errors import OpenAIError
from kvflow.entrypoints.protocol import CompletionRequest
from kvflow.outputs import CompletionOutput


def echo_only(req: CompletionRequest) -> bool:
    """Whether ``req`` asks for its prompt alone: ``echo`` with ``max_tokens`` 0 (the legacy
    OpenAI API's and vLLM's way to score a prompt: with ``logprobs``, the reply holds the
    prompt tokens' logprobs and nothing generated)."""
    return req.echo and req.max_tokens == 0


def check_echo_only(req: CompletionRequest) -> None:
    """Raises OpenAIError 400 naming ``min_tokens`` when an echo-only request
    (``echo_only``) asks for generated tokens all the same."""
    if req.min_tokens:
        raise OpenAIError(f"min_tokens={req.min_tokens} asks for generated tokens, but "
                          "max_tokens=0 with echo returns the prompt alone", param="min_tokens",
                          code="invalid_value")


def prompt_only(c: CompletionOutput) -> CompletionOutput:
    """An echo-only request's sample (``echo_only``) without the one token the engine
    generated for it: no text, tokens or logprobs; finished for ``length`` (max_tokens 0),
    whatever ended the hidden token, so usage counts no completion tokens."""
    return dataclasses.replace(
        c, text="", token_ids=[], cumulative_logprob=None,
        logprobs=None if c.logprobs is None else [],
        finish_reason="length" if c.finished else None, stop_reason=None)
