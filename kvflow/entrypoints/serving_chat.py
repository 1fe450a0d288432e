"""POST /v1/chat/completions: messages -> the model's chat template -> assistant replies,
streamed (SSE) or whole; and the conversation rendering that /tokenize shares."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import jinja2
from fastapi import Request
from fastapi.responses import Response

from kvflow.entrypoints.async_llm import RequestStream, collect
from kvflow.entrypoints.protocol import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    ChatLogprobs,
    ChatLogprobToken,
    ChatMessage,
    ChatResponseMessage,
    ChatStreamChoice,
    DeltaMessage,
    TopLogprob,
    UsageInfo,
)
from kvflow.entrypoints.serving_base import (
    MIN_LOGPROB,
    OpenAIError,
    OpenAIServing,
    SSEResponse,
    merge_streams,
    random_id,
)
from kvflow.outputs import CompletionOutput, Logprob
from kvflow.sampling_params import SamplingParams


class OpenAIServingChat(OpenAIServing):
    """Handler of /v1/chat/completions (see OpenAIServing for the constructor)."""

    async def create_chat_completion(self, req: ChatCompletionRequest, raw: Request) -> Response:
        """Validate, render the conversation, queue it, then answer.

        Raises:
            OpenAIError: 400 for bad input, 404 for another model, 503 when overloaded.
        """
        self._check_request(req)
        text, ids = self.render(req.messages, req.add_generation_prompt,
                                req.chat_template_kwargs)
        params = self._params(req, ids)
        self.check_admission(1)
        request_id = random_id("chatcmpl")
        streams = self.add_requests(request_id, [(text, ids)], [params])
        if req.stream:
            return SSEResponse(self.stream(streams, self._chunks(req, request_id, ids,
                                                                 streams)))
        return await self.respond(raw, streams, self._response(req, request_id, ids,
                                                               streams[0]))

    def _check_request(self, req: ChatCompletionRequest) -> None:
        self.check_model(req.model)
        self.check_n(req.n)
        self.check_stream_options(req)
        if req.top_logprobs is not None and not req.logprobs:
            raise OpenAIError("top_logprobs needs logprobs=true", param="top_logprobs")
        self.check_num_logprobs(req.top_logprobs, "top_logprobs")

    def render(self, messages: list[ChatMessage], add_generation_prompt: bool,
               template_kwargs: dict[str, Any] | None) -> tuple[str, list[int]]:
        """Apply the chat template; returns (prompt text, token ids).

        Raises:
            OpenAIError: 400 for non-text content, a model without a chat template, or a
                conversation the template rejects.
        """
        conversation = [_message_dict(m, i) for i, m in enumerate(messages)]
        tokenizer = self.tokenizer
        try:
            text = self.engine.processor.apply_chat_template(
                conversation, add_generation_prompt, **(template_kwargs or {}))
        except (ValueError, TypeError, jinja2.TemplateError) as e:
            raise OpenAIError(f"cannot apply the chat template: {e}", param="messages") \
                from None
        return text, tokenizer.encode(text, add_special_tokens=False)

    def _params(self, req: ChatCompletionRequest, ids: list[int]) -> SamplingParams:
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None \
            else req.max_tokens
        if max_tokens is None:  # as much as the context leaves
            max_tokens = max(1, self.engine.max_model_len - len(ids))
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = self.sampling_params(req, max_tokens, logprobs)
        self.check_prompt(ids, max_tokens, "messages")
        return params

    # ---- whole response ----------------------------------------------------------------------
    async def _response(self, req: ChatCompletionRequest, request_id: str, ids: list[int],
                        stream: RequestStream) -> ChatCompletionResponse:
        out = await collect(stream)
        choices = [ChatChoice(index=c.index, message=ChatResponseMessage(content=c.text),
                              **self._choice_extras(req, c)) for c in out.outputs]
        num_generated = sum(len(c.token_ids) for c in out.outputs)
        return ChatCompletionResponse(
            id=request_id, model=self.model_name, choices=choices,
            usage=_usage(len(ids), num_generated),
            prompt_token_ids=ids if req.return_token_ids else None)

    @staticmethod
    def _choice_extras(req: ChatCompletionRequest, c: CompletionOutput) -> dict[str, Any]:
        return {"logprobs": chat_logprobs(c.token_ids, c.logprobs or [], req.top_logprobs or 0)
                if req.logprobs else None,
                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                "token_ids": c.token_ids if req.return_token_ids else None}

    # ---- streaming ---------------------------------------------------------------------------
    async def _chunks(self, req: ChatCompletionRequest, request_id: str, ids: list[int],
                      streams: Sequence[RequestStream]
                      ) -> AsyncIterator[ChatCompletionStreamResponse]:
        created, num_generated = int(time.time()), 0

        def chunk(choices: list[ChatStreamChoice], usage: UsageInfo | None = None):
            return ChatCompletionStreamResponse(id=request_id, created=created,
                                                model=self.model_name, choices=choices,
                                                usage=usage)

        yield chunk([ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))
                     for i in range(req.n)])
        want_tokens = req.logprobs or req.return_token_ids
        async for _, delta in merge_streams(streams):
            for c in delta.outputs:
                num_generated += len(c.token_ids)
                if not c.text and c.finish_reason is None and not (want_tokens and c.token_ids):
                    continue  # text held back (partial character, stop-string prefix)
                yield chunk([ChatStreamChoice(index=c.index, delta=DeltaMessage(content=c.text),
                                              **self._choice_extras(req, c))])
        if req.stream_options is not None and req.stream_options.include_usage:
            yield chunk([], _usage(len(ids), num_generated))


def _message_dict(message: ChatMessage, position: int) -> dict[str, Any]:
    """A message as the template sees it; list content is joined from its text parts.
    Raises OpenAIError for non-text parts."""
    data = message.model_dump(exclude_none=True)
    if isinstance(message.content, list):
        parts = []
        for part in message.content:
            if part.type != "text" or part.text is None:
                raise OpenAIError(f"message {position}: content part of type {part.type!r} is "
                                  "not supported (text only)", param=f"messages.{position}")
            parts.append(part.text)
        data["content"] = "".join(parts)
    return data


def _usage(num_prompt: int, num_generated: int) -> UsageInfo:
    return UsageInfo(prompt_tokens=num_prompt, completion_tokens=num_generated,
                     total_tokens=num_prompt + num_generated)


def chat_logprobs(token_ids: list[int], logprobs: list[dict[int, Logprob]],
                  top_k: int) -> ChatLogprobs:
    """Chat-format logprobs: per token its logprob, UTF-8 bytes and the ``top_k`` best."""
    content = []
    for token_id, step in zip(token_ids, logprobs):
        sampled = step[token_id]
        top = sorted((lp for lp in step.values() if lp.rank <= top_k), key=lambda lp: lp.rank)
        content.append(ChatLogprobToken(
            **_top(sampled), top_logprobs=[TopLogprob(**_top(lp)) for lp in top[:top_k]]))
    return ChatLogprobs(content=content)


def _top(lp: Logprob) -> dict[str, Any]:
    token = lp.decoded_token or ""
    return {"token": token, "logprob": max(lp.logprob, MIN_LOGPROB),
            "bytes": list(token.encode("utf-8"))}
