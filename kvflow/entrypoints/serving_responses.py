"""POST /v1/responses and GET /v1/responses/{id}: OpenAI's Responses API on top of the chat
handler. A request becomes a ``ChatCompletionRequest`` (``responses_input``: input items ->
messages, function tools, ``text.format`` -> ``response_format``), runs through
``OpenAIServingChat.start`` (the same checks, template, sampling, structured output and tool
parsing as /v1/chat/completions), and the chat parser's deltas become output items and
stream events (``responses_events``); an error the chat path finds names the Responses
field (``responses_errors``). Replies are kept in a bounded in-memory store when ``store`` is
true (``responses_store``); ``responses_keeper`` checks a request against that store
(``store``, ``request_id``, ``previous_response_id``), stores the finished reply and serves
GET / DELETE /v1/responses/{id}, /v1/responses/{id}/input_items and /cancel. ``background``
runs a response as a server task (``responses_background``): polled with GET, stopped with
POST /v1/responses/{id}/cancel, its stream (with ``stream``) followed again with GET
...?stream=true&starting_after=N."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import BaseModel, ValidationError

from kvflow.engine.async_llm import EngineDeadError, RequestFailed, RequestRefused
from kvflow.entrypoints.chat_logprobs import chat_logprobs
from kvflow.entrypoints.engine_requests import refused
from kvflow.entrypoints.openai_errors import OpenAIError, engine_dead
from kvflow.entrypoints.protocol import ChatCompletionRequest
from kvflow.entrypoints.protocol.base import now
from kvflow.entrypoints.protocol.responses_api import (
    CHAT_FIELDS,
    InputTokensDetails,
    OutputTokensDetails,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
)
from kvflow.entrypoints.responses_checks import refuse_unhonoured, wants_logprobs
from kvflow.entrypoints.responses_errors import renamed, renamed_error
from kvflow.entrypoints.responses_events import Event, ResponseEvents, sse_lines
from kvflow.entrypoints.responses_input import (
    Conversation,
    chat_messages,
    chat_response_format,
    chat_tool_choice,
    chat_tools,
    input_items,
)
from kvflow.entrypoints.responses_keeper import ResponseKeeper
from kvflow.entrypoints.responses_store import ResponseStore, StoredResponse
from kvflow.entrypoints.serving_chat import ChatRun, OpenAIServingChat
from kvflow.entrypoints.streaming import SSEResponse
from kvflow.entrypoints.structured_requests import RequestFieldError
from kvflow.entrypoints.validation_errors import validation_error


class OpenAIServingResponses:
    """Handler of /v1/responses, running its requests through ``chat`` (the server's chat
    handler: same template, checks and parsers); ``keeper`` keeps the replies (``store``)
    and runs background responses (``background``) and serves the routes that read them
    (call :meth:`shutdown` when the server stops)."""

    def __init__(self, chat: OpenAIServingChat, store: ResponseStore | None = None) -> None:
        self.chat = chat
        self.keeper = ResponseKeeper(store if store is not None else ResponseStore(),
                                     lambda streams: self.chat.abort(streams))
        self.store, self.background = self.keeper.store, self.keeper.background

    async def shutdown(self) -> None:
        """Cancel the running background responses (their engine requests aborted, each
        stored as ``cancelled``)."""
        await self.keeper.shutdown()

    async def create_response(self, req: ResponsesRequest, raw: Request) -> Response:
        """Validate, run the conversation through the chat handler, answer with a response
        object or (``stream``) its SSE events.

        Raises:
            OpenAIError: 400 for bad input or a field kvflow does not honour (``param`` its
                path in this request; ``background`` without ``store``), 404 for another
                model or an unknown ``previous_response_id``, 400 naming ``request_id`` for
                the id of a background response still running, 429 when
                ``--responses-store-size`` background responses run already, 503 when
                overloaded.
        """
        self.chat.check_fields(req, "/v1/responses")
        refuse_unhonoured(req)
        self.keeper.check(req)
        conv, chat_req = self._chat_request(req)
        try:
            run = await self.chat.start(chat_req, raw, "resp")
        except OpenAIError as e:
            raise renamed_error(e, conv) from None
        skeleton = self._skeleton(req, req.request_id or
                                  run.reply_id.replace("resp-", "resp_", 1))
        if req.background:
            try:  # another one of this id may have started while this one was rendered
                self.keeper.check_request_id(req)
            except OpenAIError:
                self.chat.abort(run.streams)
                raise
            events = ResponseEvents()
            return self.background.start(
                StoredResponse(skeleton, _turns(conv), input_items(req.input)),
                self._run(req, run, skeleton, conv, events, []), events, run.streams,
                req.stream)
        if req.stream:
            return SSEResponse(self._sse(run, self._events(req, run, skeleton, conv)))
        return await self.chat.respond(raw, run.streams, self._whole(req, run, skeleton, conv),
                                       renamed(run.grammar_param, conv))

    # ---- the chat request --------------------------------------------------------------------
    def _chat_request(self, req: ResponsesRequest
                      ) -> tuple[Conversation, ChatCompletionRequest]:
        earlier = self.keeper.earlier(req.previous_response_id)
        try:
            conv = chat_messages(req.input, req.instructions, earlier)
            body = {"model": req.model, "messages": conv.messages,
                    "max_completion_tokens": req.max_output_tokens,
                    "temperature": req.temperature, "top_p": req.top_p, "user": req.user,
                    "tools": chat_tools(req.tools) or None,
                    "tool_choice": chat_tool_choice(req.tool_choice),
                    "parallel_tool_calls": req.parallel_tool_calls,
                    "response_format": chat_response_format(req.text and req.text.format),
                    "logprobs": wants_logprobs(req) or None,
                    "top_logprobs": req.top_logprobs if wants_logprobs(req) else None,
                    "prompt_cache_key": req.prompt_cache_key, "cache_salt": req.cache_salt,
                    "session_id": req.session_id, "safety_identifier": req.safety_identifier,
                    # the engine's id: resp-{request_id}-{uuid} (unique, the id in its logs)
                    "request_id": req.request_id,
                    "reasoning_effort": req.reasoning and req.reasoning.effort,
                    "include_reasoning": req.include_reasoning,
                    "vllm_xargs": req.vllm_xargs, **_chat_fields(req),
                    # vLLM 0.32's: auto keeps the prompt's last max_model_len - 1 tokens
                    "truncate_prompt_tokens": -1 if req.truncation == "auto" else None}
        except RequestFieldError as e:
            raise OpenAIError(str(e), param=e.param, code=e.code) from None
        try:
            chat = ChatCompletionRequest.model_validate(
                {k: v for k, v in body.items() if v is not None})
        except ValidationError as e:
            error = validation_error(RequestValidationError(
                [{**err, "loc": ("body", *err["loc"])} for err in e.errors()]))
            raise renamed_error(error, conv) from None
        return conv, chat

    def _skeleton(self, req: ResponsesRequest, response_id: str) -> ResponseObject:
        """The reply in progress: ``response_id`` (``request_id`` as sent, else the engine's
        request id with ``resp_``, so that logs and replies match), time, the request's
        settings echoed, no output."""
        text = {"format": {"type": "text"}}
        if req.text is not None and req.text.format is not None:
            text = {"format": req.text.format.model_dump(by_alias=True, exclude_none=True)}
        return ResponseObject(
            id=response_id, created_at=now(), background=req.background,
            status="queued" if req.background else "in_progress",
            model=self.chat.response_model(req.model),
            instructions=req.instructions, max_output_tokens=req.max_output_tokens,
            temperature=req.temperature, top_p=req.top_p, top_logprobs=req.top_logprobs,
            tools=req.tools or [],
            tool_choice=req.tool_choice or "auto", parallel_tool_calls=req.parallel_tool_calls,
            text=text, reasoning=req.reasoning.model_dump() if req.reasoning else None,
            metadata=req.metadata or {}, previous_response_id=req.previous_response_id,
            store=req.store, truncation=req.truncation or "disabled", user=req.user,
            prompt_cache_key=req.prompt_cache_key, safety_identifier=req.safety_identifier,
            service_tier=None if req.service_tier is None else "default")

    # ---- answering ---------------------------------------------------------------------------
    async def _whole(self, req: ResponsesRequest, run: ChatRun, skeleton: ResponseObject,
                     conv: Conversation) -> ResponseObject:
        """The finished reply, built by the same steps as the stream's (its events dropped),
        so that whole and streamed replies carry the same items and logprobs.
        Raises EngineDeadError when the engine dies meanwhile, RequestRefused when the engine
        core refused the request (its grammar did not compile in time)."""
        done: list[ResponseObject] = []
        async for _ in self._run(req, run, skeleton, conv, ResponseEvents(), done):
            pass
        return done[0]

    async def _events(self, req: ResponsesRequest, run: ChatRun, skeleton: ResponseObject,
                      conv: Conversation) -> AsyncIterator[Event]:
        events = ResponseEvents()
        try:
            async for event in self._run(req, run, skeleton, conv, events, []):
                yield event
        except (EngineDeadError, RequestRefused, RequestFailed) as e:
            error = engine_dead(e) if isinstance(e, EngineDeadError) else \
                refused(e, renamed(run.grammar_param, conv))
            yield events.event("error", code=error.code, message=str(error), param=error.param)

    async def _run(self, req: ResponsesRequest, run: ChatRun, skeleton: ResponseObject,
                   conv: Conversation, events: ResponseEvents, done: list[ResponseObject]
                   ) -> AsyncIterator[Event]:
        """The reply's events, from ``response.created`` to its last; the finished reply is
        appended to ``done``."""
        yield events.event("response.created", response=skeleton.model_dump())
        yield events.event("response.in_progress", response=skeleton.model_copy(
            update={"status": "in_progress"}).model_dump())
        state, num_generated, finish_reason = run.parser.stream_state(), 0, None
        # include_reasoning false (vLLM 0.32's): reasoning items and logprobs are left out;
        # the dropped reasoning still counts in usage's reasoning_tokens, as vLLM counts it
        hides, hidden = run.parser.hides_reasoning, []
        top = (req.top_logprobs or 0) if wants_logprobs(req) and not hides else None
        num_cached = 0
        # the counts as they stand (the locals it reads grow below): a cancel reads them
        events.usage = lambda: self._usage(events, len(run.prompt_ids), num_cached,
                                           num_generated, hidden)
        async for delta in run.streams[0]:
            num_cached = delta.metrics.num_cached_tokens
            for c in delta.outputs:
                num_generated += len(c.token_ids)
                finish_reason = c.finish_reason or finish_reason
                logprobs = [] if top is None else [
                    entry.model_dump() for entry in chat_logprobs(
                        c.token_ids, c.logprobs or [], top, self.chat.engine.tokenizer,
                        self.chat.config.return_tokens_as_token_ids).content]
                delta = state.update(c.text, c.finish_reason is not None)
                if hides and delta.reasoning:
                    hidden.append(delta.reasoning)
                    delta = dataclasses.replace(delta, reasoning="")
                for event in events.feed(delta, logprobs):
                    yield event
        usage = self._usage(events, len(run.prompt_ids), num_cached, num_generated, hidden)
        response, closing = self._finish(req, events, skeleton, conv, finish_reason, usage)
        done.append(response)
        for event in closing:
            yield event
        yield events.event(f"response.{response.status}", response=response.model_dump())

    def _usage(self, events: ResponseEvents, num_prompt: int, num_cached: int,
               num_generated: int, hidden: list[str]) -> ResponseUsage:
        """Token counts: ``num_cached`` of the ``num_prompt`` prompt tokens were prefix-cache
        hits; the reasoning text, the items' and the ``hidden`` one
        (``include_reasoning: false``), is re-tokenized for ``reasoning_tokens``."""
        reasoning = "".join(p["text"] for item in events.items if item["type"] == "reasoning"
                            for p in item["content"]) + "".join(hidden)
        return ResponseUsage(
            input_tokens=num_prompt, output_tokens=num_generated,
            total_tokens=num_prompt + num_generated,
            input_tokens_details=InputTokensDetails(cached_tokens=num_cached),
            output_tokens_details=OutputTokensDetails(
                reasoning_tokens=self._count_tokens(reasoning)))

    def _finish(self, req: ResponsesRequest, events: ResponseEvents, skeleton: ResponseObject,
                conv: Conversation, finish_reason: str | None, usage: ResponseUsage
                ) -> tuple[ResponseObject, list[Event]]:
        """Close the items, build the finished reply (``keeper.keep``: stored when ``req.store``, unless it
        was sent with the ``request_id`` of a background response that started meanwhile and
        still runs: that one keeps the id), and return it with the closing events."""
        status = "incomplete" if finish_reason == "length" else "completed"
        closing = events.finish(status)
        response = skeleton.model_copy(update={
            "status": status, "output": events.items, "usage": usage,
            "incomplete_details": {"reason": "max_output_tokens"}
            if status == "incomplete" else None})
        self.keeper.keep(req, response, _turns(conv))
        return response, closing

    def _count_tokens(self, text: str) -> int:
        if not text:
            return 0
        return len(self.chat.engine.tokenizer.encode(text, add_special_tokens=False))

    async def _sse(self, run: ChatRun, events: AsyncIterator[Event]) -> AsyncIterator[str]:
        """The events as SSE (``sse_lines``); always aborts the request when it ends (the
        client gone too)."""
        try:
            async for line in sse_lines(events):
                yield line
        finally:
            self.chat.abort(run.streams)
            await events.aclose()


def _chat_fields(req: ResponsesRequest) -> dict[str, Any]:
    """The request's ``CHAT_FIELDS`` as the chat request takes them (a nested request model
    as the JSON it came as)."""
    fields = {name: getattr(req, name) for name in CHAT_FIELDS}
    return {name: value.model_dump(by_alias=True, exclude_unset=True)
            if isinstance(value, BaseModel) else value for name, value in fields.items()}


def _turns(conv: Conversation) -> list[dict[str, Any]]:
    """The conversation's turns as stored for ``previous_response_id`` (its
    ``instructions`` dropped: OpenAI does not carry them over)."""
    return [m for m, path in zip(conv.messages, conv.paths, strict=True)
            if path != "instructions"]
