"""POST /v1/chat/completions: messages -> the model's chat template -> assistant replies,
streamed (SSE) or whole. The rendering (shared with /tokenize) is ``chat_render.py``'s."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from kvflow.config import ServerConfig
from kvflow.engine.async_llm import AsyncLLM, RequestStream, collect
from kvflow.entrypoints.beam_requests import beam_params
from kvflow.entrypoints.chat_logprobs import chat_logprobs
from kvflow.entrypoints.chat_output import ChatOutputParser, make_reasoning_parser
from kvflow.entrypoints.chat_render import ChatRendering
from kvflow.entrypoints.openai_errors import OpenAIError
from kvflow.entrypoints.platform_fields import refuse_platform_options, served_tier
from kvflow.entrypoints.prompt_logprobs import vllm_prompt_logprobs
from kvflow.entrypoints.protocol import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    ChatStreamChoice,
    DeltaMessage,
    UsageInfo,
)
from kvflow.entrypoints.sampling_requests import (
    check_constraint,
    check_length_fields,
    check_max_tokens,
    default_max_tokens,
    grammar_param,
    sampling_params,
)
from kvflow.entrypoints.serving_base import OpenAIServing, body_size, request_ids
from kvflow.entrypoints.serving_models import ServingModels
from kvflow.entrypoints.sse_keep_alive import with_keep_alive
from kvflow.entrypoints.streaming import SSEResponse, merge_streams
from kvflow.entrypoints.structured_requests import (
    RequestFieldError,
    check_tools_off_loop,
    tool_choice_mode,
    tool_constraint,
    tool_parser_for,
)
from kvflow.entrypoints.unknown_fields import UnknownFields
from kvflow.inputs.multimodal import MultiModalFeature
from kvflow.lora.request import LoRARequest
from kvflow.outputs import CompletionOutput
from kvflow.sampling_params import SamplingParams
from kvflow.structured import StructuredOutputsParams

logger = logging.getLogger(__name__)


@dataclass
class ChatRun:
    """A queued chat request: the reply's id, the prompt's token ids, its one stream, the
    parser that reads reasoning and tool calls back out of the generated text, the
    request field that holds its grammar (``grammar_param``; None without one), and the
    prompt's text (the rendered conversation, as queued)."""

    reply_id: str
    prompt_ids: list[int]
    streams: list[RequestStream]
    parser: ChatOutputParser
    grammar_param: str | None = None
    prompt_text: str = ""


