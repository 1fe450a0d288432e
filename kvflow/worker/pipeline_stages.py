"""Pipeline-parallel hand-off between stages: a stage receives the previous stage's hidden
states before its forward and hands its own to the next; only the last goes on to logits.
The requests that failed alone on a stage travel with its hidden states
(``worker/rank_failures.py``), so the last stage, which reports the step, ends them."""

from __future__ import annotations

import torch

from kvflow.distributed.comm import CommGroup, IntermediateTensors
from kvflow.worker.rank_failures import (
    FAILURES_KEY,
    add_failures,
    decode_failures,
    encode_failures,
)
from kvflow.worker.request_failures import Failures


def recv_from_previous_stage(pp: CommGroup, failures: Failures | None = None
                             ) -> IntermediateTensors | None:
    """The previous pipeline stage's hidden states (None on the first stage); the failures
    it sent with them are added to ``failures`` (in place; None: a step without requests,
    the memory profile's)."""
    if pp.is_first_rank:
        return None
    tensors = pp.recv_tensors(pp.rank - 1)
    sent = tensors.pop(FAILURES_KEY, None)
    if sent is not None and failures is not None:
        add_failures(failures, decode_failures(sent))
    return tensors


def send_to_next_stage(pp: CommGroup, output: torch.Tensor | IntermediateTensors,
                       failures: Failures | None = None) -> bool:
    """Hand a non-last stage's output, and ``failures`` when there are some (emptied: they
    are the next stage's to report now), to the next stage; True on the last stage (which
    goes on to the logits)."""
    if pp.is_last_rank:
        return True
    if failures:
        output = {**output, FAILURES_KEY: encode_failures(failures, pp.device)}
        failures.clear()
    pp.send_tensors(output, pp.rank + 1)
    return False
