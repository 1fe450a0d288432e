"""Every rank of one engine lays out the same rows in its input batch.

Tensor-parallel ranks all-reduce their partial hidden states row by row, and a pipeline stage
reads the rows the previous stage sent by index, so each rank must place every request in the
same row. Each worker process decodes a step's ``finished_ids`` into a set, and a set of
strings iterates in an order that follows the process's string hashing, which differs between
processes; the order in which finished rows are removed decides which rows move where
(the last row fills each hole). Seen before the fix: at TP=2 and PP=2, 12 concurrent requests
of the tiny Llama gave wrong logprobs (and tokens) once two requests finished in one step.

Oracles: two Python processes with different hash seeds (the set orders really differ), and the
row layout worked out by hand from "the last row moves into the hole".
"""

from __future__ import annotations

import subprocess
import sys

import torch

from kvflow.kv_cache_interface import FullAttentionSpec
from kvflow.sampling_params import SamplingParams
from kvflow.sched_output import SchedulerOutput
from kvflow.worker.input_batch import InputBatch
from kvflow.worker.input_batch_diffs import apply_scheduler_output
from kvflow.worker.request_state import RequestState

IDS = [str(i) for i in range(12)]


def _set_order(hash_seed: str) -> list[str]:
    code = f"print(' '.join(set({IDS!r})))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={"PYTHONHASHSEED": hash_seed}, timeout=30, check=True)
    return out.stdout.split()


def _rows_after_finishing(order: list[str]) -> list[str]:
    spec = FullAttentionSpec(4, 1, 8, torch.float32)
    batch = InputBatch(4, [spec])
    for i, rid in enumerate("abcd"):
        batch.add_request(RequestState(rid, [i + 1], SamplingParams(), 2), [], ([i + 1],), 0)
    # a list stands in for the set a worker decodes: its iteration order is the one under test
    apply_scheduler_output(batch, SchedulerOutput(finished_ids=order), {})  # type: ignore[arg-type]
    return list(batch.req_ids)


def test_processes_iterate_one_set_of_request_ids_in_different_orders():
    assert _set_order("1") != _set_order("2")


def test_row_layout_does_not_depend_on_the_order_finished_ids_iterate_in():
    """Removing a then b: d fills row 0, then c fills row 1 -> [d, c]; b then a would give
    [c, d] (the layout of a rank that iterated the set the other way)."""
    assert _rows_after_finishing(["a", "b"]) == _rows_after_finishing(["b", "a"]) == ["d", "c"]
