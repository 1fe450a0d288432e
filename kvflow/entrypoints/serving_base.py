"""What the OpenAI endpoints share: the base handler, its checks (model name, task, overload,
context length, limits, unsupported fields) and request ids; queueing and answering (a whole
body or an SSE stream) live in ``engine_requests``, the errors in ``openai_errors``, the
streaming plumbing in ``streaming``, SamplingParams from a request in
``sampling_requests``."""

from __future__ import annotations

import functools
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
from kvflow.entrypoints.beam_requests import BeamSearches
from kvflow.entrypoints.openai_errors import OpenAIError, invalid_request
from kvflow.entrypoints.output_log import OutputLog
from kvflow.entrypoints.preprocess import PromptTooLong, encode_checked, off_loop
from kvflow.entrypoints.protocol import (
    EmbeddingRequest,
    RequestBody,
    SamplingRequest,
)
from kvflow.entrypoints.protocol.sampling import MAX_SESSION_ID_CHARS
from kvflow.entrypoints.serving_checks import OpenAIServingChecks
from kvflow.entrypoints.serving_models import ServingModels
from kvflow.entrypoints.tool_parsers.reasoning import reasoning_token_ids
from kvflow.entrypoints.unknown_fields import UnknownFields
from kvflow.inputs.embeds import PromptEmbeds
from kvflow.inputs.multimodal import MultiModalFeature
from kvflow.lora.request import LoRARequest
from kvflow.sampling_params import SamplingParams
from kvflow.thinking_budget import ReasoningTokenIds

logger = logging.getLogger(__name__)

# Logprobs of masked tokens are -inf, which JSON cannot carry; clamp them as vLLM does.
MIN_LOGPROB = -9999.0
# The header that pins a request to a data-parallel replica (vLLM's; a router sets it).
DP_RANK_HEADER = "X-data-parallel-rank"
# The header naming a request's session when its body has no session_id (vLLM 0.32's).
SESSION_ID_HEADER = "X-Session-ID"


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


# the longest X-Request-Id header taken as a request's id (as the body's request_id field)
MAX_REQUEST_ID_CHARS = 256


def request_ids(prefix: str, body_request_id: str | None,
                raw: Request | None = None) -> tuple[str, str]:
    """``(reply id, engine request id)`` for a request: both ``{prefix}-{uuid}``; or, when
    the client sent an id, the reply's ``id`` is ``{prefix}-{id}`` (as vLLM names it) and the
    engine's that with ``-{uuid}`` appended, so that two requests sending the same id stay
    two requests in the engine. The client's id is ``raw``'s ``X-Request-Id`` header when it
    carries a non-empty one, else vLLM's ``request_id`` body field (``body_request_id``), as
    vLLM picks it (``OpenAIServing._base_request_id``).

    Raises:
        OpenAIError: 400 (param ``X-Request-Id``) for a header longer than
            ``MAX_REQUEST_ID_CHARS`` characters (the body field's cap).
    """
    header = raw.headers.get("x-request-id", "").strip() if raw is not None else ""
    if len(header) > MAX_REQUEST_ID_CHARS:
        raise OpenAIError(f"the X-Request-Id header is {len(header)} characters long; at most "
                          f"{MAX_REQUEST_ID_CHARS} are taken as a request's id",
                          param="X-Request-Id", code="invalid_value")
    client_request_id = header or body_request_id
    if client_request_id is None:
        engine_id = random_id(prefix)
        return engine_id, engine_id
    reply_id = f"{prefix}-{client_request_id}"
    return reply_id, random_id(reply_id)


def request_activation(req: Any) -> bool | None:
    """A head request's ``use_activation`` from its ``activation`` (vLLM 0.10's name) and
    ``use_activation`` (0.11.1's) fields: the one set, None when neither is.

    Raises:
        OpenAIError: 400 naming ``activation`` when the two are set to different values.
    """
    a, u = req.activation, req.use_activation
    if a is not None and u is not None and a != u:
        raise OpenAIError(f"activation={str(a).lower()} and use_activation={str(u).lower()} "
                          "disagree (activation is vLLM 0.10's name of use_activation: send "
                          "one)", param="activation", code="invalid_value")
    return u if u is not None else a


def body_size(raw: Request) -> int | None:
    """The request body's bytes by its ``Content-Length`` (None for a chunked body): what a
    request's preprocessing cost grows with (``preprocess.off_loop``'s ``size``)."""
    length = raw.headers.get("content-length", "")
    return int(length) if length.isdigit() else None


