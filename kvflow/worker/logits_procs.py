"""A model runner's custom logits processors (``kvflow.logits_process``): built once per
runner, told each step how the persistent batch changed (``BatchUpdate``), applied by the
sampler to the step's logits laid out as the batch's rows.

The batch (``worker/input_batch.py``) keeps its rows dense: a removed request's row takes
the last row's request, and new requests are appended. Processors are told the same changes
in vLLM's form (removed, then added, then moved; an added request never lands on a live
request's row): since their last update, new requests first fill the rows left by removed
ones, lowest first, then go past the end, and moves (a swap where the target row is taken)
bring every request to its row in the batch. Without processors none of this runs
(``ModelRunner.logits_procs`` is None).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvflow.batch_update import AddedRequest, BatchUpdate, MoveDirectionality, MovedRequest
from kvflow.logits_process import LogitsProcessor
from kvflow.worker.input_batch import InputBatch
from kvflow.worker.request_state import RequestState

if TYPE_CHECKING:
    from kvflow.config import EngineConfig


class RunnerLogitsProcessors:
    """One runner's processor instances and what they were last told of the batch.

    Args:
        classes: the processor classes (``load_logits_processors``).
        config: the engine config, passed to each constructor.
        device: the runner's device.
    """

    def __init__(self, classes: Sequence[type[LogitsProcessor]], config: EngineConfig,
                 device: torch.device) -> None:
        pin = device.type == "cuda"
        self.processors = [cls(config, device, pin) for cls in classes]
        invariant = [p.is_argmax_invariant() for p in self.processors]
        self.argmax_invariant = [p for p, inv in zip(self.processors, invariant) if inv]
        self.non_argmax_invariant = [p for p, inv in zip(self.processors, invariant)
                                     if not inv]
        self._rows: dict[str, int] = {}  # request id -> row, as the processors know it
        self._size = 0
        self._outputs: dict[str, list[int]] = {}  # each request's generated ids (live lists)
        self._version = -1
        self._batch: InputBatch | None = None

    def begin_step(self, batch: InputBatch, requests: dict[str, RequestState]) -> None:
        """Before a step samples: extend each request's generated-token list with the
        tokens known since, then hand every processor the batch's changes (None when the
        rows did not change). Every token of the batch's rows must be on the host."""
        if batch is not self._batch:  # the first step, or a new KV cache's new batch
            self._batch, self._version = batch, -1
            batch.added_ids = set(batch.req_ids)  # every row is news to the processors
        update = self._batch_update(batch, requests) if batch.version != self._version \
            else None
        self._version = batch.version
        self._extend_outputs(batch)
        for processor in self.processors:
            processor.update_state(update)

    def _batch_update(self, batch: InputBatch, requests: dict[str, RequestState]
                      ) -> BatchUpdate | None:
        current, old = batch.req_id_to_index, self._rows
        added_ids, batch.added_ids = batch.added_ids or set(), set()
        gone = sorted(old[rid] for rid in old if rid not in current or rid in added_ids)
        new = [rid for rid in batch.req_ids if rid not in old or rid in added_ids]
        layout: list[str | None] = [None] * self._size
        for rid, row in old.items():
            layout[row] = rid
        for row in gone:
            layout[row] = None
        holes = list(gone)  # the rows left empty: ``removed``
        added: list[AddedRequest] = []
        for rid in new:
            row = holes.pop(0) if holes else len(layout)
            if row == len(layout):
                layout.append(None)
            layout[row] = rid
            state = requests[rid]
            self._outputs[rid] = []
            added.append((row, state.sampling_params, state.prompt_token_ids,
                          self._outputs[rid]))
        for rid in set(old) - set(current):
            self._outputs.pop(rid, None)
        moved = _moves_to(layout, batch.req_ids)
        self._rows, self._size = dict(current), batch.num_reqs
        if not (holes or added or moved):
            return None
        return BatchUpdate(batch.num_reqs, holes, added, moved)

    def _extend_outputs(self, batch: InputBatch) -> None:
        """Bring each request's generated-token list up to the batch's known tokens (a
        token still on the device, ``pending_sample``, is not known yet)."""
        n = batch.num_reqs
        starts = batch.num_prompt_tokens[:n]
        ends = batch.num_tokens[:n] - (batch.pending_sample[:n] >= 0)
        for rid, out in self._outputs.items():
            row = self._rows[rid]
            known = int(ends[row] - starts[row])
            if len(out) < known:
                start = int(starts[row])
                out.extend(batch.token_ids[row, start + len(out):start + known].tolist())
            elif len(out) > known:
                del out[known:]

    def for_rows(self, batch: InputBatch, rows: np.ndarray) -> StepLogitsProcessors:
        """The processors for a step that samples the batch rows ``rows`` (increasing int64
        [R]): sampling row ``i`` is batch row ``rows[i]``."""
        return StepLogitsProcessors(self, batch.index(rows), batch.num_reqs)


class StepLogitsProcessors:
    """The processors bound to one step's sampling rows (``RunnerLogitsProcessors.for_rows``).

    Processors see the logits as the batch's rows [batch_size, vocab]: when only some rows
    sample (a request in the middle of its prompt does not), the sampling rows are placed in
    a zero-filled tensor of that shape and read back after.
    """

    def __init__(self, procs: RunnerLogitsProcessors, index: np.ndarray | slice,
                 batch_size: int) -> None:
        self.procs, self.index, self.batch_size = procs, index, batch_size
        self.failed: dict[str, Exception] = {}  # request id -> what its row raised

    def apply(self, logits: torch.Tensor, argmax_invariant: bool) -> torch.Tensor:
        """``logits`` (float32 [R, vocab], the sampling rows) after the argmax-invariant
        processors (``argmax_invariant``) or the others, in their configured order; the same
        tensor when there are none. The requests whose rows a processor could not process
        (``LogitsProcessor.take_row_failures``) are added to ``failed``.

        Raises:
            Exception: what a processor raised for a row no request holds (no request to
                blame: the step fails), or what its batched ``apply`` raised.
        """
        processors = self.procs.argmax_invariant if argmax_invariant else \
            self.procs.non_argmax_invariant
        if not processors:
            return logits
        every_row = isinstance(self.index, slice)
        if every_row:
            full = logits
        else:
            rows = torch.from_numpy(self.index).to(logits.device)
            full = logits.new_zeros((self.batch_size, logits.shape[1]))
            full[rows] = logits
        by_row = {row: rid for rid, row in self.procs._rows.items()}
        for processor in processors:
            full = processor.apply(full)
            for row, error in processor.take_row_failures().items():
                if row not in by_row:  # no request there to blame: the step's failure
                    raise error
                self.failed.setdefault(by_row[row], error)
        return full if every_row else full[rows]


def _moves_to(layout: list[str | None], target: list[str]) -> list[MovedRequest]:
    """The moves that take ``layout`` (row -> request id or None, updated in place) to
    ``target`` (the batch's request ids by row): row by row, the request that belongs there
    is moved in (a swap when the row is taken). Rows already settled are never touched
    again, since every request still to place sits at a later row."""
    position = {rid: row for row, rid in enumerate(layout) if rid is not None}
    moved: list[MovedRequest] = []
    for row, rid in enumerate(target):
        src = position[rid]
        if src == row:
            continue
        other = layout[row] if row < len(layout) else None
        if other is None:
            moved.append((src, row, MoveDirectionality.UNIDIRECTIONAL))
            layout[src] = None
        else:
            moved.append((src, row, MoveDirectionality.SWAP))
            layout[src], position[other] = other, src
        layout[row], position[rid] = rid, row
    return moved

