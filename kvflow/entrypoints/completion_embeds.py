"""/v1/completions' ``prompt_embeds`` (with ``--enable-prompt-embeds``): the request's
fields checked for prompts given as embedding rows, and each entry decoded, cut to its
``truncate_prompt_tokens`` last rows and checked off the event loop
(:class:`kvflow.entrypoints.serving_completion.OpenAIServingCompletion`'s)."""

from __future__ import annotations

from typing import Any

from kvflow.engine.async_llm import AsyncLLM
from kvflow.entrypoints.openai_errors import OpenAIError
from kvflow.entrypoints.preprocess import off_loop
from kvflow.entrypoints.protocol import CompletionRequest
from kvflow.entrypoints.sampling_requests import prompt_truncation
from kvflow.entrypoints.serving_checks import prompt_error_code
from kvflow.inputs.embeds import PromptEmbeds, decode_prompt_embeds

__all__ = ["check_embeds_request", "embeds_prompts"]


def check_embeds_request(engine: AsyncLLM, req: CompletionRequest) -> None:
    """Raises OpenAIError 400 naming ``prompt_embeds`` when ``engine`` was not started with
    ``--enable-prompt-embeds`` (first: the other refusals would not apply then), else naming
    the field a ``prompt_embeds`` request cannot have: ``echo``, ``prompt_logprobs`` (its
    prompt has no token ids to echo or score) and ``use_beam_search`` (each beam step is a
    token-id prompt)."""
    try:
        engine.processor.require_prompt_embeds()
    except ValueError as e:
        raise OpenAIError(str(e), param="prompt_embeds",
                          code="unsupported_parameter") from None
    for name, value in (("echo", req.echo),
                        ("prompt_logprobs", req.prompt_logprobs is not None),
                        ("use_beam_search", req.use_beam_search)):
        if value:
            raise OpenAIError(f"{name} cannot be used with prompt_embeds: a prompt given as "
                              "embeddings has no token ids", param=name,
                              code="unsupported_value")


async def embeds_prompts(engine: AsyncLLM, req: CompletionRequest) -> list[PromptEmbeds]:
    """The request's ``prompt_embeds`` decoded (``torch.load(weights_only=True)``), cut
    to their last ``truncate_prompt_tokens`` rows (vLLM's rule) and checked, off the
    event loop when large, in order (none: []).

    Raises:
        OpenAIError: 400 naming ``prompt_embeds`` (``prompt_embeds.<i>`` in a list) for
            an empty list, or for an entry that is not base64 of a ``torch.save``d float
            tensor [num_tokens, hidden_size] of finite values shorter than the context
            (a server without ``--enable-prompt-embeds`` refused it before); naming
            ``truncate_prompt_tokens`` for a bad one.
    """
    raw = req.prompt_embeds
    if raw is None:
        return []
    processor = engine.processor
    items = [raw] if isinstance(raw, str) else raw
    if not items:
        raise OpenAIError("prompt_embeds is an empty list", param="prompt_embeds",
                          code="empty_array")
    limit = prompt_truncation(engine, req)  # the last rows, as vLLM keeps them
    out = []
    for i, item in enumerate(items):
        try:
            out.append(await off_loop(len(item), _load_prompt_embeds, processor, item,
                                      limit))
        except ValueError as e:
            listed = isinstance(raw, list)
            raise OpenAIError(f"prompt_embeds {i} of the list: {e}" if listed else str(e),
                              param=f"prompt_embeds.{i}" if listed else "prompt_embeds",
                              code=prompt_error_code(str(e))) from None
    return out


def _load_prompt_embeds(processor: Any, encoded: str, keep_last: int | None
                        ) -> PromptEmbeds:
    """One ``prompt_embeds`` entry decoded, cut to its last ``keep_last`` rows (the
    request's ``truncate_prompt_tokens``; None: all), checked and packed (digest included):
    the whole CPU work of it, for one worker thread. Raises ValueError saying what is
    wrong."""
    return processor.embeds_prompt(decode_prompt_embeds(encoded), keep_last).prompt_embeds
