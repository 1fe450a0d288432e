"""vLLM's request-level call on :class:`kvflow.engine.async_llm.AsyncLLM`: ``generate``, an
async generator over one prompt's outputs that processes the prompt itself (tokenizing text,
preprocessing images) and, unlike ``add_request``, streams vLLM's default output kind,
``CUMULATIVE``. AsyncLLM's base class."""

from __future__ import annotations

import copy
from collections.abc import AsyncGenerator, Mapping
from typing import Any

from kvflow.engine.request_args import check_request_args
from kvflow.inputs import PromptType
from kvflow.lora.request import LoRARequest
from kvflow.offline.arguments import processed_prompts
from kvflow.outputs import RequestOutput
from kvflow.sampling_params import RequestOutputKind, SamplingParams


class AsyncLLMGenerate:
    """``generate`` of :class:`~kvflow.engine.async_llm.AsyncLLM`, which sets ``processor``
    and ``add_request`` / ``abort`` that it uses."""

    async def generate(self, prompt: PromptType, sampling_params: SamplingParams,
                       request_id: str, *, lora_request: LoRARequest | None = None,
                       tokenization_kwargs: Mapping[str, Any] | None = None,
                       priority: int = 0, data_parallel_rank: int | None = None
                       ) -> AsyncGenerator[RequestOutput, None]:
        """Queue one prompt and yield its outputs as they come (vLLM's
        ``AsyncLLM.generate``, with its argument order).

        What each output holds follows ``sampling_params.output_kind`` (None, the default:
        ``CUMULATIVE``, vLLM's default: every sample's whole text, token ids and logprobs so
        far; ``DELTA``: what each step added; ``FINAL_ONLY``: the finished output alone). The
        last output yielded is finished. Leaving the loop early (``break``, a cancelled task)
        aborts the request: its KV blocks are freed.

        Args:
            prompt: a string, a list of token ids, or a dict prompt (``{"prompt": ...}`` or
                ``{"prompt_token_ids": [...]}`` with ``multi_modal_data``, ``cache_salt``,
                ``mm_processor_kwargs``; ``{"prompt_embeds": tensor}`` with
                ``enable_prompt_embeds``), as ``LLM.generate`` takes one.
            sampling_params: how to sample (fields not given take the model's
                generation_config.json defaults, as in ``add_request``).
            request_id: unique among open requests.
            lora_request: the adapter to run with (loaded with ``add_lora`` first).
            tokenization_kwargs: how a text prompt is tokenized (``LLM.generate``'s).
            priority: its place under the priority policy (lower first).
            data_parallel_rank: the data-parallel replica it must run on (vLLM's; None:
                the load balancer chooses).

        Raises:
            ValueError: for a bad prompt, parameters or ``tokenization_kwargs``, a request
                id in use or not a string, a ``priority``, ``lora_request`` or
                ``data_parallel_rank`` of another type, or a ``data_parallel_rank`` outside
                the replicas (before anything is yielded; nothing is queued).
            EngineDeadError: if no replica runs (or not the pinned one), or the engine dies
                meanwhile.
            AdmissionRejected: if admission control refuses the request.
            RequestRefused: if the engine core cannot run it.
        """
        sampling_params = _generate_params(sampling_params, tokenization_kwargs)
        check_request_args(request_id, priority, lora_request, data_parallel_rank)
        (p,) = processed_prompts(self.processor, [prompt], [sampling_params],
                                 None if tokenization_kwargs is None else dict(tokenization_kwargs))
        stream = self.add_request(request_id, p.text, p.token_ids, sampling_params, priority,
                                  p.mm_features, "", lora_request, p.cache_salt,
                                  p.prompt_embeds, data_parallel_rank)
        try:
            async for out in stream:
                yield out
        finally:  # left early (break, cancellation, an error): free its KV blocks
            if not stream.finished:
                self.abort(request_id)


def _generate_params(sampling_params: SamplingParams,
                     tokenization_kwargs: Mapping[str, Any] | None) -> SamplingParams:
    """``generate``'s sampling params, with vLLM's default output kind (``CUMULATIVE``) where
    ``output_kind`` is None (on a copy: the caller's stays as given), after the type checks of
    both arguments.

    Raises:
        ValueError: if ``sampling_params`` is not a SamplingParams or ``tokenization_kwargs``
            neither a mapping nor None.
    """
    if not isinstance(sampling_params, SamplingParams):
        raise ValueError(  # noqa: TRY004 (bad input is a ValueError throughout kvflow)
            f"sampling_params must be a SamplingParams, got "
            f"{type(sampling_params).__name__}")
    if tokenization_kwargs is not None and not isinstance(tokenization_kwargs, Mapping):
        raise ValueError(
            f"tokenization_kwargs must be a dict or None, got "
            f"{type(tokenization_kwargs).__name__}")
    if sampling_params.output_kind is None:
        sampling_params = copy.copy(sampling_params)
        sampling_params.output_kind = RequestOutputKind.CUMULATIVE
    return sampling_params
