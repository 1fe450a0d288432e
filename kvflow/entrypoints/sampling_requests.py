"""SamplingParams from an OpenAI request (/v1/completions and /v1/chat/completions): the
``max_tokens`` of a request that leaves it unset, the check of one that sets it, and the
request's fields copied over with its output constraint; every refusal is an OpenAI 400
naming the field."""

from __future__ import annotations

import re

from kvflow.engine.async_llm import AsyncLLM
from kvflow.entrypoints.openai_errors import OpenAIError, invalid_request
from kvflow.entrypoints.preprocess import INLINE_CHARS, off_loop
from kvflow.entrypoints.protocol import SamplingRequest
from kvflow.entrypoints.structured_requests import (
    RequestFieldError,
    constraint_param,
    request_constraint,
)
from kvflow.inputs.truncation import truncation_length
from kvflow.sampling.repetition_detection import RepetitionDetectionParams
from kvflow.sampling_params import SamplingParams
from kvflow.structured import StructuredOutputsParams
from kvflow.thinking_budget import ReasoningTokenIds

# Request fields that map 1:1 onto SamplingParams (the optional ones only when set).
_COPIED_FIELDS = ("n", "seed", "min_tokens", "ignore_eos", "skip_special_tokens",
                  "spaces_between_special_tokens", "include_stop_str_in_output", "logit_bias",
                  "allowed_token_ids", "bad_words", "truncate_prompt_tokens",
                  "logprob_token_ids")
# a structural tag's error names the field inside the tag first (structural_tag.py)
_TAG_FIELD = re.compile(r"invalid structural tag in structured_outputs: "
                        r"((?:structures|triggers|format)(?:\.\w+)*): ")
_OPTIONAL_FIELDS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty",
                    "frequency_penalty", "repetition_penalty", "target_ttft_ms",
                    "target_tpot_ms", "stream_interval")


def default_max_tokens(engine: AsyncLLM, num_prompt_tokens: int,
                       fallback: int | None = None) -> int:
    """``max_tokens`` of a request that does not set it: the model's default
    (``max_new_tokens`` in its generation_config.json), else ``fallback`` (completions:
    OpenAI's 16), capped at what the context leaves (as vLLM does: the request never asked
    for that length), else everything the context leaves."""
    left = max(1, engine.max_model_len - num_prompt_tokens)
    default = engine.sampling_defaults.get("max_tokens")
    default = fallback if default is None else default
    return left if default is None else min(default, left)


def prompt_truncation(engine: AsyncLLM, req: SamplingRequest) -> int | None:
    """How many prompt tokens ``req`` keeps (its last ones): ``truncate_prompt_tokens`` as
    vLLM reads it for generation (-1: ``max_model_len - 1``), None when it is unset (never cut).

    Raises:
        OpenAIError: 400 naming ``truncate_prompt_tokens`` (code ``invalid_value``) for 0, a
            value below -1 or one above ``max_model_len``.
    """
    try:
        return truncation_length(req.truncate_prompt_tokens, engine.max_model_len,
                                 generation=True)
    except ValueError as e:
        raise OpenAIError(str(e), param="truncate_prompt_tokens", code="invalid_value") from None


def check_max_tokens(max_tokens: int, param: str, engine: AsyncLLM | None = None,
                     hint: str = "") -> None:
    """Refuse a request for fewer than one generated token, or (given the ``engine``) for
    more than its ``max_model_len``, as vLLM 0.32 refuses it whatever the prompt (a
    smaller one is clamped to what the prompt leaves: ``check_prompt``); ``param`` names
    the field the request set (``max_tokens`` or chat's ``max_completion_tokens``);
    ``hint``, when given, ends the below-1 message (the endpoint's exception to the rule).

    Raises:
        OpenAIError: 400 naming ``param``, code ``integer_below_min_value`` (the OpenAI
            API's), if ``max_tokens`` is below 1; code ``integer_above_max_value`` if it
            is above ``engine.max_model_len``.
    """
    if max_tokens < 1:
        raise OpenAIError(f"{param}={max_tokens} is invalid: it must be >= 1 (the most "
                          f"tokens to generate){hint}", param=param,
                          code="integer_below_min_value")
    if engine is not None and max_tokens > engine.max_model_len:
        raise OpenAIError(
            f"{param}={max_tokens} cannot be greater than this model's maximum context "
            f"length of {engine.max_model_len} tokens{engine.processor.max_model_len_note}: "
            "request fewer output tokens", param=param, code="integer_above_max_value")


