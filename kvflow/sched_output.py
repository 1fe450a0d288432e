"""What the scheduler hands the model runner each step (pure data: no engine imports).

``SchedulerOutput`` lists, per scheduled request, the tokens to compute this step, where its
K/V live (one block table per KV-cache group) and whether the step samples for it.
``GrammarBitmask`` carries the allowed tokens of the step's structured-output rows. Both are
built by the engine core and read by executors and workers, which therefore never import the
scheduler (the pattern of vLLM v1's ``core/sched/output.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvflow.sampling_params import SamplingParams


@dataclass
class ScheduledRequest:
    """What the model runner needs to compute one request's share of a step.

    Attributes:
        token_ids: the tokens computed this step (``num_scheduled_tokens`` of them).
        num_computed_tokens: tokens already in the KV cache before this step.
        block_ids: the request's whole block table, one list per KV-cache group (all equally
            long; entries a sliding window no longer reads are the null block 0).
        do_sample: the step reaches the end of the request's tokens, so sample one token.
        output_token_ids: tokens generated so far (for min_tokens and penalties).
        prompt_token_ids: the request's prompt (for the repetition penalty).
    """

    request_id: str
    token_ids: list[int]
    num_computed_tokens: int
    block_ids: tuple[list[int], ...]
    do_sample: bool
    sampling_params: SamplingParams
    output_token_ids: list[int]
    eos_token_id: int | None
    prompt_token_ids: list[int] = field(default_factory=list)

    @property
    def num_scheduled_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class SchedulerOutput:
    """One step's work.

    Attributes:
        scheduled: the requests computed this step, in batch order.
        preempted_ids: requests preempted this step (their K/V are gone; recomputed later).
        finished_ids: requests freed since the previous step (runners drop their state).
    """

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)
    finished_ids: set[str] = field(default_factory=set)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(r.num_scheduled_tokens for r in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class GrammarBitmask:
    """The allowed tokens of one step's constrained rows.

    Attributes:
        request_ids: the constrained requests that sample this step, in bitmask row order.
        bitmask: int32 [len(request_ids), ceil(vocab_size / 32)], CPU; bit ``t % 32`` of word
            ``t // 32`` set means token ``t`` is allowed (xgrammar's layout).
    """

    request_ids: list[str]
    bitmask: torch.Tensor
