"""What the OpenAI endpoints share: the base handler, its checks (model name, task, overload,
context length, limits, unsupported fields) and request ids; queueing and answering (a whole
body or an SSE stream) live in ``engine_requests``, the errors in ``openai_errors``, the
streaming plumbing in ``streaming``, SamplingParams from a request in
``sampling_requests``."""

from __future__ import annotations

import hashlib
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel

from kvflow.config import ServerConfig
from kvflow.engine.async_llm import AsyncLLM, RequestStream
from kvflow.entrypoints import engine_requests
from kvflow.entrypoints.beam_requests import BeamSearches, check_beam_request
from kvflow.entrypoints.openai_errors import OpenAIError, engine_dead, invalid_request
from kvflow.entrypoints.preprocess import PromptTooLong, encode_checked, off_loop
from kvflow.entrypoints.protocol import (
    EmbeddingRequest,
    PromptTokenUsageInfo,
    RequestBody,
    SamplingRequest,
    UsageInfo,
)
from kvflow.entrypoints.serving_models import ModelNotFound, ServingModels
from kvflow.entrypoints.unknown_fields import UnknownFields
from kvflow.lora.request import LoRANameError, LoRARequest
from kvflow.multimodal_inputs import MultiModalFeature
from kvflow.prompt_embeds import PromptEmbeds
from kvflow.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# Logprobs of masked tokens are -inf, which JSON cannot carry; clamp them as vLLM does.
MIN_LOGPROB = -9999.0


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def request_ids(prefix: str, client_request_id: str | None) -> tuple[str, str]:
    """``(reply id, engine request id)`` for a request: both ``{prefix}-{uuid}``; or, when
    the client sent vLLM's ``request_id``, the reply's ``id`` is ``{prefix}-{request_id}``
    (as vLLM names it) and the engine's that with ``-{uuid}`` appended, so that two requests
    sending the same id stay two requests in the engine."""
    if client_request_id is None:
        engine_id = random_id(prefix)
        return engine_id, engine_id
    reply_id = f"{prefix}-{client_request_id}"
    return reply_id, random_id(reply_id)


def body_size(raw: Request) -> int | None:
    """The request body's bytes by its ``Content-Length`` (None for a chunked body): what a
    request's preprocessing cost grows with (``preprocess.off_loop``'s ``size``)."""
    length = raw.headers.get("content-length", "")
    return int(length) if length.isdigit() else None


