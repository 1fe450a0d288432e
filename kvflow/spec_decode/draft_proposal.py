"""A draft model's proposal for one step (:class:`DraftProposal`: the tokens and, for sampled
requests, the draft distributions ``q`` the rejection sampler needs), and its sharing across
tensor-parallel ranks (every rank drafts; all take TP rank 0's)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvflow.distributed.comm import CommGroup


@dataclass
class DraftProposal:
    """One step's draft tokens.

    Attributes:
        token_ids: request id -> its ``k`` draft tokens.
        probs: request id -> float32 [k, V], the distribution each draft was drawn from
            (sampled requests only; greedy requests' drafts are point masses).
        seconds: wall time of the draft passes that proposed them (the mirror pass included).
        pass_seconds: mean wall time of one steady pass (one or two tokens per drafting
            request; a catch-up mirror pass is left out), 0.0 when none ran: the cost model's
            draft cost per pass.
        threads: the CPU threads the passes ran on (``DraftThreads``).
    """

    token_ids: dict[str, list[int]]
    probs: dict[str, torch.Tensor]
    seconds: float
    pass_seconds: float = 0.0
    threads: int = 0


def share_proposal(proposal: DraftProposal, group: CommGroup) -> None:
    """Overwrite ``proposal``'s draft tokens and ``q`` rows, in place, with group rank 0's
    (two broadcasts: the tokens as int64, the ``q`` rows as float32, each in request-id
    order). Every rank must hold the same request ids with as many drafts each and ``q``
    for the same requests (they follow from the step and the sampling parameters)."""
    rids = sorted(proposal.token_ids)
    if not rids:
        return
    sizes = [len(proposal.token_ids[r]) for r in rids]
    flat = [t for r in rids for t in proposal.token_ids[r]]
    tokens = group.broadcast(torch.tensor(flat, dtype=torch.int64, device=group.device))
    for rid, part in zip(rids, tokens.cpu().split(sizes)):
        proposal.token_ids[rid] = part.tolist()
    sampled = sorted(proposal.probs)
    if sampled:
        q = group.broadcast(torch.cat([proposal.probs[r] for r in sampled]).contiguous())
        for rid, part in zip(sampled, q.split([len(proposal.probs[r]) for r in sampled])):
            proposal.probs[rid] = part
