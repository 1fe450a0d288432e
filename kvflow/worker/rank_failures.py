"""Per-request failures (``worker/request_failures.py``) on an engine of several ranks: every
rank must end the same requests, and the driver rank must report every rank's.

The rule, stated once: a request fails in a step when it failed on ANY rank. The driver
(TP and CP rank 0 of the last pipeline stage) is the only rank whose ``ModelRunnerOutput``
the engine reads, so the failures of the others reach it:

- down the pipeline: a stage before the last sends its failures to the next stage with its
  hidden states (one more named tensor, ``FAILURES_KEY``, only when there are some; the first
  stage is the one that runs the vision encoder); the next stage adds them to its own;
- across a stage's tensor- and context-parallel ranks: when the step could have failed on
  some rank (``StepFailures.possible``, decided from what every rank sees alike: the step's
  new requests with an adapter or images, its images to encode, custom logits processors),
  the last stage's ranks all-gather their failures when the step's tokens are collected
  (``agree_failures``), so the driver reports the union. Steps that cannot fail (plain text,
  no custom processors) exchange nothing.

A request that failed on one rank only still ran on the others, with its image, adapter or
processor edit, and on the failing rank without them: its rows differ between ranks, which
only touches its own rows (each row's hidden states are reduced with the same row on the
other ranks; no collective depends on a request's data), and the scheduler drops its tokens
and the K/V the step wrote for it. An exception that is not one request's (out of memory, a
batched logits processor, an encoder call that fails for every image) still ends the worker
process: the executor then stops every rank and raises ``ExecutorError``, so the peers
waiting in a collective are not left to hang.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from kvflow.distributed.comm import CommGroup
from kvflow.runner_output import RequestFailure
from kvflow.sched_output import SchedulerOutput
from kvflow.worker.request_failures import Failures

# The name under which a pipeline stage sends its failures beside its hidden states.
FAILURES_KEY = "request_failures"


@dataclass
class StepFailures:
    """One step's requests that failed alone on this rank.

    Attributes:
        failed: request id -> why (this rank's, and the earlier pipeline stages').
        possible: whether some rank could have recorded a failure in this step, known alike
            on every rank (the same scheduler output and configuration): the ranks of the
            last stage exchange their failures only then.
    """

    failed: Failures = field(default_factory=dict)
    possible: bool = False


def may_fail_before_forward(sched: SchedulerOutput) -> bool:
    """Whether the step's input preparation can record a failure on some rank: it has a new
    request with a LoRA adapter (read again at its first schedule) or images (M-RoPE
    positions), or images to encode."""
    return bool(sched.scheduled_encoder_inputs) or any(
        new.lora_request is not None or new.mm_features for new in sched.scheduled_new_reqs)


def encode_failures(failures: Failures, device: torch.device) -> torch.Tensor:
    """``failures`` as uint8 [n] bytes on ``device`` (UTF-8 JSON; n = 0 when empty), for a
    tensor message between ranks."""
    if not failures:
        return torch.empty(0, dtype=torch.uint8, device=device)
    data = json.dumps({rid: [f.message, f.field, f.internal] for rid, f in failures.items()})
    return torch.frombuffer(bytearray(data.encode()), dtype=torch.uint8).to(device)


def decode_failures(encoded: torch.Tensor) -> Failures:
    """The failures :func:`encode_failures` wrote into ``encoded`` (uint8 [n], any device)."""
    if not encoded.numel():
        return {}
    data = json.loads(bytes(encoded.cpu().tolist()).decode())
    return {rid: RequestFailure(message, error_field, internal)
            for rid, (message, error_field, internal) in data.items()}


def add_failures(into: Failures, more: Failures) -> None:
    """Add ``more`` to ``into`` (in place); a request already in ``into`` keeps its reason."""
    for rid, failure in more.items():
        into.setdefault(rid, failure)


def agree_failures(groups: Iterable[CommGroup], failures: StepFailures,
                   device: torch.device) -> Failures:
    """The union of every rank's ``failures.failed`` over ``groups`` (a last stage's TP and
    CP groups; groups of one rank are skipped), the same on each of them; ``failures.failed``
    itself when the step could not fail (``possible`` False: no collective at all). Every
    rank of the groups must call it for the same step: one int64 all-gather, and a second
    one only when some rank has failures."""
    failed = failures.failed
    if not failures.possible:
        return failed
    for group in groups:
        if group.world_size > 1:
            failed = _union(group, failed, device)
    return failed


def _union(group: CommGroup, failed: Failures, device: torch.device) -> Failures:
    """Every rank of ``group``'s failures, in rank order (a request keeps the lowest rank's
    reason)."""
    mine = encode_failures(failed, device)
    sizes = group.all_gather(torch.tensor([mine.numel()], dtype=torch.int64, device=device),
                             dim=0).tolist()
    if not any(sizes):
        return failed
    padded = torch.zeros(max(sizes), dtype=torch.uint8, device=device)
    padded[:mine.numel()] = mine
    every = group.all_gather(padded, dim=0).view(group.world_size, -1).cpu()
    union: Failures = {}
    for rank, size in enumerate(sizes):
        add_failures(union, decode_failures(every[rank, :size]))
    return union
