"""POST /v1/completions: prompts (text or token ids, one or many; embedding rows with
``--enable-prompt-embeds``) -> completions, streamed (SSE) or whole. Choice ``i * n + j`` is
sample ``j`` of prompt ``i``; ``prompt_embeds`` prompts come first, then ``prompt``'s.
``echo`` with ``max_tokens`` 0 returns each prompt alone (``completion_echo.py``)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from kvflow.engine.async_llm import RequestStream, collect
from kvflow.entrypoints.beam_requests import beam_params
from kvflow.entrypoints.completion_echo import check_echo_only, echo_only, prompt_only
from kvflow.entrypoints.completion_embeds import check_embeds_request, embeds_prompts
from kvflow.entrypoints.completion_logprobs import (
    completion_logprobs,
    prompt_logprobs_legacy,
    with_prompt,
)
from kvflow.entrypoints.completion_prompts import prompt_items, refuse_placeholders
from kvflow.entrypoints.openai_errors import OpenAIError
from kvflow.entrypoints.preprocess import off_loop
from kvflow.entrypoints.prompt_logprobs import cut_prompt_logprobs, vllm_prompt_logprobs
from kvflow.entrypoints.protocol import (
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    UsageInfo,
)
from kvflow.entrypoints.sampling_requests import (
    check_constraint,
    check_max_tokens,
    default_max_tokens,
    grammar_param,
    prompt_truncation,
    sampling_params,
)
from kvflow.entrypoints.serving_base import OpenAIServing, body_size, request_ids
from kvflow.entrypoints.serving_checks import check_token_ids
from kvflow.entrypoints.sse_keep_alive import with_keep_alive
from kvflow.entrypoints.streaming import SSEResponse, merge_streams
from kvflow.entrypoints.text_offsets import StreamedTokenOffsets, TokenTextOffsets
from kvflow.inputs.tokenization import cut_generation_prompt
from kvflow.lora.request import LoRARequest
from kvflow.outputs import CompletionOutput, RequestOutput
from kvflow.sampling_params import SamplingParams

Prompt = tuple[str | None, list[int]]  # (text if given as text, token ids)


class OpenAIServingCompletion(OpenAIServing):
    """Handler of /v1/completions (see OpenAIServing for the constructor)."""

    async def create_completion(self, req: CompletionRequest, raw: Request) -> Response:
        """Validate everything, queue every prompt, then answer.

        Raises:
            OpenAIError: 400 for bad input (a field kvflow does not declare included), 404
                for another model, 503 when overloaded.
        """
        self.check_fields(req, "/v1/completions")
        lora = self._check_request(req)
        await check_constraint(self.engine, req, None, body_size(raw))
        embeds = await embeds_prompts(self.engine, req)
        prompts = [(None, [0] * e.num_tokens) for e in embeds] + await self._prompts(req)
        listed = _is_prompt_list(req.prompt)
        embeds_listed = isinstance(req.prompt_embeds, list)
        params = [self._params(req, prompt, i if embeds_listed else None, "prompt_embeds")
                  for i, prompt in enumerate(prompts[:len(embeds)])] + \
            [self._params(req, prompt, i if listed else None)
             for i, prompt in enumerate(prompts[len(embeds):])]
        self.check_admission(len(prompts), n=req.n or 1)
        dp_rank = self.data_parallel_rank(raw)
        reply_id, request_id = request_ids("cmpl", req.request_id, raw)
        self.note_request(req, request_id)
        if req.use_beam_search:
            streams = self.start_beam_searches(
                request_id, prompts, params,
                [beam_params(req, sp) for sp in params], req.priority,
                self.client_id(req, raw), lora, req.skip_special_tokens, req.cache_salt,
                self.session_id(req, raw))
        else:
            streams = await self.add_requests(request_id, prompts, params, req.priority,
                                              client_id=self.client_id(req, raw),
                                              lora_request=lora, cache_salt=req.cache_salt,
                                              prompt_embeds=embeds, data_parallel_rank=dp_rank,
                                              session_id=self.session_id(req, raw))
        param = grammar_param(req, None)
        if req.stream:
            return SSEResponse(with_keep_alive(
                self.stream(streams, self._chunks(req, reply_id, prompts, streams, len(embeds)), param),
                self.config.sse_keep_alive_interval))
        return await self.respond(raw, streams, self._response(req, reply_id, prompts,
                                                                    streams, len(embeds)),
                                  param)

    def _check_request(self, req: CompletionRequest) -> LoRARequest | None:
        """Refuse what cannot be served; returns the LoRA adapter ``model`` names.

        Raises:
            OpenAIError: 404 for another model, 400 for an unsupported field value.
        """
        lora = self.check_model(req.model)
        self.check_task("generate")
        self.check_n(req.n)
        self.check_num_logprobs(req.logprobs, "logprobs")
        self.check_stream_options(req)
        self.check_unsupported(req)
        self.token_ids_default(req)
        self.check_num_logprobs(req.prompt_logprobs, "prompt_logprobs")
        if req.suffix:
            raise OpenAIError("suffix is not supported: kvflow does not do fill-in-the-middle "
                              "completion", param="suffix", code="unsupported_parameter")
        if req.prompt is None and req.prompt_embeds is None:
            raise OpenAIError("either prompt or prompt_embeds is required", param="prompt",
                              code="missing_required_parameter")
        if req.prompt_embeds is not None:
            check_embeds_request(self.engine, req)
        return lora

    async def _prompts(self, req: CompletionRequest) -> list[Prompt]:
        """The request's prompts as (text or None, token ids), in order; text is tokenized
        off the event loop when it is long (``preprocess.off_loop``). With
        ``truncate_prompt_tokens``, each keeps its last tokens (vLLM's rule; its text is then
        None: the echo and the output's prompt are the kept tokens' decoding); a text keeps
        the special tokens the tokenizer adds (a BOS) as well, as vLLM 0.32 cuts it without
        ``truncation_side`` (``tokenization_options.cut_generation_prompt``).

        Raises:
            OpenAIError: 400 for an empty prompt, a bad ``truncate_prompt_tokens``, or (code
                ``context_length_exceeded``) a text prompt whose prefix alone is longer than
                the context (not with ``truncate_prompt_tokens``).
        """
        if req.prompt is None:  # prompt_embeds only
            return []
        items = prompt_items(req.prompt)
        limit = prompt_truncation(self.engine, req)
        texts = [item for item in items if isinstance(item, str)]
        tokenizer = self.tokenizer if texts else None
        encoded = iter(await self.encode_texts(tokenizer, texts, req.add_special_tokens,
                                               "prompt", check_length=limit is None))
        out: list[Prompt] = [(item, next(encoded)) if isinstance(item, str)
                             else (None, list(item)) for item in items]
        if limit is not None:  # the last ``limit`` tokens; a cut text is no longer the prompt
            special = req.add_special_tokens and "truncation_side" not in req.unknown_values
            out = [(text, ids) if len(ids) <= limit else
                   (None, await off_loop(len(text or ""), cut_generation_prompt, tokenizer,
                                         text, ids, limit, special))
                   for text, ids in out]
        if self.engine.processor.mm_processor is not None:
            for text, ids in out:
                refuse_placeholders(self.engine.processor, text, ids)
        return out

    def _params(self, req: CompletionRequest, prompt: Prompt,
                index: int | None, field: str = "prompt") -> SamplingParams:
        """The sampling parameters of ``prompt`` (``index``: its place in the list of
        ``field``'s prompts, named by its errors as ``<field>.<index>``; None for a field's
        one prompt).

        Raises:
            OpenAIError: 400 for an invalid field or a prompt the context cannot take; a
                token id sent outside the vocabulary is named by its place, ``prompt.<j>``
                in the one prompt, ``prompt.<index>.<j>`` in a list (``check_token_ids``).
        """
        text, ids = prompt
        param = field if index is None else f"{field}.{index}"
        if text is None:
            check_token_ids(ids, self.engine.vocab_size, param)
        if req.max_tokens is None:  # unset or null: the model's default, else OpenAI's 16
            max_tokens = default_max_tokens(self.engine, len(ids), fallback=16)
        elif echo_only(req):  # the engine samples one token, which the reply leaves out
            check_echo_only(req)
            max_tokens = 1
        else:
            max_tokens = req.max_tokens
            check_max_tokens(max_tokens, "max_tokens", self.engine, hint=(
                "; 0 is taken only with echo, which returns the prompt alone"))
        params = sampling_params(self.engine, req, max_tokens, req.logprobs,
                                 reasoning=self.reasoning_token_ids,
                                 grammar_in_reasoning=self.grammar_in_reasoning)
        if req.echo and req.logprobs is not None:  # the echoed prompt carries logprobs too
            params.prompt_logprobs = max(req.logprobs, req.prompt_logprobs or 0)
        elif req.prompt_logprobs is not None:
            params.prompt_logprobs = req.prompt_logprobs
        try:  # vLLM's clamp: at most what the context leaves
            params.max_tokens = self.check_prompt(ids, max_tokens, param, params.min_tokens)
        except OpenAIError as e:
            if index is None or e.param == param:
                raise
            raise OpenAIError(f"{field} {index} of the list: {e}", param=e.param,
                              code=e.code) from None
        return params

    def _usage(self, prompts: list[Prompt], num_generated: int, num_cached: int) -> UsageInfo:
        """Prompt tokens count once per prompt, and so do their prefix-cache hits
        (``num_cached``, summed over the prompts: each prompt's are its first scheduled
        sample's; vLLM reports the last prompt's alone); completion tokens sum over every
        sample."""
        return self.usage(sum(len(ids) for _, ids in prompts), num_generated, num_cached)

    def _echo(self, req: CompletionRequest, prompt: Prompt) -> str:
        if not req.echo:
            return ""
        text, ids = prompt
        return text if text is not None else self.tokenizer.decode(ids)

    # ---- whole response ----------------------------------------------------------------------
    async def _response(self, req: CompletionRequest, request_id: str, prompts: list[Prompt],
                        streams: Sequence[RequestStream], num_embeds: int
                        ) -> CompletionResponse:
        choices, num_generated, num_cached = [], 0, 0
        for i, stream in enumerate(streams):
            out = await collect(stream)
            num_cached += out.metrics.num_cached_tokens
            echo = self._echo(req, prompts[i])
            for c in map(prompt_only, out.outputs) if echo_only(req) else out.outputs:
                num_generated += len(c.token_ids)
                offsets = [] if req.logprobs is None else self._offsets(
                    req, len(echo), _context(req, prompts, i, num_embeds)).next_offsets(
                        c.token_ids, len(echo + c.text))
                choice = self._choice(req, i * req.n + c.index, echo + c.text, c, offsets)
                if req.echo and choice.logprobs is not None:
                    echoed = await off_loop(len(prompts[i][1]), prompt_logprobs_legacy,
                                            self.tokenizer, prompts[i][1], out, echo,
                                            req.return_tokens_as_token_ids,
                                            req.logprobs)  # decodes all
                    choice.logprobs = with_prompt(echoed, choice.logprobs)
                if req.prompt_logprobs is not None:
                    choice.prompt_logprobs = vllm_prompt_logprobs(cut_prompt_logprobs(
                        out.prompt_logprobs, prompts[i][1], req.prompt_logprobs))
                choices.append(choice)
                if req.return_token_ids:
                    choices[-1].prompt_token_ids = prompts[i][1]
        return CompletionResponse(id=request_id, model=self.response_model(req.model), choices=choices,
                                  usage=self._usage(prompts, num_generated, num_cached))

    def _offsets(self, req: CompletionRequest, start: int,
                 context: Sequence[int]) -> TokenTextOffsets:
        """The text offsets of a choice's completion tokens, which start at ``start``;
        ``context``: the prompt ids its text was decoded after (see ``_context``)."""
        return TokenTextOffsets(self.engine.tokenizer, start, req.skip_special_tokens,
                                req.spaces_between_special_tokens, context)

    @staticmethod
    def _choice(req: CompletionRequest, index: int, text: str, c: CompletionOutput,
                text_offsets: list[int]) -> CompletionChoice:
        """One choice for (a delta of) a sample; ``text_offsets``: its tokens' text offsets
        (read only when the request asks for logprobs)."""
        logprobs = None
        if req.logprobs is not None:
            logprobs = completion_logprobs(c.token_ids, c.logprobs or [], text_offsets,
                                           req.return_tokens_as_token_ids)
        return CompletionChoice(index=index, text=text, logprobs=logprobs,
                                finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                                token_ids=c.token_ids if req.return_token_ids else None)

    def _release(self, req: CompletionRequest, c: CompletionOutput,
                 held: dict[int, StreamedTokenOffsets], index: int, start: int,
                 text_sent: int, context: Sequence[int]
                 ) -> tuple[CompletionOutput, list[int]]:
        """A streamed delta ``c`` of choice ``index`` with only the tokens (and logprobs)
        the stream may send now, and their text offsets: a token starting in text the stream
        still holds back waits for it (``StreamedTokenOffsets``). ``start``: the offset of
        the choice's first token; ``text_sent``: the choice's characters sent so far, this
        delta's included; ``context``: as ``_offsets``'."""
        if index not in held:
            held[index] = StreamedTokenOffsets(self._offsets(req, start, context))
        ids, entries, text_offsets = held[index].release(c.token_ids, c.logprobs or [],
                                                         text_sent, c.finished)
        return dataclasses.replace(c, token_ids=ids, logprobs=entries), text_offsets

    # ---- streaming ---------------------------------------------------------------------------
    async def _chunks(self, req: CompletionRequest, request_id: str, prompts: list[Prompt],
                      streams: Sequence[RequestStream], num_embeds: int) -> AsyncIterator[CompletionResponse]:
        created, num_generated = int(time.time()), 0
        cached: dict[int, int] = {}  # prompt index -> its prefix-cache hits, once known
        include_usage, continuous_usage = self.stream_usage(req)
        sent = _SentSoFar(prompts, num_embeds)
        async for i, delta in merge_streams(streams):
            if delta.prompt_logprobs is not None:
                sent.prompt_outputs[i] = delta
            cached[i] = delta.metrics.num_cached_tokens
            for c in map(prompt_only, delta.outputs) if echo_only(req) else delta.outputs:
                num_generated += len(c.token_ids)
                choice = await self._stream_choice(req, i, c, delta, sent)
                if choice is None:
                    continue  # text held back (partial character, stop-string prefix)
                usage = self._usage(prompts, num_generated, sum(cached.values())) \
                    if continuous_usage else None
                yield CompletionResponse(id=request_id, created=created, model=self.response_model(req.model),
                                         choices=[choice], usage=usage)
        if include_usage:
            yield CompletionResponse(id=request_id, created=created, model=self.response_model(req.model),
                                     choices=[], usage=self._usage(prompts, num_generated,
                                                                   sum(cached.values())))

    async def _stream_choice(self, req: CompletionRequest, i: int, c: CompletionOutput,
                             delta: RequestOutput, sent: _SentSoFar) -> CompletionChoice | None:
        """The chunk's choice for a streamed delta ``c`` of prompt ``i``'s output ``delta``;
        the first chunk sent for a choice carries the echo and the prompt's parts
        (``_add_prompt_parts``). None while there is nothing to send."""
        index = i * req.n + c.index
        first = index not in sent.choices
        echo = self._echo(req, sent.prompts[i]) if first else ""
        text = echo + c.text
        sent.chars[index] = sent.chars.get(index, 0) + len(text)
        text_offsets: list[int] = []
        if req.logprobs is not None:
            c, text_offsets = self._release(req, c, sent.offsets, index, len(echo),
                                            sent.chars[index],
                                            _context(req, sent.prompts, i, sent.num_embeds))
        want_tokens = req.logprobs is not None or req.return_token_ids
        if not text and c.finish_reason is None and not (want_tokens and c.token_ids):
            return None
        choice = self._choice(req, index, text, c, text_offsets)
        sent.choices.add(index)
        if first:
            await self._add_prompt_parts(req, choice, sent.prompts[i][1],
                                         sent.prompt_outputs.get(i, delta), echo)
        return choice

    async def _add_prompt_parts(self, req: CompletionRequest, choice: CompletionChoice,
                                ids: list[int], prompt_output: RequestOutput, echo: str) -> None:
        """A choice's first chunk's parts of its prompt (token ids ``ids``; its prompt
        logprobs in ``prompt_output``): the echoed prompt's logprobs, the prompt logprobs and
        (as vLLM) the prompt's token ids, each when the request asks for it."""
        if echo and choice.logprobs is not None:
            echoed = await off_loop(len(ids), prompt_logprobs_legacy, self.tokenizer, ids,
                                    prompt_output, echo, req.return_tokens_as_token_ids,
                                    req.logprobs)
            choice.logprobs = with_prompt(echoed, choice.logprobs)
        if req.prompt_logprobs is not None:
            choice.prompt_logprobs = vllm_prompt_logprobs(cut_prompt_logprobs(
                prompt_output.prompt_logprobs, ids, req.prompt_logprobs))
        if req.return_token_ids:
            choice.prompt_token_ids = ids


