"""POST /v1/embeddings: inputs (text or token ids, one or many) -> one vector each (OpenAI's
shape), batched by the engine's scheduler like any prompts."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel

from kvflow.config import ServerConfig
from kvflow.engine.async_llm import AsyncLLM
from kvflow.engine.streams import RequestStream
from kvflow.entrypoints.chat_options import ChatOptions
from kvflow.entrypoints.engine_requests import pooled_vector
from kvflow.entrypoints.openai_errors import OpenAIError
from kvflow.entrypoints.pooling_encoding import (
    BYTES_FORMATS,
    bytes_response,
    check_encoding,
    encode_vector,
    split_rows,
)
from kvflow.entrypoints.preprocess import off_loop
from kvflow.entrypoints.protocol import (
    ClassificationRequest,
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingUsage,
)
from kvflow.entrypoints.protocol.base import now
from kvflow.entrypoints.protocol.chat import ChatMessage, is_batch
from kvflow.entrypoints.serving_base import OpenAIServing, body_size, request_ids
from kvflow.entrypoints.serving_chat import OpenAIServingChat
from kvflow.entrypoints.serving_checks import check_token_ids
from kvflow.entrypoints.serving_models import ServingModels
from kvflow.entrypoints.unknown_fields import UnknownFields
from kvflow.inputs.tokenization import pooling_cut
from kvflow.inputs.truncation import truncation_length
from kvflow.pooling_params import PoolingParams

Prompt = tuple[str | None, list[int]]


class OpenAIServingEmbedding(OpenAIServing):
    """Handler of /v1/embeddings (see OpenAIServing for the constructor's first arguments).

    Args:
        chat: the server's chat handler, which renders ``messages`` (None: a handler that
            never reads a request's ``messages``, such as /classify's).
    """

    def __init__(self, engine: AsyncLLM, config: ServerConfig, model_name: str,
                 models: ServingModels | None = None,
                 unknown_fields: UnknownFields | None = None,
                 chat: OpenAIServingChat | None = None) -> None:
        super().__init__(engine, config, model_name, models, unknown_fields)
        self.chat = chat

    async def create_embedding(self, req: EmbeddingRequest, raw: Request) -> Response:
        """Validate every input, queue them, answer with their vectors in input order.

        Raises:
            OpenAIError: 400 for bad input (both or neither of ``input`` and ``messages``:
                ``_inputs_of``), a ``dimensions`` the model cannot give, or a text model; 404
                for another model; 503 when overloaded.
        """
        self.check_fields(req, "/v1/embeddings")
        self.check_model(req.model)
        self.check_task("embed")
        check_encoding(req.encoding_format, req.embed_dtype, req.endianness)
        self.check_priority(req.priority)
        prompts = await self._inputs_of(req, raw)
        check_normalize(req.normalize, req.use_activation, "use_activation")
        params = PoolingParams(dimensions=req.dimensions, normalize=req.normalize,
                               use_activation=req.use_activation)
        self.check_admission(len(prompts), "input")
        reply_id, request_id = request_ids("embd", req.request_id, raw)
        self.note_request(req, request_id)
        streams = await self._add(request_id, prompts, params, self.client_id(req, raw),
                                  req.priority)
        return await self.respond(raw, streams, self._response(req, reply_id, prompts,
                                                               streams))

    async def _inputs_of(self, req: EmbeddingRequest | ClassificationRequest, raw: Request
                         ) -> list[Prompt]:
        """The request's prompts (/v1/embeddings', /pooling's or /classify's): its ``input``
        as /v1/embeddings reads it, or its ``messages`` rendered (``_conversation``), one
        prompt per conversation (/v1/embeddings takes a list of them, in ``messages`` or, as
        chat messages, in ``input``: vLLM 0.32's batch chat requests).

        Raises:
            OpenAIError: 400 (param ``messages``) for both, (``input``, code
                ``missing_required_parameter``) for neither; see ``_request_inputs``.
        """
        if req.input is not None and req.messages is not None:
            raise OpenAIError("give input or messages, not both", param="messages",
                              code="invalid_value")
        if req.messages is not None:
            field = getattr(req, "messages_field", "messages")
            if not is_batch(req.messages):
                prompts = [await self._conversation(req, raw, req.messages, field)]
            else:
                prompts = [await self._conversation(req, raw, messages, f"{field}.{b}")
                           for b, messages in enumerate(req.messages)]
            return self._padded(prompts, req.padding)
        if req.input is None:
            raise OpenAIError("give input (or messages)", param="input",
                              code="missing_required_parameter")
        for name in ("add_generation_prompt", "continue_final_message", "chat_template",
                     "chat_template_kwargs"):
            if getattr(req, name) != EmbeddingRequest.model_fields[name].default:
                raise OpenAIError(f"{name} applies to messages only", param=name,
                                  code="invalid_value")
        return self._padded(await self._request_inputs(
            req.input, req.truncate_prompt_tokens, req.add_special_tokens is not False,
            req.truncation_side), req.padding)

    def _padded(self, prompts: list[Prompt], padding: str | None) -> list[Prompt]:
        """``prompts`` with vLLM 0.32's ``padding`` (``OpenAIServing.pad_ids``).

        Raises:
            OpenAIError: 400 naming ``padding`` when the tokenizer has no pad token.
        """
        if padding != "max_length":
            return prompts
        ids = self.pad_ids([ids for _, ids in prompts], padding)
        return [(text, one) for (text, _), one in zip(prompts, ids)]

    async def _conversation(self, req: EmbeddingRequest | ClassificationRequest,
                            raw: Request, messages: list[ChatMessage],
                            field: str = "messages") -> Prompt:
        """One conversation of the request (``messages``, sent at ``field``: ``messages``,
        ``input``, or ``messages.<b>`` / ``input.<b>`` in a batch) rendered with the chat
        template (the chat handler's ``render``; special tokens only with
        ``add_special_tokens: true``), cut to ``truncate_prompt_tokens`` as an input text is
        (``_cut_inputs``).

        Raises:
            OpenAIError: what ``render`` refuses (a model without a chat template, ...),
                its param under ``field``; 400 (param ``field``, code
                ``context_length_exceeded``) for a conversation longer than
                ``--max-model-len`` and no ``truncate_prompt_tokens``.
        """
        options = ChatOptions(req.add_generation_prompt, req.continue_final_message,
                              bool(req.add_special_tokens), req.chat_template, None,
                              req.chat_template_kwargs)
        if self.chat is None:
            raise OpenAIError("this endpoint takes input, not messages", param="messages",
                              code="unsupported_parameter")
        try:
            text, ids = await self.chat.render(messages, options, check_length=False,
                                               size=body_size(raw))
        except OpenAIError as e:
            raise _moved(e, field) from None
        try:
            limit = truncation_length(req.truncate_prompt_tokens, self.engine.max_model_len)
        except ValueError as e:
            raise OpenAIError(str(e), param="truncate_prompt_tokens",
                              code="invalid_value") from None
        if limit is not None and len(ids) > limit:
            tokenizer = self.tokenizer
            cut = pooling_cut(limit, req.truncation_side, options.add_special_tokens)
            ids = await off_loop(len(text), lambda: cut.encode(tokenizer, text))
        if len(ids) > self.engine.max_model_len:
            raise OpenAIError(f"the conversation has {len(ids)} tokens but max_model_len is "
                              f"{self.engine.max_model_len}: send truncate_prompt_tokens to "
                              "cut it", param=field, code="context_length_exceeded")
        return text, ids

    async def _request_inputs(self, value: str | list[int] | list[str] | list[list[int]],
                              truncate_prompt_tokens: int | None,
                              add_special_tokens: bool = True,
                              truncation_side: str | None = None) -> list[Prompt]:
        """A request's ``input`` as (text or None, token ids), cut to
        ``truncate_prompt_tokens`` (vLLM's reading: -1 is ``max_model_len``; None: never
        cut, ``_inputs``; else ``_cut_inputs`` on ``truncation_side``).

        Raises:
            OpenAIError: 400 naming ``truncate_prompt_tokens`` for 0, a value below -1 or
                one above ``max_model_len``; see ``_inputs`` / ``_check_items``.
        """
        try:
            limit = truncation_length(truncate_prompt_tokens, self.engine.max_model_len)
        except ValueError as e:
            raise OpenAIError(str(e), param="truncate_prompt_tokens",
                              code="invalid_value") from None
        if limit is None:
            return await self._inputs(value, add_special_tokens)
        return await self._cut_inputs(value, limit, add_special_tokens, truncation_side)

    async def _cut_inputs(self, value: str | list[int] | list[str] | list[list[int]],
                          limit: int, add_special_tokens: bool = True,
                          truncation_side: str | None = None) -> list[Prompt]:
        """The inputs cut to ``limit`` tokens as vLLM's pooling requests cut them
        (:func:`~kvflow.inputs.tokenization.pooling_cut`): by default a text (as the model
        tokenizes it, ``pooling_text``) as the tokenizer truncates it on the right (its
        special tokens kept unless ``add_special_tokens`` is false), token ids to their
        first ``limit``; ``truncation_side`` ``"left"`` / ``"right"``: the whole encoding's
        last / first ``limit``.

        Raises:
            OpenAIError: see ``_check_items``.
        """
        items = self._checked_items(value)
        tokenizer, processor = self.tokenizer, self.engine.processor
        cut = pooling_cut(limit, truncation_side, add_special_tokens)

        def encode_all() -> list[Prompt]:
            return [(item, cut.encode(tokenizer, processor.pooling_text(item)))
                    if isinstance(item, str) else (None, cut.reshape(tokenizer, list(item)))
                    for item in items]

        return await off_loop(sum(len(item) for item in items), encode_all)

    async def _inputs(self, value: str | list[int] | list[str] | list[list[int]],
                      add_special_tokens: bool = True) -> list[Prompt]:
        """A request's ``input`` as (text or None, token ids), in order; text is tokenized
        with the tokenizer's special tokens unless ``add_special_tokens`` is false, long text
        off the event loop (``encode_texts``).

        Raises:
            OpenAIError: 400 (param ``input``) for an empty input (code ``empty_string`` /
                ``empty_array``) or a text certainly longer than the context; a token id
                outside the vocabulary is named by its place, ``input.<j>`` in the one list
                of ids, ``input.<index>.<j>`` in a list of lists (``check_token_ids``, as
                /v1/completions names ``prompt.<j>`` / ``prompt.<index>.<j>``).
        """
        items = self._checked_items(value)
        texts = [self.engine.processor.pooling_text(item) for item in items
                 if isinstance(item, str)]
        encoded = iter(await self.encode_texts(self.tokenizer if texts else None, texts,
                                               add_special_tokens, "input", pooling=True))
        return [(item, next(encoded)) if isinstance(item, str) else (None, list(item))
                for item in items]

    def _checked_items(self, value: str | list[int] | list[str] | list[list[int]]
                       ) -> list[str | list[int]]:
        """A request's ``input`` as its list of inputs (one string or one list of ids is
        one input), each checked by ``_check_items``.

        Raises:
            OpenAIError: see ``_check_items``.
        """
        items = [value] if isinstance(value, str) or (value and isinstance(value[0], int)) \
            else list(value)
        self._check_items(items, listed=items[0] is not value if items else False)
        return items

    def _check_items(self, items: list[str | list[int]], listed: bool) -> None:
        """Refuse an empty input or a token id outside the vocabulary, naming its place
        (``listed``: ``items`` is the request's list of inputs, so ``input.<index>``; else
        ``items`` holds the request's one input, named ``input``).

        Raises:
            OpenAIError: 400, code ``empty_string`` / ``empty_array`` / ``invalid_value``.
        """
        empty = next((i for i, item in enumerate(items) if len(item) == 0),
                     None if items else -1)
        if empty is not None:  # in a list of inputs, name the empty one
            listed = listed and empty >= 0
            kind = items[empty] if empty >= 0 else []
            raise OpenAIError(f"input {empty} of the list is empty" if listed
                              else "the input is empty",
                              param=f"input.{empty}" if listed else "input",
                              code="empty_string" if isinstance(kind, str) else "empty_array")
        for i, item in enumerate(items):
            if not isinstance(item, str):
                check_token_ids(item, self.engine.vocab_size, f"input.{i}" if listed
                                else "input")

    async def _add(self, request_id: str, prompts: list[Prompt], params: PoolingParams,
                   client_id: str, priority: int = 0) -> list[RequestStream]:
        """Queue every input (ids ``{request_id}-{i}``) for ``client_id`` (``client_id``:
        the fair policy's sender) at ``priority`` (checked: ``check_priority``), with
        admission control wait until the engine core accepted them all; on failure abort
        what was queued.

        Raises:
            OpenAIError: 400 for an input or ``dimensions`` the engine refuses, 503 if the
                engine is gone or admission control refused an input.
        """
        def add(i: int) -> RequestStream:
            text, ids = prompts[i]
            self.log_request(f"{request_id}-{i}", text, ids, params)
            return self.engine.add_pooling_request(f"{request_id}-{i}", text, ids, params,
                                                   client_id, priority)

        def bad_input(e: ValueError) -> OpenAIError:
            param = "dimensions" if "dimensions" in str(e) else "input"
            return OpenAIError(str(e), param=param, code=_embedding_error_code(str(e)))

        return await self.admit_all(add, len(prompts), bad_input)

    async def _response(self, req: EmbeddingRequest, reply_id: str, prompts: list[Prompt],
                        streams: Sequence[RequestStream]) -> EmbeddingResponse | Response:
        def reply(values: list[list[float] | str], num_tokens: int) -> EmbeddingResponse:
            data = [EmbeddingData(index=i, embedding=value) for i, value in enumerate(values)]
            return EmbeddingResponse(id=reply_id, model=self.model_name, data=data,
                                     usage=EmbeddingUsage(prompt_tokens=num_tokens,
                                                          total_tokens=num_tokens))

        return await self.encoded_reply(req, reply_id, prompts, streams, reply)

    async def encoded_reply(self, req: EmbeddingRequest, reply_id: str, prompts: list[Prompt],
                            streams: Sequence[RequestStream],
                            reply: Callable[[list[Any], int], BaseModel],
                            per_token: bool = False) -> BaseModel | Response:
        """The answer once every input's vector is in: the ``bytes`` / ``bytes_only`` body
        (``bytes_response``), else ``reply(values, prompt tokens)``, each value a vector as
        ``req.encoding_format`` encodes it (``encode_vector``). With ``per_token`` (vLLM's
        token_embed / token_classify: an input's values are its prompt tokens' rows,
        flattened row-major) ``float`` gives each input's rows as nested lists
        [num_tokens][D], ``base64`` / ``bytes`` the flat row-major bytes (``bytes``'
        ``shape`` [num_tokens, D])."""
        vectors = [await pooled_vector(stream) for stream in streams]
        num_tokens = sum(len(ids) for _, ids in prompts)
        rows = [len(ids) if per_token else 1 for _, ids in prompts]
        if req.encoding_format in BYTES_FORMATS:
            head = {"id": reply_id, "created": now(), "model": self.model_name}
            return bytes_response(vectors, req.embed_dtype, req.endianness, head, num_tokens,
                                  rows if per_token else None,
                                  metadata=req.encoding_format == "bytes")
        if per_token and req.encoding_format == "float":
            return reply([split_rows(v, n) for v, n in zip(vectors, rows)], num_tokens)
        return reply([encode_vector(vector, req.encoding_format, req.embed_dtype,
                                    req.endianness) for vector in vectors], num_tokens)


def check_normalize(normalize: bool | None, use_activation: bool | None, name: str) -> None:
    """An embedding request's two switches of its L2 normalization, ``normalize`` (vLLM
    0.10-0.11) and ``use_activation`` (vLLM 0.32; sent as ``name``), must agree when both
    are sent.

    Raises:
        OpenAIError: 400 naming ``name`` (code ``invalid_value``) when they differ.
    """
    if None not in (normalize, use_activation) and normalize != use_activation:
        raise OpenAIError(f"{name}={str(use_activation).lower()} disagrees with "
                          f"normalize={str(normalize).lower()} ({name} is vLLM 0.32's name "
                          "of normalize on embeddings: send one)", param=name,
                          code="invalid_value")


def _moved(error: OpenAIError, field: str) -> OpenAIError:
    """``error`` about a conversation's ``messages`` (param ``messages...``) named at
    ``field`` instead (``input``, ``messages.<b>``, ``input.<b>``), in its param and in its
    message when the message starts with the param; other errors as they are."""
    param = error.param or ""
    if field == "messages" or param.split(".")[0] != "messages":
        return error
    moved = field + param[len("messages"):]
    message = str(error)
    if message.startswith(param):
        message = moved + message[len(param):]
    return OpenAIError(message, error.status, error.type, moved, error.code, error.headers)


def _embedding_error_code(message: str) -> str:
    """The code of an input or ``dimensions`` the engine refused (by its message)."""
    return "context_length_exceeded" if "max_model_len" in message else "invalid_value"
