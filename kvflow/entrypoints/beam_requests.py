"""``use_beam_search`` on /v1/completions and /v1/chat/completions (vLLM's fields: ``n`` is
the beam width and the number of beams returned, ``length_penalty``, ``ignore_eos``,
``include_stop_str_in_output``). The search is ``kvflow.beam_search.beam_search_async``;
this module checks a request for it (every field the search would not honour is a 400
naming it) and runs one search per prompt as an asyncio task whose result is one finished
``RequestOutput`` on an ordinary ``RequestStream``, so the handlers build replies from it as
from a sampled request. Cancelling the task (the client went away) aborts its step
requests."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from kvflow.beam_search import beam_search_async
from kvflow.beam_search_params import MAX_BEAM_WIDTH, BeamSearchParams
from kvflow.engine.async_llm import AdmissionRejected, AsyncLLM, RequestStream
from kvflow.entrypoints.openai_errors import OpenAIError, invalid_request
from kvflow.entrypoints.protocol import ChatCompletionRequest, SamplingRequest
from kvflow.lora.request import LoRARequest
from kvflow.outputs import Logprob, RequestOutput
from kvflow.sampling_params import SamplingParams

_CANDIDATES = "beam search considers the 2 * n most likely tokens of each beam"
_RAW = "beam search ranks the model's own, unpenalized and unbiased logprobs"
_STOPS = "beam search ends beams at EOS or max_tokens only"
_STRUCTURED = "structured output is not supported with beam search"
_TARGETS = ("a beam search runs as one-token requests per beam and step, which a service-level "
            "target for one request does not fit")
_BEAM_TEXT = ("a beam's text is the tokenizer's decode of its tokens (send true or leave it "
              "out)")

# request field -> (its values that ask for nothing beam search ignores, why it is refused)
_SAMPLING_ONLY = {
    "temperature": ((None, 0), _RAW + " (send 0 or leave it out)"),
    "top_p": ((None, 1), _CANDIDATES), "top_k": ((None, 0, -1), _CANDIDATES),
    "min_p": ((None, 0), _CANDIDATES),
    "presence_penalty": ((None, 0), _RAW), "frequency_penalty": ((None, 0), _RAW),
    "repetition_penalty": ((None, 1), _RAW), "logit_bias": ((None, {}), _RAW),
    "allowed_token_ids": ((None,), _RAW), "bad_words": ((None, []), _RAW),
    "stop": ((None, "", []), _STOPS), "stop_token_ids": ((None, []), _STOPS),
    "min_tokens": ((0,), _STOPS), "repetition_detection": ((None,), _STOPS),
    "logprob_token_ids": ((None,), "beam search reports each beam token's top logprobs"),
    "structured_outputs": ((None,), _STRUCTURED), "guided_json": ((None,), _STRUCTURED),
    "guided_regex": ((None,), _STRUCTURED), "guided_choice": ((None,), _STRUCTURED),
    "guided_grammar": ((None,), _STRUCTURED),
    "target_ttft_ms": ((None,), _TARGETS), "target_tpot_ms": ((None,), _TARGETS),
    "prompt_logprobs": ((None,), "prompt logprobs are not returned with beam search"),
    "echo": ((None, False), "the prompt is not echoed with beam search"),  # completions'
    "vllm_xargs": ((None, {}),
                   "beam search does not pass custom arguments to custom logits processors"),
    "spaces_between_special_tokens": ((True,), _BEAM_TEXT),
    "thinking_token_budget": ((None, -1), ("beam search does not force the end of a "
                                           "think block (send -1 or leave it out)")),
}
# chat's echo prepends the last message's text to each reply (serving_chat.echo_text), a
# beam's included, as vLLM's chat does
_CHAT_HONOURS = frozenset({"echo"})


def check_beam_request(req: SamplingRequest) -> bool:
    """Whether ``req`` asks for beam search; refuses what beam search would not honour.

    Raises:
        OpenAIError: 400 naming the field: ``length_penalty`` other than 1 without
            ``use_beam_search`` (it applies to beam search only); with it, ``n`` above
            ``MAX_BEAM_WIDTH``, any sampling, stop, penalty, structured-output or
            service-level (``target_ttft_ms`` / ``target_tpot_ms``) field or a
            ``thinking_token_budget`` set to something beam search would ignore, ``response_format`` other than
            ``text``, or ``echo`` (on /v1/completions; chat's is honoured). With ``stream`` the reply comes as one chunk per beam when the
            search ends (vLLM's behaviour: beams change until the last step).
    """
    if not req.use_beam_search:
        if req.length_penalty != 1:
            raise OpenAIError(f"length_penalty={req.length_penalty} applies to beam search "
                              "only (send use_beam_search: true, or leave it out)",
                              param="length_penalty", code="unsupported_value")
        return False
    if req.n > MAX_BEAM_WIDTH:
        raise OpenAIError(f"n={req.n} (the beam width) is above kvflow's beam search limit "
                          f"of {MAX_BEAM_WIDTH}", param="n", code="integer_above_max_value")
    for name, (harmless, why) in _SAMPLING_ONLY.items():
        value = getattr(req, name, None)
        if name in _CHAT_HONOURS and isinstance(req, ChatCompletionRequest):
            continue
        if value not in harmless:
            raise OpenAIError(f"{_shown(name, value)} cannot be used with use_beam_search: "
                              f"{why}", param=name, code="unsupported_value")
    if req.response_format is not None and req.response_format.type != "text":
        raise OpenAIError("response_format cannot be used with use_beam_search: structured "
                          "output is not supported with beam search",
                          param="response_format", code="unsupported_value")
    return True


def _shown(name: str, value: object) -> str:
    """A refused field as its error names it: ``name=value`` for a number, a bool or a
    string of up to 40 characters, the name alone for a longer string (a grammar), a list, an
    object or a model (a schema, ``structured_outputs``, thousands of ``allowed_token_ids``:
    its repr would be long, and a model's repr names Python fields, not the request's)."""
    if isinstance(value, (bool, int, float)) or isinstance(value, str) and len(value) <= 40:
        return f"{name}={value!r}"
    return name


def beam_params(req: SamplingRequest, params: SamplingParams) -> BeamSearchParams:
    """The search's parameters: ``n`` beams, ``params.max_tokens`` (the request's or the
    server's default), the request's ``ignore_eos``, ``length_penalty``,
    ``include_stop_str_in_output`` and ``skip_special_tokens``.

    Raises:
        OpenAIError: 400 naming ``length_penalty`` when it is not finite.
    """
    try:
        return BeamSearchParams(beam_width=req.n, max_tokens=params.max_tokens,
                                ignore_eos=req.ignore_eos, length_penalty=req.length_penalty,
                                include_stop_str_in_output=req.include_stop_str_in_output,
                                skip_special_tokens=req.skip_special_tokens)
    except ValueError as e:
        raise OpenAIError(str(e).replace("BeamSearchParams.", ""), param="length_penalty",
                          code="invalid_value") from None


class BeamSearches:
    """The server's running beam searches (one asyncio task per prompt), so that aborting a
    stream (``OpenAIServing.abort``) cancels the task that feeds it."""

    def __init__(self) -> None:
        self.tasks: dict[str, asyncio.Task] = {}

    def start(self, engine: AsyncLLM, request_id: str,
              prompts: Sequence[tuple[str | None, list[int]]],
              params: Sequence[SamplingParams], beam: Sequence[BeamSearchParams],
              priority: int, client_id: str, lora_request: LoRARequest | None,
              skip_special_tokens: bool, cache_salt: str | None = None,
              session_id: str | None = None) -> list[RequestStream]:
        """Start one search per prompt (ids ``{request_id}-{i}``, as ``add_requests``
        names them); each stream yields one finished RequestOutput (its logprobs cut to
        ``params[i].logprobs`` per token, the chosen token kept) or raises OpenAIError (a
        400 for input the engine refuses, a 503 when admission control refuses a step);
        ``session_id`` goes into the KV cache events of its step requests' blocks."""
        streams = []
        for i, ((text, ids), sp, bp) in enumerate(zip(prompts, params, beam)):
            stream = RequestStream(f"{request_id}-{i}")
            task = asyncio.create_task(self._run(
                engine, stream, text, ids, bp, sp.logprobs, priority, client_id,
                lora_request, skip_special_tokens, cache_salt, session_id))
            self.tasks[stream.request_id] = task
            task.add_done_callback(lambda _, rid=stream.request_id: self.tasks.pop(rid, None))
            streams.append(stream)
        return streams

    def cancel(self, request_id: str) -> None:
        """Cancel the search feeding ``request_id``'s stream (no-op when none runs)."""
        task = self.tasks.pop(request_id, None)
        if task is not None:
            task.cancel()

    @staticmethod
    async def _run(engine: AsyncLLM, stream: RequestStream, text: str | None, ids: list[int],
                   beam: BeamSearchParams, num_logprobs: int | None, priority: int,
                   client_id: str, lora_request: LoRARequest | None,
                   skip_special_tokens: bool, cache_salt: str | None,
                   session_id: str | None) -> None:
        try:
            out = await beam_search_async(engine, stream.request_id, ids, beam,
                                          priority=priority, client_id=client_id,
                                          lora_request=lora_request,
                                          skip_special_tokens=skip_special_tokens,
                                          cache_salt=cache_salt,
                                          num_logprobs=num_logprobs or 0,
                                          session_id=session_id)
        except ValueError as e:
            stream.put(invalid_request(e))
        except AdmissionRejected as e:
            stream.put(OpenAIError(str(e), 503, "server_overloaded", code="ttft_unattainable",
                                   headers={"Retry-After": str(int(e.retry_after_s))}))
        except Exception as e:  # noqa: BLE001 (the handler awaiting the stream raises it)
            stream.put(e)
        else:
            out.prompt = text
            stream.put(_cut_logprobs(out, num_logprobs))


def _cut_logprobs(out: RequestOutput, num_logprobs: int | None) -> RequestOutput:
    """Each token's logprobs cut to the ``num_logprobs`` most likely plus the token itself
    (None when the request asked for none)."""
    for c in out.outputs:
        if num_logprobs is None:
            c.logprobs = None
            continue
        c.logprobs = [_top(step, token, num_logprobs)
                      for step, token in zip(c.logprobs or [], c.token_ids)]
    return out


def _top(step: dict[int, Logprob], token: int, k: int) -> dict[int, Logprob]:
    return {t: lp for t, lp in step.items() if lp.rank <= k or t == token}
