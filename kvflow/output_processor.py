"""Engine-core outputs -> user-facing RequestOutputs: detokenization, stop strings, logprobs,
and the regrouping of the ``n`` samples of one request."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from kvflow.core.scheduler import EngineCoreOutput
from kvflow.detokenizer import IncrementalDetokenizer
from kvflow.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from kvflow.request import Request


@dataclass
class _SampleState:
    output: CompletionOutput
    detokenizer: IncrementalDetokenizer | None
    want_logprobs: bool
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)


@dataclass
class _RequestState:
    prompt: str | None
    prompt_token_ids: list[int]
    samples: dict[str, _SampleState]
    metrics: RequestMetrics

    @property
    def finished(self) -> bool:
        return all(s.output.finished for s in self.samples.values())


class OutputProcessor:
    """Tracks the user-visible state of every request.

    ``process`` returns the RequestOutputs that changed and the sample ids whose stop string
    matched (the caller must abort those in the engine core to free their KV blocks).
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._states: dict[str, _RequestState] = {}
        self._parent_of: dict[str, str] = {}

    def add_request(self, prompt: str | None, requests: list[Request]) -> None:
        first = requests[0]
        samples = {}
        for r in requests:
            p = r.sampling_params
            detok = None
            if self.tokenizer is not None:
                detok = IncrementalDetokenizer(self.tokenizer, r.prompt_token_ids,
                                               p.skip_special_tokens, p.stop,
                                               p.include_stop_str_in_output)
            out = CompletionOutput(index=r.sample_index,
                                   logprobs=[] if p.logprobs is not None else None,
                                   cumulative_logprob=0.0 if p.logprobs is not None else None)
            samples[r.request_id] = _SampleState(out, detok, p.logprobs is not None)
            self._parent_of[r.request_id] = first.parent_id
        self._states[first.parent_id] = _RequestState(
            prompt, first.prompt_token_ids, samples, RequestMetrics(first.arrival_time))

    def has_unfinished(self) -> bool:
        return bool(self._states)

    def abort(self, parent_id: str) -> list[str]:
        """Forget a request; returns its sample ids (to abort in the core)."""
        state = self._states.pop(parent_id, None)
        if state is None:
            return []
        for sid in state.samples:
            self._parent_of.pop(sid, None)
        return list(state.samples)

    def process(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        now = time.monotonic()
        changed: dict[str, _RequestState] = {}
        to_abort: list[str] = []
        for eco in outputs:
            parent = self._parent_of.get(eco.request_id)
            if parent is None:
                continue
            state = self._states[parent]
            if self._update_sample(state.samples[eco.request_id], eco):
                to_abort.append(eco.request_id)
            if state.metrics.first_token_time is None:
                state.metrics.first_token_time = now
            changed[parent] = state
        results = []
        for parent, state in changed.items():
            if state.finished:
                state.metrics.finished_time = now
                self.abort(parent)
            results.append(self._request_output(parent, state))
        return results, to_abort

    def _update_sample(self, sample: _SampleState, eco: EngineCoreOutput) -> bool:
        """Fold new tokens into a sample; returns True if a stop string ended it here."""
        out = sample.output
        out.token_ids.extend(eco.new_token_ids)
        sample.delta_token_ids = list(eco.new_token_ids)
        if sample.want_logprobs and eco.new_logprobs:
            self._add_logprobs(out, eco.new_token_ids, eco.new_logprobs)
        finish = (eco.finish_reason, eco.stop_reason) if eco.finish_reason else None
        stopped_by_string = False
        if sample.detokenizer is not None:
            delta = sample.detokenizer.update(eco.new_token_ids, finish is not None)
            if delta.stop_str is not None:
                stopped_by_string = finish is None
                finish = ("stop", delta.stop_str)
            out.text = sample.detokenizer.output_text
        if finish is not None:
            out.finish_reason, out.stop_reason = finish
        return stopped_by_string

    def _add_logprobs(self, out: CompletionOutput, token_ids: list[int], entries: list) -> None:
        for token_id, (top_ids, top_lps, sampled_lp, rank) in zip(token_ids, entries):
            step = {token_id: Logprob(sampled_lp, rank, self._decode(token_id))}
            for r, (tid, lp) in enumerate(zip(top_ids, top_lps), start=1):
                step.setdefault(tid, Logprob(lp, r, self._decode(tid)))
            out.logprobs.append(step)
            out.cumulative_logprob += sampled_lp

    def _decode(self, token_id: int) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode([token_id])

    @staticmethod
    def _request_output(parent: str, state: _RequestState) -> RequestOutput:
        outputs = sorted((s.output for s in state.samples.values()), key=lambda o: o.index)
        return RequestOutput(parent, state.prompt, state.prompt_token_ids, outputs,
                             state.finished, state.metrics)
