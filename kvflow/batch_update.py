"""How the model runner's persistent batch changed since a logits processor last saw it
(``BatchUpdate``): the data type that crosses from the runner to custom logits processors
(``kvflow.logits_process``), shaped as vLLM v1's.

A processor keeps its per-request state by batch row (the row of the logits tensor that
``LogitsProcessor.apply`` gets). Each update lists, to be applied in this order:

1. ``removed``: rows whose request left the batch; drop their state.
2. ``added``: ``(row, params, prompt_token_ids, output_token_ids)`` of each request that got a
   row (new, or back after a preemption): start its state. The row may still hold a removed
   request's state (replace it); it never holds a live request's.
3. ``moved``: ``(a, b, direction)``, in order: ``UNIDIRECTIONAL`` moves row ``a``'s state to
   row ``b`` (``a`` is empty after it, ``b``'s old state is gone), ``SWAP`` exchanges them.

``removed`` and the rows of ``added`` are disjoint, so applying ``added`` before ``removed``
(as vLLM's own helpers do) gives the same result.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from kvflow.sampling_params import SamplingParams


class MoveDirectionality(Enum):
    """How a moved row's state travels: to an empty row (``UNIDIRECTIONAL``) or exchanged
    with the other row's (``SWAP``)."""

    UNIDIRECTIONAL = 0
    SWAP = 1


# (row, its request's SamplingParams, prompt token ids, generated token ids). The generated
# ids are the runner's own list for the request, extended in place before every step that
# samples: a processor may keep the reference and read the request's latest tokens from it.
AddedRequest = tuple[int, "SamplingParams", list[int], list[int]]
RemovedRequest = int
MovedRequest = tuple[int, int, MoveDirectionality]


@dataclass(frozen=True)
class BatchUpdate:
    """The persistent batch's changes since the last update (see the module docstring for
    the order they apply in).

    Attributes:
        batch_size: rows in the batch after the update (the logits' first dimension).
        removed: rows whose request left.
        added: the requests that got a row.
        moved: row moves, applied in order.
    """

    batch_size: int
    removed: Sequence[RemovedRequest]
    added: Sequence[AddedRequest]
    moved: Sequence[MovedRequest]


T = TypeVar("T")


def apply_batch_update(states: dict[int, T], update: BatchUpdate | None,
                       new_state: Callable[[AddedRequest], T | None]) -> bool:
    """Apply ``update`` to per-row ``states`` (row -> a processor's state for the request
    there): added rows get ``new_state(added)`` (None: the request does not use the
    processor, and the row's entry is dropped), removed rows lose theirs, moves carry them.
    Returns whether ``states`` changed (False for ``update`` None)."""
    if update is None:
        return False
    changed = False
    for index in update.removed:
        changed |= states.pop(index, None) is not None
    for added in update.added:
        state = new_state(added)
        if state is not None:
            states[added[0]] = state
            changed = True
        else:
            changed |= states.pop(added[0], None) is not None
    for a, b, direction in update.moved:
        state_a, state_b = states.pop(a, None), states.pop(b, None)
        if state_a is not None:
            states[b] = state_a
        if direction is MoveDirectionality.SWAP and state_b is not None:
            states[a] = state_b
        changed |= state_a is not None or state_b is not None
    return changed