class OpenAIServingChat(ChatRendering, OpenAIServing):
    """Handler of /v1/chat/completions (see OpenAIServing for the other arguments).
    Conversations render with ``config.chat_template`` (``--chat-template``) in place of the
    model's template: ``chat_template`` is its text as ``load_chat_template`` returned it
    (``run_server`` reads it once, before the model loads), or None to read and compile it
    here. Without the flag, a model template that does not compile is reported by
    ``chat_template_source.warn_if_model_template_broken`` (``run_server`` calls it as soon
    as the tokenizer is loaded, while the model still loads).

    Raises:
        ValueError: from the constructor, for a ``--chat-template`` that cannot be used
            (``chat_template_source.load_chat_template``), or a ``chat_template`` text
            without ``config.chat_template`` (the setting it is the text of).
    """

    def __init__(self, engine: AsyncLLM, config: ServerConfig, model_name: str,
                 models: ServingModels | None = None,
                 unknown_fields: UnknownFields | None = None,
                 chat_template: str | None = None) -> None:
        super().__init__(engine, config, model_name, models, unknown_fields)
        self.chat_template = self._init_chat_template(chat_template)

    async def create_chat_completion(self, req: ChatCompletionRequest, raw: Request) -> Response:
        """Validate, render the conversation, queue it, then answer.

        Raises:
            OpenAIError: 400 for bad input (a field kvflow does not declare included), 404
                for another model, 503 when overloaded.
        """
        self.check_fields(req, "/v1/chat/completions")
        run = await self.start(req, raw, "chatcmpl")
        prompt_text = run.prompt_text if req.return_prompt_text else None
        if req.stream:
            chunks = self._chunks(req, run.reply_id, run.prompt_ids, run.streams, run.parser,
                                  prompt_text)
            return SSEResponse(with_keep_alive(
                self.stream(run.streams, chunks, run.grammar_param),
                self.config.sse_keep_alive_interval))
        return await self.respond(raw, run.streams, self._response(
            req, run.reply_id, run.prompt_ids, run.streams[0], run.parser, prompt_text),
            run.grammar_param)

    async def start(self, req: ChatCompletionRequest, raw: Request, prefix: str) -> ChatRun:
        """Check ``req`` (its unknown fields were checked by the caller), render the
        conversation and queue it; the reply's id is ``{prefix}-...`` (``X-Request-Id`` or
        ``request_id`` after the prefix, as vLLM names chat replies). /v1/responses runs its
        requests through here too (``serving_responses``, prefix ``resp``): the
        ``X-Request-Id`` header does not name them, as vLLM's, since a response is stored
        under its id (their body's ``request_id`` is the response's id).

        Raises:
            OpenAIError: 400 for bad input, 404 for another model, 503 when overloaded.
        """
        lora = self.check_model(req.model)
        self.check_task("generate")
        self._check_request(req)
        mode, parser = await self._tools(req)
        tool_grammar = tool_constraint(req, mode)
        await check_constraint(self.engine, req, tool_grammar, body_size(raw))
        rendered, prompt, text, ids = await self.render_prompt(req, raw, mode)
        params = self._params(req, ids, tool_grammar)
        # a template that opens the think block itself; under a grammar applied from the
        # first token on (no reasoning markers known) the reply is what the grammar forces,
        # with no reasoning before it; with the markers the grammar starts after the block
        parser.note_prompt(rendered, grammar=params.structured_outputs is not None
                           and (params.reasoning_token_ids is None
                                or params.grammar_in_reasoning))
        if parser.keeps_special_tokens:  # the call markers are special tokens
            params.skip_special_tokens = False
        self.check_admission(1, n=req.n or 1)
        reply_id, streams = await self._queue(req, raw, prefix, lora, (text, ids), params,
                                              prompt.mm_features, tool_grammar)
        return ChatRun(reply_id, ids, streams, parser, grammar_param(req, tool_grammar), text)

    async def _queue(self, req: ChatCompletionRequest, raw: Request, prefix: str,
                     lora: LoRARequest | None, prompt: tuple[str, list[int]],
                     params: SamplingParams, mm_features: list[MultiModalFeature] | None,
                     tool_grammar: StructuredOutputsParams | None
                     ) -> tuple[str, list[RequestStream]]:
        """Queue the request's prompt (``(text, token ids)``): a beam search under
        ``use_beam_search``, else the engine's requests; returns (the reply's id, its
        streams).

        Raises:
            OpenAIError: 400 for a ``data_parallel_rank`` out of range or a beam search with
                a tool grammar or images; 503 when overloaded.
        """
        dp_rank = self.data_parallel_rank(raw)
        reply_id, request_id = request_ids(prefix, req.request_id,
                                          raw if prefix != "resp" else None)
        self.note_request(req, request_id)
        if req.use_beam_search:
            _refuse_for_beam_search(tool_grammar, mm_features)
            streams = self.start_beam_searches(
                request_id, [prompt], [params], [beam_params(req, params)],
                req.priority, self.client_id(req, raw), lora, params.skip_special_tokens,
                req.cache_salt, self.session_id(req, raw))
        else:
            streams = await self.add_requests(request_id, [prompt], [params],
                                              req.priority, mm_features,
                                              self.client_id(req, raw), lora_request=lora,
                                              cache_salt=req.cache_salt,
                                              data_parallel_rank=dp_rank,
                                              session_id=self.session_id(req, raw))
        return reply_id, streams

    async def _tools(self, req: ChatCompletionRequest) -> tuple[str | None, ChatOutputParser]:
        """The tool-choice mode and the parser that reads the reply back.
        Raises OpenAIError 400 for a bad tool (see ``check_tools``) or a tool_choice that
        does not fit the tools."""
        try:
            mode = tool_choice_mode(req)
            await check_tools_off_loop(req.tools, compile_schemas=mode in ("required", "named"))
        except RequestFieldError as e:
            raise OpenAIError(str(e), param=e.param, code=e.code) from None
        template_kwargs = {**(self.config.default_chat_template_kwargs or {}),
                           **(req.chat_template_kwargs or {})}
        return mode, ChatOutputParser(tool_parser_for(req, mode, self.config.tool_call_parser),
                                      make_reasoning_parser(self.config.reasoning_parser,
                                                            template_kwargs),
                                      None if req.parallel_tool_calls else 1,
                                      "stop" if mode == "named" else "tool_calls",
                                      req.include_reasoning)

    def _check_request(self, req: ChatCompletionRequest) -> None:
        self.check_n(req.n)
        self.check_stream_options(req)
        self.check_unsupported(req)
        self.token_ids_default(req)
        self.check_num_logprobs(req.prompt_logprobs, "prompt_logprobs")
        if req.stream and req.prompt_logprobs is not None:
            raise OpenAIError("prompt_logprobs is not returned when streaming chat (vLLM's "
                              "rule): send stream: false", param="prompt_logprobs",
                              code="unsupported_value")
        check_length_fields(req.max_tokens, req.max_completion_tokens)
        if req.top_logprobs is not None and not req.logprobs:
            raise OpenAIError("top_logprobs needs logprobs=true", param="top_logprobs",
                              code="invalid_value")
        self.check_num_logprobs(req.top_logprobs, "top_logprobs")
        refuse_platform_options(req)

    def _params(self, req: ChatCompletionRequest, ids: list[int],
                tool_grammar: StructuredOutputsParams | None = None) -> SamplingParams:
        field = "max_completion_tokens" if req.max_completion_tokens is not None \
            else "max_tokens"
        max_tokens = getattr(req, field)
        if max_tokens is None:  # the model's default, else as much as the context leaves
            max_tokens = default_max_tokens(self.engine, len(ids))
        else:
            check_max_tokens(max_tokens, field, self.engine)
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = sampling_params(self.engine, req, max_tokens, logprobs, tool_grammar,
                                 self.reasoning_token_ids, self.grammar_in_reasoning)
        params.prompt_logprobs = _prompt_logprobs(req)
        # vLLM's clamp: at most what the context leaves
        params.max_tokens = self.check_prompt(ids, max_tokens, "messages", params.min_tokens)
        return params

    def response_role(self, req: ChatCompletionRequest) -> str:
        """The reply's role: ``--response-role`` (default "assistant") for a request with
        add_generation_prompt true, else the last message's role (as vLLM answers)."""
        if req.add_generation_prompt or not req.messages:
            return self.config.response_role
        return req.messages[-1].role

    def echo_text(self, req: ChatCompletionRequest) -> str:
        """What ``echo`` prepends to every choice's content: the last message's content
        when that message has the reply's role (``response_role``), else ``""`` (vLLM's
        rule); a list of parts is its text (and ``refusal``) parts joined with ``"\\n"``,
        image and video parts left out. ``""`` without ``echo``."""
        last = req.messages[-1]
        if not req.echo or last.role != self.response_role(req):
            return ""
        if not isinstance(last.content, list):
            return last.content or ""
        texts = (p.text if p.text is not None else p.refusal for p in last.content)
        return "\n".join(t for t in texts if t is not None)

    # ---- whole response ----------------------------------------------------------------------
    async def _response(self, req: ChatCompletionRequest, request_id: str, ids: list[int],
                        stream: RequestStream, parser: ChatOutputParser,
                        prompt_text: str | None = None) -> ChatCompletionResponse:
        out = await collect(stream)
        choices = []
        for c in out.outputs:
            message, finish_reason = parser.message(c.text, c.finish_reason)
            message.role = self.response_role(req)
            if req.echo:  # as vLLM: content null (tool calls only) becomes the echo, "" too
                message.content = self.echo_text(req) + (message.content or "")
            choices.append(ChatChoice(index=c.index, message=message,
                                      **{**self._choice_extras(req, c, parser.hides_reasoning),
                                         "finish_reason": finish_reason}))
        num_generated = sum(len(c.token_ids) for c in out.outputs)
        return ChatCompletionResponse(
            id=request_id, model=self.response_model(req.model), choices=choices,
            usage=self.usage(len(ids), num_generated, out.metrics.num_cached_tokens),
            service_tier=served_tier(req),
            prompt_token_ids=ids if req.return_token_ids else None,
            prompt_logprobs=None if _prompt_logprobs(req) is None
            else vllm_prompt_logprobs(out.prompt_logprobs), prompt_text=prompt_text)

    def _choice_extras(self, req: ChatCompletionRequest, c: CompletionOutput,
                       hides_reasoning: bool) -> dict[str, Any]:
        """A choice's logprobs, token ids and finish; under ``hides_reasoning``
        (``ChatOutputParser.hides_reasoning``) no logprobs or token ids, which would show the
        dropped reasoning's tokens (vLLM 0.32's rule)."""
        show = not hides_reasoning
        return {"logprobs": chat_logprobs(c.token_ids, c.logprobs or [], req.top_logprobs or 0,
                                          self.engine.tokenizer,
                                          req.return_tokens_as_token_ids,
                                          req.logprob_token_ids is not None)
                if req.logprobs and show else None,
                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                "token_ids": c.token_ids if req.return_token_ids and show else None}

    # ---- streaming ---------------------------------------------------------------------------
    async def _chunks(self, req: ChatCompletionRequest, request_id: str, ids: list[int],
                      streams: Sequence[RequestStream], parser: ChatOutputParser,
                      prompt_text: str | None = None
                      ) -> AsyncIterator[ChatCompletionStreamResponse]:
        created, num_generated, num_cached = int(time.time()), 0, 0
        include_usage, continuous_usage = self.stream_usage(req)

        def chunk(choices: list[ChatStreamChoice], usage: UsageInfo | None = None,
                  prompt_token_ids: list[int] | None = None, prompt_text: str | None = None):
            if continuous_usage and usage is None:  # the usage so far, on every chunk
                usage = self.usage(len(ids), num_generated, num_cached)
            return ChatCompletionStreamResponse(id=request_id, created=created,
                                                model=self.response_model(req.model), choices=choices,
                                                usage=usage, service_tier=served_tier(req),
                                                prompt_token_ids=prompt_token_ids,
                                                prompt_text=prompt_text)

        states = {i: parser.stream_state() for i in range(req.n)}
        sent_role = False
        async for _, delta in merge_streams(streams):
            if not sent_role:  # with the first output, as vLLM: a client's TTFT (time to its
                sent_role = True  # first chunk) then includes the prefill it waits for
                for first in self._first_chunks(req, ids, prompt_text, chunk):
                    yield first
            num_cached = delta.metrics.num_cached_tokens  # the prompt's, once known
            for c in delta.outputs:
                num_generated += len(c.token_ids)
                choice = self._stream_choice(req, c, parser, states)
                if choice is not None:
                    yield chunk([choice])
        if not sent_role:
            for first in self._first_chunks(req, ids, prompt_text, chunk):
                yield first
        if include_usage:
            yield chunk([], self.usage(len(ids), num_generated, num_cached))

    def _first_chunks(self, req: ChatCompletionRequest, ids: list[int], prompt_text: str | None,
                      chunk: Callable[..., ChatCompletionStreamResponse]
                      ) -> list[ChatCompletionStreamResponse]:
        """Every choice's first chunk, one chunk each (as vLLM and OpenAI send them, so
        a client reading ``choices[0]`` sees every choice's role): the role and (as
        vLLM) the prompt's token ids; with ``echo``, then one chunk per choice holding the
        echoed text (none when it is empty), as vLLM streams it. ``chunk``: ``_chunks``'
        builder of a chunk from its choices."""
        role, echo = self.response_role(req), self.echo_text(req)
        chunks = [chunk([ChatStreamChoice(index=i, delta=DeltaMessage(role=role, content=""))],
                        prompt_token_ids=ids if req.return_token_ids else None,
                        prompt_text=prompt_text)
                  for i in range(req.n)]
        return chunks + [chunk([ChatStreamChoice(index=i, delta=DeltaMessage(content=echo))])
                         for i in range(req.n) if echo]

    def _stream_choice(self, req: ChatCompletionRequest, c: CompletionOutput,
                       parser: ChatOutputParser, states: dict[int, Any]
                       ) -> ChatStreamChoice | None:
        """A streamed delta ``c`` of a choice as its chunk's choice, reasoning and tool
        calls parsed out of the text (``states``: each choice's ``parser.stream_state()``);
        None while it has nothing to send (text held back: a partial character, a stop
        string's prefix)."""
        want_tokens = (req.logprobs or req.return_token_ids) and not parser.hides_reasoning
        message = DeltaMessage(content=c.text)
        extras = self._choice_extras(req, c, parser.hides_reasoning)
        if not parser.is_plain:  # reasoning / tool calls parsed out of the text
            message, extras["finish_reason"] = parser.delta(states[c.index], c.text,
                                                            c.finish_reason)
            message = message or DeltaMessage(content="" if want_tokens else None)
        if not (message.content or message.tool_calls or message.reasoning) \
                and c.finish_reason is None and not (want_tokens and c.token_ids):
            return None
        return ChatStreamChoice(index=c.index, delta=message, **extras)


def _prompt_logprobs(req: ChatCompletionRequest) -> int | None:
    """The prompt logprobs a request gets (top-k per prompt token; None: none): its
    ``prompt_logprobs``, else with ``echo`` its ``top_logprobs`` (0 when unset: the prompt
    token's own logprob alone), vLLM's rule, on a whole (not streamed) reply, as vLLM returns
    them (a streamed reply has no place for them; beam search gives none)."""
    if req.prompt_logprobs is not None:
        return req.prompt_logprobs
    if req.echo and not req.stream and not req.use_beam_search:
        return req.top_logprobs or 0
    return None


def _refuse_for_beam_search(tool_grammar: StructuredOutputsParams | None,
                            images: list | None) -> None:
    """Raises OpenAIError 400 for what a beam search request cannot carry: a forced tool
    call (``tool_choice`` required or named: a grammar) or images."""
    if tool_grammar is not None:
        raise OpenAIError("tool_choice required or a named function cannot be used with "
                          "use_beam_search (structured output is not supported with beam "
                          "search)", param="tool_choice", code="unsupported_value")
    if images:
        raise OpenAIError("images cannot be used with use_beam_search", param="messages",
                          code="unsupported_value")
