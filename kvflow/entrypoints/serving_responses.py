"""POST /v1/responses and GET /v1/responses/{id}: OpenAI's Responses API on top of the chat
handler. A request becomes a ``ChatCompletionRequest`` (``responses_input``: input items ->
messages, function tools, ``text.format`` -> ``response_format``), runs through
``OpenAIServingChat.start`` (the same checks, template, sampling, structured output and tool
parsing as /v1/chat/completions), and the chat parser's deltas become output items and
stream events (``responses_events``); an error the chat path finds names the Responses
field (``responses_errors``). Replies are kept in a bounded in-memory store when ``store`` is
true (``responses_store``), which also serves GET / DELETE /v1/responses/{id} and
/v1/responses/{id}/input_items. ``background`` runs a response as a server task
(``responses_background``): polled with GET, stopped with POST /v1/responses/{id}/cancel,
its stream (with ``stream``) followed again with GET ...?stream=true&starting_after=N."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Mapping
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
    ResponseDeleted,
    ResponseItemList,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
)
from kvflow.entrypoints.responses_background import TERMINAL, BackgroundResponses
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
from kvflow.entrypoints.responses_store import (
    ResponseStore,
    StoredResponse,
    item_page,
    output_messages,
)
from kvflow.entrypoints.serving_chat import ChatRun, OpenAIServingChat
from kvflow.entrypoints.streaming import SSEResponse
from kvflow.entrypoints.structured_requests import RequestFieldError
from kvflow.entrypoints.validation_errors import validation_error


class OpenAIServingResponses:
    """Handler of /v1/responses, running its requests through ``chat`` (the server's chat
    handler: same template, checks and parsers) and keeping replies in ``store``; background
    responses run in ``runs`` (call :meth:`shutdown` when the server stops)."""

    def __init__(self, chat: OpenAIServingChat, store: ResponseStore | None = None) -> None:
        self.chat = chat
        self.store = store if store is not None else ResponseStore()
        self.background = BackgroundResponses(self.store,
                                               lambda streams: self.chat.abort(streams))

    async def shutdown(self) -> None:
        """Cancel the running background responses (their engine requests aborted, each
        stored as ``cancelled``)."""
        await self.background.runs.shutdown()

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
        self._check_store(req)
        self.background.check(req)
        self._check_request_id(req)
        conv, chat_req = self._chat_request(req)
        try:
            run = await self.chat.start(chat_req, raw, "resp")
        except OpenAIError as e:
            raise renamed_error(e, conv) from None
        skeleton = self._skeleton(req, req.request_id or
                                  run.reply_id.replace("resp-", "resp_", 1))
        if req.background:
            try:  # another one of this id may have started while this one was rendered
                self._check_request_id(req)
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

    def _check_store(self, req: ResponsesRequest) -> None:
        """With the store off (capacity 0) a reply is not stored and says so (``store``
        false, as vLLM's does with its store off); a request that sent ``store: true``
        itself asks for what the server cannot do: a 400 naming ``store``."""
        if self.store.capacity == 0 and req.store:
            if "store" in req.model_fields_set:
                raise OpenAIError("store=true is not possible: this server keeps no replies "
                                  "(--responses-store-size 0); send store false or leave it "
                                  "out", param="store", code="unsupported_parameter")
            req.store = False

    def _check_request_id(self, req: ResponsesRequest) -> None:
        """A ``request_id`` (vLLM 0.32's: the response's id as sent) may name a stored reply
        that has ended (this one replaces it when stored, as vLLM's store replaces it), not a
        background one still running: GET, cancel and its stored stream would then name two
        responses.

        Raises:
            OpenAIError: 400 naming ``request_id`` for the id of a running background
                response.
        """
        if req.request_id is None:
            return
        stored = self.store.peek(req.request_id)
        if stored is not None and stored.response.status not in TERMINAL:
            raise OpenAIError(f"request_id {req.request_id[:100]!r} is the id of a background "
                              f"response still {stored.response.status}: cancel it or wait "
                              "until it ends, or send another id", param="request_id",
                              code="invalid_value")

    def retrieve(self, response_id: str) -> ResponseObject:
        """A stored reply (GET /v1/responses/{id}); a background one as it stands
        (``queued`` / ``in_progress`` while it runs, with the output generated so far).

        Raises:
            OpenAIError: 404 when no reply of that id is stored.
        """
        return self.background.current(self._stored(response_id))

    def follow(self, response_id: str, after: int) -> SSEResponse:
        """GET /v1/responses/{id}?stream=true&starting_after=N: a background streamed
        response's events after sequence number ``after`` (-1: all), then live ones until it
        ends.

        Raises:
            OpenAIError: 404 when no reply of that id is stored; 400 naming ``stream`` for
                one not created with ``background`` and ``stream`` true.
        """
        return self.background.follow(self._stored(response_id), after)

    async def cancel(self, response_id: str) -> ResponseObject:
        """POST /v1/responses/{id}/cancel: stop a running background response (its engine
        requests aborted) and return it ``cancelled``; one that has ended is returned as it
        is (a repeated cancel answers the same, OpenAI's rule).

        Raises:
            OpenAIError: 404 when no reply of that id is stored; 400 naming ``response_id``
                for one not created with ``background`` true.
        """
        await self.background.cancel(self._stored(response_id))
        return self._stored(response_id).response

    async def delete(self, response_id: str) -> ResponseDeleted:
        """Forget a stored reply (DELETE /v1/responses/{id}), cancelling it first if it runs
        in the background; a later GET, input_items or ``previous_response_id`` naming it is a
        404.

        Raises:
            OpenAIError: 404 when no reply of that id is stored.
        """
        self._stored(response_id)
        await self.background.runs.cancel(response_id)
        self.store.delete(response_id)
        return ResponseDeleted(id=response_id)

    def input_items(self, response_id: str, query: Mapping[str, list[str]]
                    ) -> ResponseItemList:
        """A page of a stored reply's input items (GET /v1/responses/{id}/input_items;
        ``query``: its query parameters' values, see ``responses_store.item_page``).

        Raises:
            OpenAIError: 404 when no reply of that id is stored, 400 naming a bad query
                parameter.
        """
        stored = self._stored(response_id)
        try:
            return item_page(stored.input_items, query)
        except RequestFieldError as e:
            raise OpenAIError(str(e), param=e.param, code=e.code) from None

    def _kept(self) -> str:
        if self.store.capacity == 0:
            return "this server keeps no replies: --responses-store-size 0"
        return (f"replies are kept in memory, the last {self.store.capacity} "
                "(--responses-store-size), when sent with store true")

    def _stored(self, response_id: str) -> StoredResponse:
        stored = self.store.get(response_id)
        if stored is None:
            raise OpenAIError(f"no response with id {response_id[:100]!r} is stored "
                              f"({self._kept()})", 404, "invalid_request_error",
                              code="response_not_found")
        return stored

    # ---- the chat request --------------------------------------------------------------------
    def _chat_request(self, req: ResponsesRequest
                      ) -> tuple[Conversation, ChatCompletionRequest]:
        earlier = self._earlier(req.previous_response_id)
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

    def _earlier(self, previous_response_id: str | None) -> list[dict[str, Any]]:
        if previous_response_id is None:
            return []
        stored = self.store.get(previous_response_id)
        if stored is None:
            raise OpenAIError(f"previous response {previous_response_id!r} is not stored "
                              f"({self._kept()})", 404, "invalid_request_error",
                              "previous_response_id", "previous_response_not_found")
        if stored.response.status not in TERMINAL:
            raise OpenAIError(f"previous response {previous_response_id!r} is still "
                              f"{stored.response.status} (background): wait until it ends",
                              param="previous_response_id", code="invalid_value")
        return stored.messages

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
        """Close the items, build the finished reply (stored when ``req.store``, unless it
        was sent with the ``request_id`` of a background response that started meanwhile and
        still runs: that one keeps the id), and return it with the closing events."""
        status = "incomplete" if finish_reason == "length" else "completed"
        closing = events.finish(status)
        response = skeleton.model_copy(update={
            "status": status, "output": events.items, "usage": usage,
            "incomplete_details": {"reason": "max_output_tokens"}
            if status == "incomplete" else None})
        earlier = self.store.peek(response.id)  # a background run's own: keeps its log
        if req.store and (req.background or earlier is None
                          or earlier.response.status in TERMINAL):
            self.store.put(StoredResponse(
                response, _turns(conv) + output_messages(events.items), input_items(req.input),
                earlier.log if earlier is not None and req.background else None))
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