def sampling_params(engine: AsyncLLM, req: SamplingRequest, max_tokens: int,
                    logprobs: int | None,
                    structured_outputs: StructuredOutputsParams | None = None,
                    reasoning: ReasoningTokenIds | None = None,
                    grammar_in_reasoning: bool = False) -> SamplingParams:
    """SamplingParams from the request's fields, checked by ``engine``'s processor;
    ``structured_outputs`` (a tool-call grammar) is one more constraint: with the request's
    own ``response_format`` / ``structured_outputs`` / ``guided_*`` it is a 400 (one
    constraint only). Optional fields the request leaves unset (or null) are not passed, so
    the model's sampling defaults fill them when the request is queued. ``reasoning``: the
    server's ``--reasoning-parser`` markers, which a ``thinking_token_budget`` needs; a
    constrained request carries them too (its grammar then starts after the reasoning end
    marker, as vLLM's does with a reasoning parser), unless ``grammar_in_reasoning``
    (``--structured-outputs-config '{"enable_in_reasoning": true}'``): the grammar then
    applies from the first token, and a budget still forces the end marker where the
    grammar allows it (``SamplingParams.grammar_in_reasoning``).

    Raises:
        OpenAIError: 400 when invalid (a malformed schema or regex too; ``logprob_token_ids``
            without logprobs); a ``logit_bias`` of
            more entries than the model's vocabulary has tokens (code
            ``array_above_max_length``: they cannot all name a token) before any is read; a
            ``thinking_token_budget`` without ``reasoning`` markers (code
            ``unsupported_parameter``).
    """
    _check_logit_bias(engine, req)
    fields = _request_fields(req, max_tokens, logprobs, structured_outputs)
    if req.repetition_detection is not None:
        fields["repetition_detection"] = repetition_detection(req)
    fields.update(_extra_args(engine, req))
    fields.update(_thinking_budget(req, reasoning))
    if reasoning is not None and fields["structured_outputs"] is not None:
        if grammar_in_reasoning:  # the grammar from the first token; markers: the budget's
            fields["grammar_in_reasoning"] = "reasoning_token_ids" in fields
        else:  # the grammar starts after the reasoning (structured/reasoning_gate.py)
            fields["reasoning_token_ids"] = reasoning
    try:
        params = SamplingParams(**fields)
        engine.processor.validate_params(params)
    except ValueError as e:
        raise _params_error(e, req, structured_outputs) from None
    return params


def _check_logit_bias(engine: AsyncLLM, req: SamplingRequest) -> None:
    """Refuse a ``logit_bias`` of more entries than the model's vocabulary has tokens before
    any entry is read (they cannot all name a token).

    Raises:
        OpenAIError: 400 naming ``logit_bias`` (code ``array_above_max_length``).
    """
    if req.logit_bias and len(req.logit_bias) > engine.processor.vocab_size:
        raise OpenAIError(f"logit_bias holds {len(req.logit_bias)} entries, more than this "
                          f"model's vocabulary of {engine.processor.vocab_size} tokens (each "
                          "names a different token id)", param="logit_bias",
                          code="array_above_max_length")


def _request_fields(req: SamplingRequest, max_tokens: int, logprobs: int | None,
                    structured_outputs: StructuredOutputsParams | None) -> dict[str, object]:
    """The SamplingParams fields the request's own fields give: its output constraint (or
    ``structured_outputs``, the tool grammar), the fields copied 1:1 (the optional ones only
    when set), ``max_tokens``, ``logprobs``, ``stop`` and ``stop_token_ids`` as lists.

    Raises:
        OpenAIError: 400 naming the field for two constraints at once (code
            ``invalid_value``); ``logprob_token_ids`` without logprobs (code
            ``invalid_parameter_combination``).
    """
    try:
        fields = {"structured_outputs": request_constraint(req, structured_outputs)}
    except RequestFieldError as e:
        raise OpenAIError(str(e), param=e.param, code="invalid_value") from None
    fields.update({name: getattr(req, name) for name in _COPIED_FIELDS})
    fields.update({name: getattr(req, name) for name in _OPTIONAL_FIELDS
                   if getattr(req, name) is not None})
    fields.update(max_tokens=max_tokens, logprobs=logprobs,
                  stop=[req.stop] if isinstance(req.stop, str) else list(req.stop or []),
                  stop_token_ids=list(req.stop_token_ids or []))
    if req.logprob_token_ids is not None and logprobs is None:
        raise OpenAIError("logprob_token_ids needs logprobs (true on /v1/chat/completions, a "
                          "count on /v1/completions): the listed tokens' logprobs are given "
                          "in place of the top ones", param="logprob_token_ids",
                          code="invalid_parameter_combination")
    return fields


def _extra_args(engine: AsyncLLM, req: SamplingRequest) -> dict[str, object]:
    """The SamplingParams ``extra_args`` of the request's ``vllm_xargs`` (none when unset or
    empty), which only custom logits processors read.

    Raises:
        OpenAIError: 400 naming ``vllm_xargs`` (code ``unsupported_parameter``) when the
            server runs no custom logits processors (nothing would read them).
    """
    if not req.vllm_xargs:
        return {}
    if not engine.processor.logits_processors:  # nothing would read them
        raise OpenAIError("vllm_xargs is read only by custom logits processors, and this "
                          "server runs none (start it with --logits-processors), so it "
                          "would be ignored: leave it out", param="vllm_xargs",
                          code="unsupported_parameter")
    return {"extra_args": dict(req.vllm_xargs)}


