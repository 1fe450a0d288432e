"""Beam search above the engine, the way vLLM v1 runs it (``vllm/beam_search.py``,
``LLM.beam_search`` and ``EngineClient.beam_search``).

The algorithm (beam search as in Sutskever et al. 2014, "Sequence to Sequence Learning with
Neural Networks", section 3.1, with vLLM's candidate count and final ranking):

1. Each prompt starts with one live beam, the prompt itself, cumulative logprob 0.
2. Each step, every live beam is one engine request for one greedy token that asks for the
   logprobs of its ``2 * beam_width`` most likely next tokens (``step_params``). All beams of
   a prompt share its prefix, so prefix caching turns their prefill into a cache hit on every
   full block and only the beam's own tail (at most ``block_size`` tokens plus the step's
   token) is computed.
3. Every (beam, next token) pair is a candidate with ``cum_logprob + logprob``. A candidate
   ending in an EOS id (the model's main one and the others its generation config declares,
   as kvflow's own stopping does) is finished and set aside unless ``ignore_eos``; the other
   candidates are ranked by ``cum_logprob`` (all have the same length) and the best
   ``beam_width`` live on. Asking for twice the width is what keeps ``beam_width`` live
   beams even when up to ``beam_width`` of the best candidates end in EOS.
4. After ``max_tokens`` steps (or when no beam is live), finished and live beams together
   are ranked by ``beam_search_score``: ``cum_logprob / length ** length_penalty``, the
   length counting the prompt and the generated tokens but not a final EOS (vLLM's
   ``get_beam_search_score``), and the best ``beam_width`` are returned, best first.

Logprobs are the model's raw log-softmax in fp32 (before temperature, penalties never
applied: ``step_params`` turns them off explicitly, so a model's sampling defaults cannot
change them; under ``--logprobs-mode processed_logprobs`` the same values, and the
``*_logits`` modes are refused: ``check_logprobs_mode``). Ties keep candidate order (beam order, then the engine's logprob rank):
Python's sort is stable.

``BeamSearch`` holds one prompt's state and never calls the engine: ``beam_search_offline``
drives it with ``LLM.generate`` (all prompts' beams in one batch per step),
``beam_search_async`` with the server's ``AsyncLLM`` (its step requests aborted if the caller
is cancelled, so a client that goes away leaves no KV blocks behind).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvflow.beam_search_params import BeamSearchParams
from kvflow.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from kvflow.sampling_params import SamplingParams


@dataclass
class BeamSearchSequence:
    """One beam (vLLM's ``BeamSearchSequence``).

    Attributes:
        tokens: the prompt's token ids followed by the generated ones (a final EOS
            included), as in vLLM.
        logprobs: per generated token, the step's {token_id: Logprob} (its ``2 *
            beam_width`` most likely tokens, or the ``num_logprobs`` the server's search
            was asked for when more; natural log).
        cum_logprob: sum of the generated tokens' logprobs (nats).
        text: set on the returned sequences: ``tokens`` decoded, prompt included (as
            vLLM's ``LLM.beam_search``), special tokens skipped unless
            ``skip_special_tokens`` is False, a final EOS only with
            ``include_stop_str_in_output`` (and then as ``skip_special_tokens`` says).
        finish_reason: ``"stop"`` (EOS) or ``"length"`` (``max_tokens`` or the context)
            on the returned sequences.
    """

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None


@dataclass
class BeamSearchOutput:
    """One prompt's result: ``sequences``, best first (``beam_width`` of them, fewer only
    when the vocabulary offers fewer distinct continuations)."""

    sequences: list[BeamSearchSequence]


def check_logprobs_mode(logprobs_mode: str) -> None:
    """Beam search ranks beams by summed logprobs: refuse an engine whose logprobs are logits.

    Args:
        logprobs_mode: the engine's ``--logprobs-mode``. raw_logprobs ranks by the model's
            own log-softmax (vLLM's default); processed_logprobs gives the same values
            (the step requests are greedy with penalties and bias off: nothing processes
            their logits but a custom logits processor's edits).

    Raises:
        ValueError: naming ``--logprobs-mode`` for raw_logits / processed_logits (a sum of
            logits is no sequence probability).
    """
    if logprobs_mode.endswith("_logits"):
        raise ValueError(f"beam search is not available with --logprobs-mode "
                         f"{logprobs_mode} (logprobs_mode={logprobs_mode!r}): beams are ranked "
                         "by summed logprobs, and this engine reports logits instead "
                         "(raw_logprobs or processed_logprobs serve it)")


def beam_search_score(num_tokens: int, cum_logprob: float, length_penalty: float) -> float:
    """vLLM's ranking score ``cum_logprob / num_tokens ** length_penalty``.

    Args:
        num_tokens: the sequence's length in tokens, prompt included, a final EOS not
            counted (>= 1).
        cum_logprob: its generated tokens' summed logprobs (nats, <= 0).
        length_penalty: the exponent (0: the cumulative logprob itself).
    """
    return cum_logprob / (num_tokens ** length_penalty)


class BeamSearch:
    """One prompt's beam search state (the algorithm in the module docstring); it never
    calls the engine: the driver submits ``live_prompts()`` with ``step_params()`` and
    hands the step's logprobs to ``advance``.

    Args:
        prompt_token_ids: the prompt (non-empty).
        params: the search's parameters.
        eos_token_ids: the ids that finish a beam (unless ``params.ignore_eos``).
    """

    def __init__(self, prompt_token_ids: Sequence[int], params: BeamSearchParams,
                 eos_token_ids: frozenset[int]) -> None:
        self.params = params
        self.model_eos_ids = eos_token_ids  # a final one is not counted in the final score
        self.eos_token_ids = frozenset() if params.ignore_eos else eos_token_ids
        self.live = [BeamSearchSequence(list(prompt_token_ids))]
        self.finished: list[BeamSearchSequence] = []
        self.num_steps = 0

    @property
    def done(self) -> bool:
        """No live beam left, or ``max_tokens`` steps taken."""
        return not self.live or self.num_steps >= self.params.max_tokens

    def live_prompts(self) -> list[list[int]]:
        """The token ids of every live beam: this step's engine prompts, in beam order."""
        return [beam.tokens for beam in self.live]

    def step_params(self, num_logprobs: int = 0) -> SamplingParams:
        """One greedy token with the ``2 * beam_width`` top logprobs (more when the caller
        returns more per token: ``num_logprobs``; only the first ``2 * beam_width`` are
        candidates, see ``advance``), every logit transformation off (set explicitly, so a
        model's sampling defaults fill none)."""
        return SamplingParams(n=1, temperature=0.0, top_p=1.0, top_k=0, min_p=0.0,
                              max_tokens=1,
                              logprobs=max(2 * self.params.beam_width, num_logprobs),
                              presence_penalty=0.0, frequency_penalty=0.0,
                              repetition_penalty=1.0, ignore_eos=True)

    def advance(self, step_logprobs: Sequence[Mapping[int, Logprob]]) -> None:
        """Extend the beams by one token.

        Args:
            step_logprobs: per live beam, in ``live_prompts`` order, its next token's top
                logprobs ({token_id: Logprob}); only ranks up to ``2 * beam_width`` are
                candidates (a step may carry more for the caller's ``logprobs``), so the
                search is the same whatever the caller returns.

        Raises:
            ValueError: if there is not one mapping per live beam.
        """
        if len(step_logprobs) != len(self.live):
            raise ValueError(f"got logprobs for {len(step_logprobs)} beams; "
                             f"{len(self.live)} are live")
        candidates = []
        for beam, step in zip(self.live, step_logprobs):
            ranked = sorted(step.items(), key=lambda kv: kv[1].rank)
            for token_id, lp in ranked:
                if lp.rank > 2 * self.params.beam_width:
                    break
                child = BeamSearchSequence(beam.tokens + [token_id], beam.logprobs + [dict(step)],
                                           beam.cum_logprob + lp.logprob)
                if token_id in self.eos_token_ids:
                    child.finish_reason = "stop"
                    self.finished.append(child)
                else:
                    candidates.append(child)
        candidates.sort(key=lambda beam: beam.cum_logprob, reverse=True)
        self.live = candidates[:self.params.beam_width]
        self.num_steps += 1

    def best(self) -> list[BeamSearchSequence]:
        """The ``beam_width`` best of the finished and live beams by ``beam_search_score``,
        best first; live beams get finish_reason ``"length"``. A final EOS id is not counted
        in the length, also on a live beam under ``ignore_eos`` (vLLM's
        ``get_beam_search_score`` looks at the last token, not at why the beam ended)."""
        for beam in self.live:
            beam.finish_reason = "length"

        def score(beam: BeamSearchSequence) -> float:
            ends_in_eos = beam.tokens[-1] in self.model_eos_ids
            return beam_search_score(len(beam.tokens) - ends_in_eos, beam.cum_logprob,
                                     self.params.length_penalty)

        return sorted(self.finished + self.live, key=score, reverse=True)[
            :self.params.beam_width]


def generated_text(tokenizer: Any, beam: BeamSearchSequence, start: int,
                   params: BeamSearchParams, skip_special_tokens: bool = True) -> str:
    """``beam.tokens[start:]`` decoded with ``skip_special_tokens`` (a final EOS dropped
    unless ``include_stop_str_in_output``; kept, its text shows only where
    ``skip_special_tokens`` does not skip it, as for a sampled request and in vLLM's beam
    search); "" without a tokenizer."""
    if tokenizer is None:
        return ""
    tokens = beam.tokens[start:]
    if beam.finish_reason == "stop" and not params.include_stop_str_in_output:
        tokens = tokens[:-1]
    return tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)


def beam_search_offline(generate: Callable[[list[list[int]], SamplingParams, list[int]],
                                           list[RequestOutput]],
                        prompts: Sequence[Sequence[int]], params: BeamSearchParams,
                        eos_token_ids: frozenset[int], tokenizer: Any
                        ) -> list[BeamSearchOutput]:
    """Beam search over every prompt at once: each step one ``generate`` call holds every
    prompt's live beams (``LLM.beam_search`` passes its own ``generate``).

    Args:
        generate: ``(token-id prompts, params, owners) -> one finished RequestOutput per
            prompt``; ``owners[j]`` is the index in ``prompts`` of the search the j-th
            token-id prompt (a beam) belongs to (``LLM.beam_search`` picks its LoRA adapter
            by it).
        prompts: token-id prompts (each non-empty and leaving room for ``max_tokens``).
        params: the search's parameters.
        eos_token_ids: ids that finish a beam unless ``params.ignore_eos``.
        tokenizer: decodes ``text`` (None: texts stay "").

    Returns:
        one BeamSearchOutput per prompt, in order.
    """
    searches = [BeamSearch(p, params, eos_token_ids) for p in prompts]
    while True:
        running = [(i, s) for i, s in enumerate(searches) if not s.done]
        if not running:
            break
        beams = [(i, tokens) for i, s in running for tokens in s.live_prompts()]
        outputs = iter(generate([tokens for _, tokens in beams], running[0][1].step_params(),
                                [i for i, _ in beams]))
        for _, s in running:
            s.advance([_step_logprobs(next(outputs)) for _ in s.live])
    results = []
    for s in searches:
        best = s.best()
        for beam in best:
            beam.text = generated_text(tokenizer, beam, 0, params, params.skip_special_tokens)
        results.append(BeamSearchOutput(best))
    return results


async def beam_search_async(engine: Any, request_id: str, prompt_token_ids: list[int],
                            params: BeamSearchParams, *, priority: int = 0,
                            client_id: str = "", lora_request: Any = None,
                            skip_special_tokens: bool = True,
                            cache_salt: str | None = None,
                            num_logprobs: int = 0,
                            session_id: str | None = None) -> RequestOutput:
    """One prompt's beam search on the server's ``AsyncLLM``; its step requests are named
    ``{request_id}-s{step}-b{beam}`` and each carries ``lora_request``, ``cache_salt`` and
    ``session_id`` (its KV cache events' session). If this coroutine is cancelled (the client
    went away) or fails, every step request still in flight is aborted. ``num_logprobs``: the
    top logprobs the caller returns per token (a request's ``logprobs`` / ``top_logprobs``);
    each step asks for that many when it is more than ``2 * beam_width``.

    Returns:
        a finished RequestOutput whose ``outputs`` are the best beams, best first
        (``index`` 0, 1, ...; ``token_ids`` the generated tokens, a final EOS included;
        ``text`` per ``generated_text`` with ``skip_special_tokens``; ``cumulative_logprob``; ``logprobs`` each step's
        top ``max(2 * beam_width, num_logprobs)``).

    Raises:
        ValueError: if the engine refuses a step request.
        EngineDeadError: if the engine dies meanwhile.
    """
    eos = frozenset([engine.processor.eos_token_id, *engine.processor.extra_eos_ids]) - {None}
    search = BeamSearch(prompt_token_ids, params, eos)
    first: RequestMetrics | None = None
    while not search.done:
        outs = await _run_step(engine, request_id, search, num_logprobs, priority, client_id,
                               lora_request, cache_salt, session_id)
        search.advance([_step_logprobs(out) for out in outs])
        first = first or outs[0].metrics
    start = len(prompt_token_ids)
    outputs = [CompletionOutput(i, generated_text(engine.tokenizer, beam, start, params,
                                                  skip_special_tokens),
                                beam.tokens[start:], beam.cum_logprob, beam.logprobs,
                                beam.finish_reason)
               for i, beam in enumerate(search.best())]
    metrics = RequestMetrics(first.arrival_time, first.first_token_time,
                             outs[0].metrics.finished_time,
                             num_cached_tokens=first.num_cached_tokens)  # first step's
    return RequestOutput(request_id, None, list(prompt_token_ids), outputs, True, metrics)


async def _run_step(engine: Any, request_id: str, search: BeamSearch, num_logprobs: int,
                    priority: int, client_id: str, lora_request: Any,
                    cache_salt: str | None, session_id: str | None) -> list[RequestOutput]:
    """One step of ``search`` on the engine: a request per live beam
    (``{request_id}-s{step}-b{beam}``), each one's finished output, in beam order. Every
    step request still open is aborted when this returns or raises (cancelled included).

    Raises:
        ValueError: if the engine refuses a step request.
        EngineDeadError: if the engine dies meanwhile.
    """
    streams = []
    try:
        for i, tokens in enumerate(search.live_prompts()):
            streams.append(engine.add_request(
                f"{request_id}-s{search.num_steps}-b{i}", None, tokens,
                search.step_params(num_logprobs), priority, None, client_id, lora_request,
                cache_salt, session_id=session_id))
        for stream in streams:
            await engine.admitted(stream)
        return await asyncio.gather(*(_last(stream) for stream in streams))
    finally:  # a no-op for finished requests; frees the others' KV blocks
        for stream in streams:
            engine.abort(stream.request_id)


async def _last(stream: Any) -> RequestOutput:
    """A one-token request's last output (the one carrying its token's logprobs)."""
    last = None
    async for out in stream:
        if out.outputs and out.outputs[0].logprobs:
            last = out
    if last is None:
        raise RuntimeError(f"request {stream.request_id} ended without logprobs")
    return last


def _step_logprobs(out: RequestOutput) -> dict[int, Logprob]:
    """The top logprobs of a one-token request's token."""
    return out.outputs[0].logprobs[0]