class OpenAIServing:
    """Base of the completion and chat handlers.

    Args:
        engine: the running AsyncLLM.
        config: server options (caps, overload limit).
        model_name: the name clients must send in ``model`` for the base model.
        models: the served names (base model and LoRA adapters), shared by the handlers
            (default: the base model alone).
        unknown_fields: what the server does with body fields kvflow does not declare,
            shared by every endpoint so that each name is logged once under
            ``--ignore-unknown-fields`` (default: one of this handler's own, by ``config``).
    """

    def __init__(self, engine: AsyncLLM, config: ServerConfig, model_name: str,
                 models: ServingModels | None = None,
                 unknown_fields: UnknownFields | None = None) -> None:
        self.engine, self.config, self.model_name = engine, config, model_name
        self.models = models or ServingModels(engine, model_name)
        self.unknown_fields = unknown_fields or UnknownFields(config.ignore_unknown_fields)
        self.beam_searches = BeamSearches()

    def check_fields(self, req: RequestBody, endpoint: str) -> None:
        """Refuse (or, under ``--ignore-unknown-fields``, log) the body fields kvflow does not
        declare; the first check of every request (``UnknownFields.check``).

        Raises:
            OpenAIError: 400 naming the unknown or unsupported field(s).
        """
        self.unknown_fields.check(req, endpoint)

    @staticmethod
    def note_request(req: RequestBody, request_id: str) -> None:
        """Log the client identifiers the request names: ``user`` and OpenAI's
        ``safety_identifier``."""
        for name in ("user", "safety_identifier"):
            value = getattr(req, name, None)
            if value:
                logger.info("request %s: %s %r", request_id, name, value)

    def log_request(self, request_id: str, text: str | None, ids: list[int],
                    params: Any, lora_request: LoRARequest | None = None) -> None:
        """One INFO line per request under ``--enable-log-requests`` (a no-op without it):
        its id, the prompt text (or, without text, its token ids), each cut to
        ``--max-log-len`` characters / ids, its parameters (SamplingParams, PoolingParams, or
        a beam search's BeamSearchParams) and the LoRA adapter."""
        if not self.config.log_requests:
            return
        limit = self.config.max_log_len
        prompt = text if text is not None else ids
        if limit is not None:
            prompt = prompt[:limit]
        logger.info("received request %s: prompt: %r, params: %s, prompt_token_ids: %s, "
                    "lora_request: %s", request_id, prompt if text is not None else None,
                    params, ids[:limit] if limit is not None else ids,
                    None if lora_request is None else lora_request.lora_name)

    @staticmethod
    def client_id(req: SamplingRequest | EmbeddingRequest, raw: Request) -> str:
        """Who sent the request (completions, chat and embeddings alike), for ``--policy
        fair``: its ``user`` field, else a digest of its bearer API key (``key:`` + 16 hex
        digits; the key itself is never kept), else "" (one anonymous client)."""
        if req.user:
            return req.user
        auth = raw.headers.get("authorization", "")
        if auth.lower().startswith("bearer ") and auth[7:].strip():
            return "key:" + hashlib.sha256(auth[7:].strip().encode()).hexdigest()[:16]
        return ""

    @property
    def tokenizer(self) -> Any:
        """The tokenizer. Raises OpenAIError 400 if the server runs without one."""
        if self.engine.tokenizer is None:
            raise OpenAIError("this server runs without a tokenizer (--skip-tokenizer-init): "
                              "send token ids", code="no_tokenizer")
        return self.engine.tokenizer

    async def encode_texts(self, tokenizer: Any, texts: Sequence[str],
                           add_special_tokens: bool, param: str, pooling: bool = False,
                           check_length: bool = True) -> list[list[int]]:
        """The token ids of each text, in order, tokenized in one go: in a worker thread when
        they are long (``preprocess.off_loop``), each refused as soon as a prefix of it is
        longer than the context allows (``max_model_len - 1`` tokens, ``max_model_len`` for
        an embedding, ``pooling``) without tokenizing the rest; not refused, tokenized whole,
        without ``check_length`` (a prompt ``truncate_prompt_tokens`` will cut).

        Raises:
            OpenAIError: 400 naming ``param``, code ``context_length_exceeded``, for a text
                certainly longer than the context.
        """
        limit = self.engine.max_model_len - (0 if pooling else 1)

        def encode_all() -> list[list[int]]:
            if not check_length:
                return [tokenizer.encode(text, add_special_tokens=add_special_tokens)
                        for text in texts]
            return [encode_checked(tokenizer, text, limit, add_special_tokens) for text in texts]

        try:
            return await off_loop(sum(len(text) for text in texts), encode_all)
        except PromptTooLong as e:
            raise OpenAIError(str(e), param=param, code="context_length_exceeded") from None

    # ---- checks ------------------------------------------------------------------------------
    def check_model(self, model: str | None) -> LoRARequest | None:
        """The LoRA adapter ``model`` names, None for the base model.

        Raises:
            OpenAIError: 400 for a name no model can have (empty, whitespace only, a control
                character); 404 if the request names a model or adapter this server does not
                serve.
        """
        try:
            return self.models.resolve(model)
        except LoRANameError as e:
            raise OpenAIError(str(e), param="model", code="invalid_value") from None
        except ModelNotFound as e:
            raise OpenAIError(str(e), 404, "invalid_request_error", "model",
                              "model_not_found") from None

    def response_model(self, model: str | None) -> str:
        """The ``model`` a response names: the adapter's name when the request picked a LoRA
        adapter (as vLLM and the OpenAI API echo the requested model), else the served
        model's name. ``model`` was checked by ``check_model`` on entry."""
        return model or self.model_name

    def serves(self, task: str) -> bool:
        """Whether the served model does ``task`` (what ``check_task`` refuses otherwise)."""
        pooler = self.engine.processor.pooler
        return task in ((self.engine.task,) if pooler is None else pooler.tasks)

    def check_task(self, task: str) -> None:
        """Refuse an endpoint the served model does not do (text on an embedding model,
        embeddings on a text model, scores on either, scores on a classify server whose
        classifier has several labels, ...). A sequence classifier serves both head tasks
        where it can (``PoolerConfig.tasks``).

        Raises:
            OpenAIError: 400 (param ``model``, code ``wrong_task``) when the engine does not
                serve ``task``.
        """
        if self.serves(task):
            return
        pooler = self.engine.processor.pooler
        if self.engine.task == "classify" and task == "score":
            labels = pooler.num_labels
            raise OpenAIError(f"this server's model runs task='classify' (--task) with "
                              f"num_labels={labels}: /v1/score and /v1/rerank need a "
                              "one-label classifier (num_labels == 1, a relevance logit); "
                              f"serve it with --task score for its {labels} values per pair, "
                              "or use /v1/classify", param="model", code="wrong_task")
        use = {"embed": "/v1/embeddings, /v1/score or /v1/rerank",
               "score": "/v1/score, /v1/rerank or /v1/classify",
               "classify": "/v1/classify"}.get(
            self.engine.task, "/v1/completions or /v1/chat/completions")
        raise OpenAIError(f"this server's model runs task={self.engine.task!r} (--task); "
                          f"this endpoint needs task={task!r}: use {use}", param="model",
                          code="wrong_task")

    def check_admission(self, num_requests: int, param: str = "prompt") -> None:
        """Raises OpenAIError 503 (with Retry-After) when too many requests wait already
        (counted on /metrics as ``kvflow:requests_overloaded``), or 400 naming ``param``
        when the request alone has more prompts than ``--max-waiting-requests`` (no retry
        would ever be admitted)."""
        limit = self.config.max_waiting_requests
        if not self.engine.is_healthy:
            raise engine_dead(self.engine.dead_error
                              or RuntimeError("the engine core process is gone"))
        if limit is not None and num_requests > limit:
            raise OpenAIError(f"the request has {num_requests} prompts; this server admits "
                              f"at most {limit} waiting requests (--max-waiting-requests): "
                              f"send at most {limit} per request", param=param,
                              code="too_many_prompts")
        if limit is not None and self.engine.num_waiting_requests + num_requests > limit:
            self.engine.metrics.overloaded.inc()
            raise OpenAIError(f"the server is overloaded: {self.engine.num_waiting_requests} "
                              f"requests are waiting (limit {limit}); retry later", 503,
                              "server_overloaded", code="server_overloaded",
                              headers={"Retry-After": "1"})

    def check_prompt(self, token_ids: list[int], max_tokens: int, param: str,
                     length_param: str = "max_tokens") -> None:
        """Raises OpenAIError 400 naming ``param`` for an empty prompt (code ``empty_array``),
        an out-of-vocabulary token id (``invalid_value``), or naming ``length_param`` (the
        field the client set the limit with: ``max_tokens`` or chat's
        ``max_completion_tokens``) for one that leaves no room for ``max_tokens`` in the
        context (``context_length_exceeded``)."""
        try:
            self.engine.processor.validate(token_ids)
        except ValueError as e:
            raise OpenAIError(str(e), param=param, code=prompt_error_code(str(e))) from None
        limit = self.engine.max_model_len
        if len(token_ids) + max_tokens > limit:
            raise OpenAIError(
                f"this model's maximum context length is {limit} tokens"
                f"{self.engine.processor.max_model_len_note}; the request has "
                f"{len(token_ids)} prompt token{'s' * (len(token_ids) != 1)} and asks for "
                f"{max_tokens} more "
                f"({len(token_ids) + max_tokens} in total)", param=length_param,
                code="context_length_exceeded")

    def check_n(self, n: int) -> None:
        """Refuse more samples per request than the server allows.

        Raises:
            OpenAIError: 400 (param ``n``, code ``integer_above_max_value`` as OpenAI's for
                its own cap) if ``n`` is above ``--max-n``.
        """
        if n > self.config.max_n:
            raise OpenAIError(f"n={n} is above this server's limit of {self.config.max_n} "
                              "(--max-n)", param="n", code="integer_above_max_value")

    def check_num_logprobs(self, value: int | None, param: str) -> None:
        """Refuse more logprobs per token than the server allows; ``param`` names the field.

        Raises:
            OpenAIError: 400 (naming ``param``, code ``integer_above_max_value``) if ``value``
                is above ``--max-logprobs``.
        """
        if value is not None and value > self.config.max_logprobs:
            raise OpenAIError(f"{param}={value} is above this server's limit of "
                              f"{self.config.max_logprobs} (--max-logprobs)", param=param,
                              code="integer_above_max_value")

    @staticmethod
    def check_stream_options(req: SamplingRequest) -> None:
        """``stream_options`` only makes sense on a streamed request.

        Raises:
            OpenAIError: 400 (param ``stream_options``) if it is set while ``stream`` is false.
        """
        if req.stream_options is not None and not req.stream:
            raise OpenAIError("stream_options is only allowed when stream is true",
                              param="stream_options", code="invalid_value")

    def stream_usage(self, req: SamplingRequest) -> tuple[bool, bool]:
        """What a stream reports of its usage: (a last chunk with the request's usage,
        ``include_usage``, always under ``--enable-force-include-usage``; every chunk with
        the usage so far, ``continuous_usage_stats``)."""
        force = self.config.enable_force_include_usage
        options = req.stream_options
        if options is None:
            return force, False
        return options.include_usage or force, options.continuous_usage_stats

    def usage(self, num_prompt: int, num_generated: int, num_cached: int) -> UsageInfo:
        """A reply's ``usage`` (``usage_info``), with the prompt tokens' details under
        ``--enable-prompt-tokens-details``."""
        return usage_info(num_prompt, num_generated, num_cached,
                          self.config.enable_prompt_tokens_details)

    def check_unsupported(self, req: SamplingRequest) -> None:
        """Raises OpenAIError 400 naming a field set to something kvflow does not do:
        ``best_of`` other than ``n``, a field ``use_beam_search`` would not honour (or
        ``length_penalty`` without it: ``beam_requests.check_beam_request``), or a ``priority``
        while the scheduler is not run by priority (it would be ignored). The code is
        ``unsupported_parameter`` for a field this endpoint never takes, else
        ``unsupported_value`` (OpenAI's codes for the two). Undeclared fields were checked
        first (``check_fields``)."""
        if req.best_of is not None and req.best_of != req.n:
            raise OpenAIError(f"best_of={req.best_of} is not supported: kvflow returns every "
                              "sample it generates (send n, or best_of equal to n)",
                              param="best_of", code="unsupported_value")
        check_beam_request(req)
        self.check_priority(req.priority)

    def check_priority(self, priority: int) -> None:
        """A request's ``priority`` orders only the priority (and fair) policy's queue.

        Raises:
            OpenAIError: 400 (param ``priority``, code ``unsupported_value``) for a nonzero
                priority while the scheduler is not run by priority (it would be ignored).
        """
        if not priority:
            return
        policy = self.engine.config.scheduler_config.policy
        if policy not in ("priority", "fair"):
            raise OpenAIError(f"priority={priority} needs the priority or fair scheduling "
                              f"policy (start the server with --policy priority or fair); it "
                              f"runs {policy!r}", param="priority", code="unsupported_value")

    # ---- running requests (engine_requests) --------------------------------------------------
    async def add_requests(self, request_id: str,
                           prompts: Sequence[tuple[str | None, list[int]]],
                           params: Sequence[SamplingParams], priority: int = 0,
                           mm_features: list[MultiModalFeature] | None = None,
                           client_id: str = "",
                           lora_request: LoRARequest | None = None,
                           cache_salt: str | None = None,
                           prompt_embeds: Sequence[PromptEmbeds | None] = ()
                           ) -> list[RequestStream]:
        """Queue every prompt (ids ``{request_id}-{i}``) at ``priority`` (lower first under
        the priority policy) for ``client_id``, with the images ``mm_features`` (placeholders
        expanded in the prompts' ids); with admission control, wait until the engine core
        accepted them all; ``lora_request``: their adapter; ``cache_salt``: their prefix-cache
        salt (None: unsalted); ``prompt_embeds``: the embedding rows of the first prompts
        (their ids are placeholders). On failure abort what was queued.

        Raises:
            OpenAIError: 400 for input the engine refuses, 503 if the engine is gone or
                admission control refused a prompt (with ``Retry-After``).
        """
        def add(i: int) -> RequestStream:
            (text, ids), sp = prompts[i], params[i]
            self.log_request(f"{request_id}-{i}", text, ids, sp, lora_request)
            embeds = prompt_embeds[i] if i < len(prompt_embeds) else None
            return self.engine.add_request(f"{request_id}-{i}", text, ids, sp, priority,
                                           mm_features, client_id, lora_request, cache_salt,
                                           embeds)

        return await self.admit_all(add, len(prompts))

    async def admit_all(self, add: Callable[[int], RequestStream], count: int,
                        bad_input: Callable[[ValueError], OpenAIError] = invalid_request
                        ) -> list[RequestStream]:
        """Queue ``add(0) .. add(count - 1)``: :func:`engine_requests.admit_all`.

        Raises:
            OpenAIError: ``bad_input(e)`` (a 400) for a ValueError from the engine's
                validation; 503 if the engine is gone or admission control refused a prompt.
        """
        return await engine_requests.admit_all(self.engine, add, count, self.abort, bad_input)

    def start_beam_searches(self, request_id: str, prompts: Sequence[tuple[str | None, list[int]]],
                            params: Sequence[SamplingParams], beams: Sequence[Any],
                            priority: int, client_id: str, lora_request: LoRARequest | None,
                            skip_special_tokens: bool, cache_salt: str | None
                            ) -> list[RequestStream]:
        """Log (``log_request``) and start one beam search per prompt
        (:meth:`BeamSearches.start`, which names the arguments)."""
        for i, ((text, ids), beam) in enumerate(zip(prompts, beams)):
            self.log_request(f"{request_id}-{i}", text, ids, beam, lora_request)
        return self.beam_searches.start(self.engine, request_id, prompts, params, beams,
                                        priority, client_id, lora_request,
                                        skip_special_tokens, cache_salt)

    def abort(self, streams: Sequence[RequestStream]) -> None:
        """Abort every stream's request, or cancel the beam search feeding it (no-op for
        finished ones)."""
        for stream in streams:
            self.engine.abort(stream.request_id)
            self.beam_searches.cancel(stream.request_id)

    async def respond(self, raw: Request, streams: Sequence[RequestStream],
                      work: Awaitable[BaseModel | Response], refused_param: str | None = None) -> Response:
        """The non-streaming answer: :func:`engine_requests.respond`.

        Raises:
            OpenAIError: 503 if the engine dies meanwhile; 400 if the engine core refused
                a request (``RequestRefused``: e.g. its grammar did not compile in time),
                ``param`` ``refused_param`` (the field that held the grammar).
        """
        return await engine_requests.respond(raw, streams, work, self.abort, refused_param)

    def stream(self, streams: Sequence[RequestStream], chunks: AsyncIterator[BaseModel],
               refused_param: str | None = None) -> AsyncIterator[str]:
        """The SSE body: :func:`engine_requests.stream`."""
        return engine_requests.stream(streams, chunks, self.abort, refused_param)


