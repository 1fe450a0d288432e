"""Pipeline-parallel hand-off between stages: a stage receives the previous stage's hidden
states before its forward and hands its own to the next; only the last goes on to logits."""

from __future__ import annotations

import torch

from kvflow.distributed.comm import CommGroup, IntermediateTensors


def recv_from_previous_stage(pp: CommGroup) -> IntermediateTensors | None:
    """The previous pipeline stage's hidden states (None on the first stage)."""
    return None if pp.is_first_rank else pp.recv_tensors(pp.rank - 1)


def send_to_next_stage(pp: CommGroup, output: torch.Tensor | IntermediateTensors) -> bool:
    """Hand a non-last stage's output to the next stage; True on the last stage (which
    goes on to the logits)."""
    if pp.is_last_rank:
        return True
    pp.send_tensors(output, pp.rank + 1)
    return False
