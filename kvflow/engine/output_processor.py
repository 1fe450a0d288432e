"""Engine-core outputs -> user-facing RequestOutputs: detokenization, stop strings, logprobs,
and the regrouping of the ``n`` samples of one request.

A request is tracked in one of two modes: cumulative (each RequestOutput holds every sample's
whole text so far; offline ``LLM``) or delta (each RequestOutput holds, for the samples that
changed, only what is new since the previous output; streaming servers).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from kvflow.engine.detokenizer import DetokenizerDelta, IncrementalDetokenizer
from kvflow.engine.logprob_tokens import MAX_CONTEXT_TOKENS, LogprobTokenTexts
from kvflow.engine_outputs import EngineCoreOutput
from kvflow.outputs import (
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    Logprob,
    RequestMetrics,
    RequestOutput,
)
from kvflow.request import Request


@dataclass
class _SampleState:
    output: CompletionOutput
    detokenizer: IncrementalDetokenizer | None
    want_logprobs: bool
    decode: bool = True  # SamplingParams.detokenize: logprobs' decoded_token filled in
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs_start: int = 0  # index in output.logprobs where the pending delta starts
    changed: bool = False

    def take_delta(self) -> CompletionOutput:
        """What changed since the previous call, as a CompletionOutput (resets the delta)."""
        out = self.output
        logprobs = None if out.logprobs is None else out.logprobs[self.delta_logprobs_start:]
        delta = CompletionOutput(out.index, self.delta_text, self.delta_token_ids,
                                 out.cumulative_logprob, logprobs, out.finish_reason,
                                 out.stop_reason)
        self.clear_delta()
        return delta

    def clear_delta(self) -> None:
        self.delta_text, self.delta_token_ids, self.changed = "", [], False
        self.delta_logprobs_start = len(self.output.logprobs or ())


@dataclass
class _RequestState:
    prompt: str | None
    prompt_token_ids: list[int]
    samples: dict[str, _SampleState]
    metrics: RequestMetrics
    delta: bool = False
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    prompt_logprobs_sent: bool = False
    pooling: bool = False  # an embedding request
    embedding: list[float] | None = None
    decode: bool = True  # SamplingParams.detokenize: prompt logprobs' decoded_token

    @property
    def finished(self) -> bool:
        """Whether every sample finished (a loop, not ``all()`` of a generator: read for
        every request every step)."""
        for sample in self.samples.values():
            if sample.output.finish_reason is None:
                return False
        return True


class OutputProcessor:
    """Tracks the user-visible state of every request.

    ``process`` returns the RequestOutputs that changed and the sample ids whose stop string
    matched (the caller must abort those in the engine core to free their KV blocks).
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._token_texts = None if tokenizer is None else LogprobTokenTexts(tokenizer)
        self._states: dict[str, _RequestState] = {}
        self._parent_of: dict[str, str] = {}

    def add_request(self, prompt: str | None, requests: list[Request],
                    delta: bool = False) -> None:
        """Start tracking one user request (its ``n`` samples).

        Args:
            delta: report only what is new in each output (streaming) instead of everything.

        Raises:
            ValueError: if its id or one of its sample ids is already in flight (nothing is
                changed then, so the running request keeps its state).
        """
        first = requests[0]
        if first.parent_id in self._states or any(r.request_id in self._parent_of
                                                  for r in requests):
            raise ValueError(f"request id {first.parent_id!r} is already in use")
        samples = {}
        for r in requests:
            p = r.sampling_params
            detok = None
            if self.tokenizer is not None and r.pooling_params is None and p.detokenize:
                # A prompt given as embeddings has placeholder ids only: no text context.
                context = r.prompt_token_ids if r.prompt_embeds is None else []
                detok = IncrementalDetokenizer(self.tokenizer, context,
                                               p.skip_special_tokens, p.stop,
                                               p.include_stop_str_in_output, p.min_tokens,
                                               p.spaces_between_special_tokens)
            out = CompletionOutput(index=r.sample_index,
                                   logprobs=[] if p.logprobs is not None else None,
                                   cumulative_logprob=0.0 if p.logprobs is not None else None)
            samples[r.request_id] = _SampleState(out, detok, p.logprobs is not None,
                                                 p.detokenize)
            self._parent_of[r.request_id] = first.parent_id
        self._states[first.parent_id] = _RequestState(
            prompt, first.prompt_token_ids, samples, RequestMetrics(first.arrival_time), delta,
            pooling=first.pooling_params is not None,
            decode=first.sampling_params.detokenize)

    def has_unfinished(self) -> bool:
        return bool(self._states)

    @property
    def num_open_samples(self) -> int:
        """Samples of the requests in flight (a request of ``n`` samples counts ``n``)."""
        return len(self._parent_of)

    def parent_of(self, sample_id: str) -> str | None:
        """The user request id of a sample in flight; None for an unknown one."""
        return self._parent_of.get(sample_id)

    def open_samples(self) -> dict[str, str]:
        """The samples in flight that have not finished: sample id -> its request's id."""
        return {sid: parent for parent, state in self._states.items()
                for sid, sample in state.samples.items() if not sample.output.finished}

    def abort(self, parent_id: str) -> list[str]:
        """Forget a request; returns its sample ids (to abort in the core)."""
        state = self._states.pop(parent_id, None)
        if state is None:
            return []
        for sid in state.samples:
            self._parent_of.pop(sid, None)
        return list(state.samples)

    def aborted_output(self, parent_id: str) -> RequestOutput | EmbeddingRequestOutput | None:
        """The last output of a request that its caller aborts (vLLM's: what a consumer of
        its stream reads last): every sample not finished yet finishes with reason
        ``abort`` and no new token (delta mode: only those samples; cumulative: all);
        an embedding request's has no vector. Call it before :meth:`abort`, which forgets
        the request; None for an unknown (finished) one."""
        state = self._states.get(parent_id)
        if state is None:
            return None
        for sample in state.samples.values():
            if not sample.output.finished:
                sample.output.finish_reason = "abort"
                sample.changed = True
        state.metrics.finished_time = time.monotonic()
        return self._request_output(parent_id, state)

    def process(self, outputs: list[EngineCoreOutput]
                ) -> tuple[list[RequestOutput | EmbeddingRequestOutput], list[str]]:
        """Fold a step's outputs in; returns the outputs that changed (an
        ``EmbeddingRequestOutput`` for an embedding request) and the sample ids a stop string
        ended (to abort in the core)."""
        now = time.monotonic()
        changed: dict[str, _RequestState] = {}
        to_abort: list[str] = []
        for eco in outputs:
            parent = self._parent_of.get(eco.request_id)
            if parent is None:
                continue
            state = self._states[parent]
            sample = state.samples[eco.request_id]
            if sample.output.finish_reason is not None:  # a stop string ended it; its
                # abort is in flight
                continue
            if eco.pooling_output is not None:
                state.embedding = eco.pooling_output
            if eco.prompt_logprobs is not None and state.prompt_logprobs is None:
                state.prompt_logprobs = self._prompt_logprobs(state.prompt_token_ids,
                                                              eco.prompt_logprobs, state.decode)
            if self._update_sample(sample, eco, not state.delta):
                to_abort.append(eco.request_id)
            if eco.num_draft_tokens:
                metrics = state.metrics
                metrics.num_drafts += 1
                metrics.num_draft_tokens += eco.num_draft_tokens
                metrics.num_accepted_tokens += eco.num_accepted_tokens
            if state.metrics.first_token_time is None:
                state.metrics.first_token_time = now
                state.metrics.num_cached_tokens = max(eco.num_cached_tokens, 0)
            changed[parent] = state
        results = []
        for parent, state in changed.items():
            finished = state.finished
            if finished:
                state.metrics.finished_time = now
                self.abort(parent)
            results.append(self._request_output(parent, state, finished))
        return results, to_abort

    def _update_sample(self, sample: _SampleState, eco: EngineCoreOutput,
                       keep_text: bool) -> bool:
        """Fold new tokens into a sample; returns True if a stop string ended it here.
        ``keep_text``: maintain ``output.text`` (cumulative mode; delta mode skips the join
        and keeps the delta instead, which cumulative mode never reads). Several new tokens
        (speculative decoding) are cut after the one that completed a stop string, as one
        token per step would have been."""
        out = sample.output
        new_token_ids = eco.new_token_ids
        finish = (eco.finish_reason, eco.stop_reason) if eco.finish_reason else None
        stopped_by_string = False
        if sample.detokenizer is not None:
            # finished by a stop token (the EOS: stop_reason None; or a stop_token_ids id)
            stop_token = finish is not None and finish[0] == "stop" and \
                not isinstance(finish[1], str)
            delta, used = self._detokenize(sample.detokenizer, new_token_ids, finish is not None,
                                           stop_token)
            if delta.stop_str is not None:
                stopped_by_string = finish is None or used < len(new_token_ids)
                finish = ("stop", delta.stop_str)
                new_token_ids = new_token_ids[:used]
            if keep_text:
                out.text = sample.detokenizer.output_text
            else:
                sample.delta_text += delta.text
        out.token_ids.extend(new_token_ids)
        if not keep_text:
            sample.delta_token_ids.extend(new_token_ids)
            sample.changed = True
        if sample.want_logprobs and eco.new_logprobs:
            self._add_logprobs(out, new_token_ids, eco.new_logprobs, sample.decode)
        if finish is not None:
            out.finish_reason, out.stop_reason = finish
        return stopped_by_string

    @staticmethod
    def _detokenize(detokenizer: IncrementalDetokenizer, token_ids: list[int],
                    finished: bool, stop_token: bool = False) -> tuple[DetokenizerDelta, int]:
        """Detokenize ``token_ids``; with stop strings and several tokens, one token at a time
        until one completes a stop string. Returns the delta and the tokens it used.
        ``stop_token``: the last id is the stop token that ended the request (its text is
        left out: ``IncrementalDetokenizer.update``'s ``stop_terminated``)."""
        if len(token_ids) <= 1 or not detokenizer.has_stop_strings:
            return detokenizer.update(token_ids, finished, stop_token), len(token_ids)
        text = []
        for i, token_id in enumerate(token_ids):
            last = i == len(token_ids) - 1
            delta = detokenizer.update([token_id], finished and last, stop_token and last)
            text.append(delta.text)
            if delta.stop_str is not None:
                return DetokenizerDelta("".join(text), delta.stop_str), i + 1
        return DetokenizerDelta("".join(text)), len(token_ids)

    def _add_logprobs(self, out: CompletionOutput, token_ids: list[int], entries: list,
                      decode: bool) -> None:
        """Append each token's {token_id: Logprob} (the sampled token, then the top-k;
        ``decode``: with their text, as :class:`LogprobTokenTexts` writes it after the tokens
        sampled before) and add to the cumulative logprob."""
        for token_id, (top_ids, top_lps, sampled_lp, rank) in zip(token_ids, entries):
            texts = self._texts([token_id, *top_ids], out.logprobs, decode)
            step = {token_id: Logprob(sampled_lp, rank, texts[0])}
            for r, (tid, lp, text) in enumerate(zip(top_ids, top_lps, texts[1:]), start=1):
                step.setdefault(tid, Logprob(lp, r, text))
            out.logprobs.append(step)
            out.cumulative_logprob += sampled_lp

    def _prompt_logprobs(self, prompt: list[int], entries: list, decode: bool
                         ) -> list[dict[int, Logprob] | None]:
        """Per prompt token {token_id: Logprob} (the prompt token first, then the top-k;
        ``decode``: with their text, after the prompt tokens before)."""
        out: list[dict[int, Logprob] | None] = []
        for token_id, entry in zip(prompt, entries):
            if entry is None:
                out.append(None)
                continue
            top_ids, top_lps, lp, rank = entry
            texts = self._texts([token_id, *top_ids], out, decode)
            step = {token_id: Logprob(lp, rank, texts[0])}
            for r, (tid, tlp, text) in enumerate(zip(top_ids, top_lps, texts[1:]), start=1):
                step.setdefault(tid, Logprob(tlp, r, text))
            out.append(step)
        return out

    def _texts(self, token_ids: list[int], before: list[dict[int, Logprob] | None] | None,
               decode: bool = True) -> list[str | None]:
        """The texts of the ids at one position (None each without a tokenizer or with
        ``decode`` False); ``before``: the entries of the positions before (their first key
        is the token there: the context of a split character)."""
        if self._token_texts is None or not decode:
            return [None] * len(token_ids)
        context = [next(iter(e)) for e in (before or ())[-MAX_CONTEXT_TOKENS:] if e]
        return self._token_texts.texts(token_ids, context)

    @staticmethod
    def _request_output(parent: str, state: _RequestState, finished: bool | None = None
                        ) -> RequestOutput | EmbeddingRequestOutput:
        """The request's output now (``finished``: ``state.finished`` when the caller read
        it already; None: read here)."""
        if finished is None:
            finished = state.finished
        if state.pooling:
            return EmbeddingRequestOutput(parent, state.prompt, state.prompt_token_ids,
                                          EmbeddingOutput(state.embedding or []),
                                          finished, state.metrics)
        samples = list(state.samples.values())
        if len(samples) > 1:
            samples.sort(key=lambda s: s.output.index)
        if state.delta:
            outputs = [s.take_delta() for s in samples if s.changed]
        else:  # (no delta kept: see _update_sample)
            outputs = [s.output for s in samples]
        prompt_logprobs = state.prompt_logprobs
        if state.delta and state.prompt_logprobs_sent:
            prompt_logprobs = None
        elif state.delta and prompt_logprobs is not None:
            state.prompt_logprobs_sent = True
        return RequestOutput(parent, state.prompt, state.prompt_token_ids, outputs,
                             finished, state.metrics, prompt_logprobs)