@dataclasses.dataclass
class _SentSoFar:
    """A completion stream's prompts and what it has sent of each choice (by choice index
    ``i * n + j``)."""

    prompts: list[Prompt]
    num_embeds: int  # the first prompts, given as embeddings (see ``_context``)
    offsets: dict[int, StreamedTokenOffsets] = dataclasses.field(default_factory=dict)
    chars: dict[int, int] = dataclasses.field(default_factory=dict)  # characters sent
    choices: set[int] = dataclasses.field(default_factory=set)  # first chunk sent
    # prompt index -> the delta that carried its prompt logprobs
    prompt_outputs: dict[int, RequestOutput] = dataclasses.field(default_factory=dict)


def _context(req: CompletionRequest, prompts: list[Prompt], index: int,
             num_embeds: int) -> list[int]:
    """The prompt ids prompt ``index``'s completion text was decoded after (the detokenizer
    decodes the first generated token in the prompt's context): none for a beam search
    (its text is a plain decode) or a prompt given as embeddings (the first ``num_embeds``
    prompts; their ids are placeholders)."""
    if req.use_beam_search or index < num_embeds:
        return []
    return prompts[index][1]


def _is_prompt_list(prompt: Any) -> bool:
    """Whether a completion request's ``prompt`` is a list of prompts (of strings or of
    token-id lists), not one prompt (a string or one list of token ids)."""
    return isinstance(prompt, list) and bool(prompt) and not isinstance(prompt[0], int)
