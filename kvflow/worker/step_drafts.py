"""A step's speculative drafts on the runner: the draft tokens to verify (the scheduled ones, or
a draft model's proposal for the drafting rows) placed after their requests' tokens, then the
step's model inputs built from the persistent batch (see kvflow/spec_decode/verification.py)."""

from __future__ import annotations

import functools

import torch

from kvflow.layers.rotary import LongPromptRope
from kvflow.sched_output import DraftGrammar, GrammarBitmask, SchedulerOutput
from kvflow.spec_decode.draft_model import DraftModel
from kvflow.spec_decode.draft_proposal import DraftProposal
from kvflow.spec_decode.verification import place_drafts
from kvflow.worker.input_batch import InputBatch
from kvflow.worker.input_batch_diffs import num_scheduled_per_row
from kvflow.worker.model_inputs import InputStager, ModelInputs, build_model_inputs
from kvflow.worker.step_inputs import fill_pending
from kvflow.worker.step_sampling import PendingOutput


def draft_and_build_inputs(sched: SchedulerOutput, batch: InputBatch, drafter: DraftModel | None,
                           block_size: int, stager: InputStager, pending: PendingOutput | None,
                           generator: torch.Generator,
                           long_prompt_rope: LongPromptRope | None = None,
                           first_grammar: GrammarBitmask | None = None,
                           draft_grammar: DraftGrammar | None = None
                           ) -> tuple[ModelInputs, dict[str, list[int]], DraftProposal | None]:
    """The step's model inputs, with the draft tokens to verify placed after their requests'
    tokens: the scheduled ones, or ``drafter``'s proposal for the drafting rows
    (draft_model.py).

    Args:
        sched: the step, already applied to ``batch``.
        batch: the persistent input batch (drafts are placed in it).
        drafter: the draft model, or None (the scheduled drafts are verified as they are).
        block_size: tokens per KV block.
        stager: the runner's input stager.
        pending: the previous step's sampled tokens still on the device (None: collected);
            written into the inputs (and into the draft model's pass inputs).
        generator: the sampler's generator (the draft model's unseeded sampled requests).
        long_prompt_rope: LongRoPE's long-prompt rows (``layers.rotary.long_prompt_rope``).
        first_grammar: constrained requests' grammar rows before their first draft (the draft
            model chooses draft 1 within them), or None.
        draft_grammar: the engine core's grammar rows for their later drafts, or None.

    Returns:
        (inputs, draft token ids by request id, the proposal or None).
    """
    spec_tokens = sched.scheduled_spec_decode_tokens
    num_scheduled = num_scheduled_per_row(batch, sched)
    fill = functools.partial(fill_pending, pending=pending)
    proposal = None
    if drafter is not None and spec_tokens:
        proposal = drafter.propose(batch, num_scheduled, spec_tokens, block_size, stager, fill,
                                   generator, first_grammar, draft_grammar)
        spec_tokens = proposal.token_ids
    if spec_tokens:
        place_drafts(batch, spec_tokens)
    inputs = build_model_inputs(batch, num_scheduled, block_size, stager,
                                long_prompt_rope=long_prompt_rope)
    if len(inputs.pending_token_index):
        fill(inputs)
    return inputs, spec_tokens, proposal