def usage_info(num_prompt: int, num_generated: int, num_cached: int,
               details: bool) -> UsageInfo:
    """A reply's ``usage`` (counts in tokens): ``num_cached`` of the ``num_prompt`` prompt
    tokens were prefix-cache hits, reported as ``prompt_tokens_details.cached_tokens`` when
    ``details`` (``--enable-prompt-tokens-details``), 0 included as OpenAI reports it (vLLM
    leaves the details out when nothing was cached); without, the usage has no
    ``prompt_tokens_details`` key at all."""
    return UsageInfo(prompt_tokens=num_prompt, completion_tokens=num_generated,
                     total_tokens=num_prompt + num_generated,
                     prompt_tokens_details=PromptTokenUsageInfo(cached_tokens=num_cached)
                     if details else None)


def check_token_ids(token_ids: list[int], vocab_size: int, param: str) -> None:
    """Refuse a token id a client sent outside ``[0, vocab_size)``, naming its place:
    ``param`` is the list's path (``prompt``, ``prompt.1``, ``tokens``) and the error's
    ``param`` is ``{param}.{index}`` of the first bad id, as the schema's own errors and the
    chat content parts name a list's element (``messages.0.content.1``).

    Raises:
        OpenAIError: 400, code ``invalid_value``.
    """
    if not token_ids or (min(token_ids) >= 0 and max(token_ids) < vocab_size):
        return  # the C-speed check first; then the first bad id's index
    i = next(i for i, t in enumerate(token_ids) if not 0 <= t < vocab_size)
    raise OpenAIError(f"{param}.{i}: token id {token_ids[i]} is outside the vocabulary "
                      f"[0, {vocab_size})", param=f"{param}.{i}", code="invalid_value")


def prompt_error_code(message: str) -> str:
    """The code of a prompt the engine's ``validate`` refused (by its message)."""
    if "max_model_len" in message:
        return "context_length_exceeded"
    return "empty_array" if "empty" in message else "invalid_value"
