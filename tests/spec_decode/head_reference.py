"""Oracle pieces shared by the speculative-head engine tests (EAGLE-1: test_eagle_engine.py,
EAGLE-3: test_eagle3_engine.py, DeepSeek MTP: test_deepseek_mtp_engine.py): the reference
heads' draft loop, and the acceptance counts a run's drafts and output imply."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch


def ref_rollout(head_pass: Callable[[list[int], torch.Tensor], torch.Tensor],
                readout: Callable[[torch.Tensor], tuple[torch.Tensor, int]],
                context: list[int], feats: torch.Tensor, k: int,
                given: list[int] | None = None) -> tuple[list[int], torch.Tensor]:
    """A speculative head's k drafts after ``context`` (x[0..n]), as EAGLE feeds a head its
    own outputs (Li et al. 2024, arXiv 2401.15077): position p takes token x[p+1] and feature
    ``feats[p]`` ([n, H] from the target); each draft runs ``head_pass(ids, feats) -> h``
    ([T, H], all positions, causal), ``readout(h[-1]) -> (row, greedy token)``, and appends
    the draft (the greedy token, or ``given[i]``) to the tokens and ``h[-1]`` to the
    features. Returns the drafts and the rows stacked [k, ...]."""
    ids, chosen, rows = list(context[1:]), [], []
    with torch.no_grad():
        for i in range(k):
            h = head_pass(ids, feats)
            row, greedy = readout(h[-1])
            rows.append(row)
            chosen.append(greedy if given is None else given[i])
            ids.append(chosen[-1])
            feats = torch.cat([feats, h[-1:]])
    return chosen, torch.stack(rows)


def expected_counts(seen: Sequence[tuple[list[int], list[int], Any]],
                    outputs: Sequence[Any]) -> tuple[int, int]:
    """(drafted, accepted) tokens the engine's counters must show for greedy ``outputs``
    (RequestOutputs) given every proposal ``seen`` (context, drafts, q): each step's drafts
    are accepted up to the first one the final output contradicts."""
    sequences = [o.prompt_token_ids + o.outputs[0].token_ids for o in outputs]
    drafted = accepted = 0
    for context, drafts, _ in seen:
        full = next(v for v in sequences if v[:len(context)] == context)
        truth = full[len(context):len(context) + len(drafts)]
        drafted += len(drafts)
        accepted += int(np.cumprod([a == b for a, b in zip(drafts, truth)]).sum())
    return drafted, accepted