class OpenAIServing(OpenAIServingChecks):
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

    @functools.cached_property
    def reasoning_token_ids(self) -> ReasoningTokenIds | None:
        """The ``--reasoning-parser``'s markers, or ``--reasoning-config``'s, as token ids
        (``thinking_token_budget`` needs them), None without markers or a tokenizer;
        tokenized once."""
        return reasoning_token_ids(self.config.reasoning_parser, self.engine.tokenizer,
                                   self.config.reasoning_config)

    @property
    def grammar_in_reasoning(self) -> bool:
        """``--structured-outputs-config '{"enable_in_reasoning": true}'`` (vLLM's): a grammar
        applies from the first token, reasoning included (default: after it); so it does
        without a ``--reasoning-parser`` (markers from ``--reasoning-config`` alone serve the
        budget only: vLLM's grammar waits for a parser's end of reasoning)."""
        return self.config.reasoning_parser is None or \
            bool((self.config.structured_outputs_config or {}).get("enable_in_reasoning"))

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

    def data_parallel_rank(self, raw: Request) -> int | None:
        """The data-parallel replica the request is pinned to by its
        ``X-data-parallel-rank`` header (vLLM's, which a router sets), None without one.

        Raises:
            OpenAIError: 400 naming the header for a value that is not an integer in
                ``[0, data_parallel_size)`` (vLLM ignores a non-integer one).
        """
        value = raw.headers.get(DP_RANK_HEADER)
        if value is None:
            return None
        replicas = self.engine.num_replicas
        try:
            rank = int(value.strip())
        except ValueError:
            rank = None
        if rank is None or not 0 <= rank < replicas:
            raise OpenAIError(f"{DP_RANK_HEADER} {value!r} is not a data-parallel rank in "
                              f"[0, {replicas})", param=DP_RANK_HEADER)
        return rank

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

    @staticmethod
    def session_id(req: SamplingRequest, raw: Request) -> str | None:
        """The request's session, as vLLM 0.32 finds it: its ``session_id`` field, else the
        ``X-Session-ID`` header (an empty one is none); None without one. The KV cache
        events carry it (``BlockStored``). (vLLM also reads ``vllm_xargs["session_id"]``;
        kvflow hands vllm_xargs to custom logits processors only.)

        Raises:
            OpenAIError: 400 naming the header for one longer than 256 characters (the
                body's field is checked by its model).
        """
        if req.session_id:
            return req.session_id
        value = raw.headers.get(SESSION_ID_HEADER)
        if not value:
            return None
        if len(value) > MAX_SESSION_ID_CHARS:
            raise OpenAIError(f"{SESSION_ID_HEADER} is {len(value)} characters long; at most "
                              f"{MAX_SESSION_ID_CHARS}", param=SESSION_ID_HEADER)
        return value

    @property
    def tokenizer(self) -> Any:
        """The tokenizer. Raises OpenAIError 400 if the server runs without one."""
        if self.engine.tokenizer is None:
            raise OpenAIError("this server runs without a tokenizer (--skip-tokenizer-init): "
                              "send token ids", code="no_tokenizer")
        return self.engine.tokenizer

    def pad_ids(self, ids: list[list[int]], padding: str | None) -> list[list[int]]:
        """Each prompt's ``ids`` with vLLM 0.32's ``padding``: ``"max_length"`` appends the
        tokenizer's pad token up to ``max_model_len`` (its ``TokenizeParams`` pad after the
        cut, before the length check); None or ``"do_not_pad"``: as they are.

        Raises:
            OpenAIError: 400 naming ``padding`` when the tokenizer has no pad token.
        """
        if padding != "max_length":
            return ids
        pad = getattr(self.tokenizer, "pad_token_id", None)
        if pad is None:
            raise OpenAIError("padding='max_length' pads with the tokenizer's pad token, and "
                              "this model's tokenizer has none", param="padding",
                              code="invalid_value")
        length = self.engine.max_model_len
        return [one + [pad] * (length - len(one)) for one in ids]

    def token_ids_default(self, req: Any) -> None:
        """Set a completions or chat request's unset ``return_tokens_as_token_ids`` to the
        server's ``--return-tokens-as-token-ids``, as vLLM does (a request's own true or
        false wins)."""
        if req.return_tokens_as_token_ids is None:
            req.return_tokens_as_token_ids = self.config.return_tokens_as_token_ids

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

    # ---- running requests (engine_requests) --------------------------------------------------
    async def add_requests(self, request_id: str,
                           prompts: Sequence[tuple[str | None, list[int]]],
                           params: Sequence[SamplingParams], priority: int = 0,
                           mm_features: list[MultiModalFeature] | None = None,
                           client_id: str = "",
                           lora_request: LoRARequest | None = None,
                           cache_salt: str | None = None,
                           prompt_embeds: Sequence[PromptEmbeds | None] = (),
                           data_parallel_rank: int | None = None,
                           session_id: str | None = None) -> list[RequestStream]:
        """Queue every prompt (ids ``{request_id}-{i}``) at ``priority`` (lower first under
        the priority policy) for ``client_id``, with the images ``mm_features`` (placeholders
        expanded in the prompts' ids); with admission control, wait until the engine core
        accepted them all; ``lora_request``: their adapter; ``cache_salt``: their prefix-cache
        salt (None: unsalted); ``prompt_embeds``: the embedding rows of the first prompts
        (their ids are placeholders); ``data_parallel_rank``: the replica they run on (None:
        the balancer chooses); ``session_id``: their session (``session_id``), written into
        their KV cache events. On failure abort what was queued. Under
        ``--enable-log-outputs`` each stream logs its samples' outputs (``OutputLog``).

        Raises:
            OpenAIError: 400 for input the engine refuses, 503 if the engine is gone or
                admission control refused a prompt (with ``Retry-After``).
        """
        def add(i: int) -> RequestStream:
            (text, ids), sp = prompts[i], params[i]
            self.log_request(f"{request_id}-{i}", text, ids, sp, lora_request)
            embeds = prompt_embeds[i] if i < len(prompt_embeds) else None
            stream = self.engine.add_request(f"{request_id}-{i}", text, ids, sp, priority,
                                             mm_features, client_id, lora_request, cache_salt,
                                             embeds, data_parallel_rank, session_id)
            if self.config.enable_log_outputs:
                stream.observer = OutputLog(f"{request_id}-{i}", self.config.max_log_len)
            return stream

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
                            skip_special_tokens: bool, cache_salt: str | None,
                            session_id: str | None = None) -> list[RequestStream]:
        """Log (``log_request``) and start one beam search per prompt
        (:meth:`BeamSearches.start`, which names the arguments)."""
        for i, ((text, ids), beam) in enumerate(zip(prompts, beams)):
            self.log_request(f"{request_id}-{i}", text, ids, beam, lora_request)
        return self.beam_searches.start(self.engine, request_id, prompts, params, beams,
                                        priority, client_id, lora_request,
                                        skip_special_tokens, cache_salt, session_id)

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