def _thinking_budget(req: SamplingRequest, reasoning: ReasoningTokenIds | None
                     ) -> dict[str, object]:
    """The SamplingParams fields of the request's ``thinking_token_budget`` (none when it is
    unset, null or -1: unlimited).

    Raises:
        OpenAIError: 400 naming ``thinking_token_budget`` (code ``unsupported_parameter``)
            when the server has no reasoning markers (vLLM 0.32 refuses a budget without a
            reasoning parser).
    """
    budget = req.thinking_token_budget
    if budget is None or budget == -1:
        return {}
    if reasoning is None:
        raise OpenAIError("thinking_token_budget needs the model's reasoning markers: start "
                          "the server with a --reasoning-parser that names them (think, "
                          "qwen3, deepseek_r1, ...; granite and hunyuan_a13b name none) or "
                          "--reasoning-config, or send -1 or leave it out", param="thinking_token_budget",
                          code="unsupported_parameter")
    return {"thinking_token_budget": budget, "reasoning_token_ids": reasoning}


def repetition_detection(req: SamplingRequest) -> RepetitionDetectionParams:
    """The request's ``repetition_detection`` as SamplingParams takes it.

    Raises:
        OpenAIError: 400 naming ``repetition_detection.<field>`` (code ``invalid_value``)
            for ``min_pattern_size`` > ``max_pattern_size``, or ``min_count`` < 2 with
            ``max_pattern_size`` > 0 (vLLM's rules).
    """
    fields = req.repetition_detection.model_dump()
    try:
        return RepetitionDetectionParams(**fields)
    except ValueError as e:
        name = str(e).split("=", 1)[0]  # "repetition_detection.min_count=1 is invalid..."
        raise OpenAIError(str(e), param=name, code="invalid_value") from None


async def check_constraint(engine: AsyncLLM, req: SamplingRequest,
                           tool_grammar: StructuredOutputsParams | None, size: int | None
                           ) -> None:
    """Check the request's output constraint (``request_constraint``: its own, or the tool
    grammar of tool_choice ``required`` / a named function) before it is queued: converted
    to a grammar in a worker thread when the body is large (``size``: its bytes, None for
    unknown: large), inline otherwise (``preprocess.off_loop``). A large schema takes
    hundreds of ms to convert (2,048 small tools: ~0.2 s), which on the event loop would
    stall every other client; once checked here, :func:`sampling_params` and the engine's
    own check find it done (``InputProcessor.check_structured``).

    Raises:
        OpenAIError: 400 naming the field for two constraints at once or a malformed schema,
            regex or grammar (``tools`` for the tool grammar).
    """
    try:
        constraint = request_constraint(req, tool_grammar)
    except RequestFieldError as e:
        raise OpenAIError(str(e), param=e.param, code="invalid_value") from None
    if constraint is None:
        return
    try:
        await off_loop(INLINE_CHARS + 1 if size is None else size,
                       engine.processor.check_structured, constraint)
    except ValueError as e:
        raise _params_error(e, req, tool_grammar) from None


def _params_error(error: ValueError, req: SamplingRequest,
                  tool_grammar: StructuredOutputsParams | None) -> OpenAIError:
    """The 400 for parameters the engine's processor refused; a constraint that did not
    compile is named, in the message and as ``param``, by the field it came from
    (``guided_regex``, ``structured_outputs.grammar``, ``response_format.json_schema.schema``;
    ``tools`` for the tool grammar), not the engine's ``structured_outputs``; a structural
    tag's error in ``response_format`` by the field inside it
    (``response_format.structures.0.schema``)."""
    if " in structured_outputs" not in str(error):
        return invalid_request(error)
    param = grammar_param(req, tool_grammar)
    inner = _TAG_FIELD.search(str(error))
    if inner is not None and param == "response_format":  # its fields are the tag's
        param = f"response_format.{inner[1]}"
    return OpenAIError(str(error).replace(" in structured_outputs", f" in {param}", 1),
                       param=param, code="invalid_value")


def grammar_param(req: SamplingRequest,
                  tool_grammar: StructuredOutputsParams | None) -> str | None:
    """The request field that holds the request's grammar, as errors about its compile name
    it: ``tools`` for the tool grammar, else :func:`constraint_param` (None without one)."""
    return "tools" if tool_grammar is not None else constraint_param(req)


def check_length_fields(max_tokens: int | None, max_completion_tokens: int | None) -> None:
    """Both of chat's length fields (``max_tokens``, ``max_completion_tokens``) may be sent
    only with the same value (then both are honoured). OpenAI refuses the pair outright;
    vLLM takes ``max_completion_tokens`` and drops ``max_tokens`` unread, which would ignore
    a field the client set.

    Raises:
        OpenAIError: 400 naming both (``param`` ``max_tokens``, as OpenAI's; code
            ``invalid_parameter_combination``) when they differ.
    """
    if None in (max_tokens, max_completion_tokens) or max_tokens == max_completion_tokens:
        return
    raise OpenAIError(f"max_tokens={max_tokens} and max_completion_tokens="
                      f"{max_completion_tokens} set different limits: send one of them "
                      "(max_completion_tokens replaces max_tokens in OpenAI's chat API), or "
                      "both with the same value", param="max_tokens",
                      code="invalid_parameter_combination")
