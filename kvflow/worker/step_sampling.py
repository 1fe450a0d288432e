"""A step's sampling half: the launched step (logits of its sampling rows), its sampling
(queued on CUDA, or draft verification) and the collection of its tokens on the host."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from kvflow.core.request_errors import EXTRA_ARGS
from kvflow.layers.sampler import Sampler, SamplerOutput
from kvflow.runner_output import ModelRunnerOutput, PromptLogprobsChunk
from kvflow.sched_output import GrammarBitmask
from kvflow.spec_decode.verification import SpecStep, verify
from kvflow.worker.input_batch import InputBatch
from kvflow.worker.logits_procs import RunnerLogitsProcessors
from kvflow.worker.request_failures import Failures, request_failure
from kvflow.worker.request_state import RequestState
from kvflow.worker.sampling_inputs import SamplingInputs


@dataclass
class LaunchedStep:
    """A step whose forward pass was launched: its sampling rows and their logits, the
    prompt logprobs it computed, and the embeddings it finished."""

    sample_rows: np.ndarray
    logits: torch.Tensor | None
    prompt_logprobs: dict[str, PromptLogprobsChunk]
    spec: SpecStep | None = None  # verification layout (speculative decoding)
    pooled: dict[str, list[float]] = field(default_factory=dict)


@dataclass
class PendingOutput:
    """A step sampled but not yet collected: its requests, in sampled-tensor order (output
    None: nothing sampled), and its prompt logprobs; ``ready``: a verification step's output,
    already on the host; ``pooled``: the embeddings it finished."""

    req_ids: list[str]
    output: SamplerOutput | None
    prompt_logprobs: dict[str, PromptLogprobsChunk]
    ready: ModelRunnerOutput | None = None
    pooled: dict[str, list[float]] = field(default_factory=dict)


def sample_step(step: LaunchedStep, batch: InputBatch, sampling_inputs: SamplingInputs,
                sampler: Sampler, grammar_bitmask: GrammarBitmask | None,
                custom: RunnerLogitsProcessors | None = None,
                requests: dict[str, RequestState] | None = None,
                failures: Failures | None = None) -> PendingOutput | None:
    """Sample ``step``'s rows of ``batch`` (queued on CUDA); their tokens count as the rows'
    next tokens at once. A verification step runs synchronously (token counts vary per row).
    ``custom``: the runner's custom logits processors (told the batch's changes first;
    ``requests``: the runner's request states), None without any; ``failures``: where the
    requests whose row a processor could not process are recorded (field ``extra_args``;
    None: raised). None: nothing to collect (a prefill chunk without prompt logprobs or
    embeddings)."""
    if not len(step.sample_rows):  # a prefill chunk: maybe prompt logprobs, no tokens
        if step.prompt_logprobs or step.pooled:
            return PendingOutput([], None, step.prompt_logprobs, pooled=step.pooled)
        return None
    if step.spec is not None:  # verification: synchronous (token counts vary per row)
        ready = verify(step.spec, step.logits, batch, sampling_inputs, sampler,
                       grammar_bitmask)
        ready.prompt_logprobs = step.prompt_logprobs
        return PendingOutput([], None, step.prompt_logprobs, ready)
    meta = sampling_inputs.build(batch, step.sample_rows, grammar_bitmask)
    bound = None
    if custom is not None:
        custom.begin_step(batch, requests or {})
        bound = custom.for_rows(batch, step.sample_rows)
    out = sampler(step.logits, meta, bound)
    if bound is not None and bound.failed:
        _record_processor_failures(bound.failed, failures)
    batch.add_pending_tokens(step.sample_rows)
    index = batch.index(step.sample_rows)
    req_ids = batch.req_ids[index] if isinstance(index, slice) else \
        [batch.req_ids[r] for r in step.sample_rows.tolist()]
    return PendingOutput(req_ids, out, step.prompt_logprobs)


def _record_processor_failures(failed: dict[str, Exception], failures: Failures | None
                               ) -> None:
    """The requests a logits processor failed on (``StepLogitsProcessors.failed``) as the
    step's failures; raised when there is nowhere to record them."""
    if failures is None:
        raise next(iter(failed.values()))
    for rid, error in failed.items():
        failures.setdefault(rid, request_failure(rid, "its logits processor", error,
                                                 EXTRA_ARGS))


def collect_pending(pending: PendingOutput | None, batch: InputBatch) -> ModelRunnerOutput:
    """Copy ``pending``'s sampled tokens to the host (waits for the device), fill them into
    ``batch``'s pending slots and return them with their logprobs."""
    if pending is None:
        return ModelRunnerOutput()
    if pending.ready is not None:
        return pending.ready
    if pending.output is None:
        return ModelRunnerOutput(prompt_logprobs=pending.prompt_logprobs,
                                 pooler_output=pending.pooled)
    sampled = pending.output.sampled.cpu().numpy()
    batch.fill_pending_tokens(sampled)
    tokens = sampled.tolist()
    logprobs = {pending.req_ids[row]: [lp]
                for row, lp in pending.output.logprobs_lists().items()}
    return ModelRunnerOutput(pending.req_ids, [[t] for t in tokens], logprobs,
                             pending.prompt_logprobs)
