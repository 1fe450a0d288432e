"""Absmax of whole checkpoint tensors, noted while a tensor-parallel rank loads its shard, so
that every rank quantizes its part with the scale one process would use.

Scales quantized on load are absmax statistics: INT8 ``max_k |W[n, k]| / 127`` per output row,
FP8 ``max |W| / 448`` per checkpoint tensor (q, k, v, gate, up, ...). A rank of a
tensor-parallel layer holds only part of what such a statistic spans: a row-parallel layer
(o_proj, down_proj) half of every row, a column-parallel one half of every tensor's rows. Taken
over the shard, the scale differs from one process's and so does every rounded weight (greedy
tokens at TP=2 then part from TP=1). The loaders see the full checkpoint tensor before they
slice it, so the quantization methods note its absmax here and use it after loading.

The notes live on the layer (``layer._load_absmax``, a dict) until the method takes them; a
statistic noted twice under one key keeps the larger value (a scale never shrinks below what a
loaded value needs, so nothing saturates).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

_ATTR = "_load_absmax"


def note_absmax(layer: nn.Module, key: Any, absmax: torch.Tensor) -> None:
    """Record ``absmax`` (float32, any shape) under ``key`` on ``layer`` (elementwise max with
    an earlier note of the same key)."""
    notes = layer.__dict__.setdefault(_ATTR, {})
    absmax = absmax.detach().float()
    notes[key] = absmax if key not in notes else torch.maximum(notes[key], absmax)


def take_absmax(layer: nn.Module, key: Any) -> torch.Tensor | None:
    """The absmax noted under ``key`` (removed from the layer), or None if none was."""
    notes = layer.__dict__.get(_ATTR, {})
    value = notes.pop(key, None)
    if not notes:
        layer.__dict__.pop(_ATTR, None)
    return value


def splits_columns(layer: nn.Module, param: torch.Tensor, loaded: torch.Tensor) -> bool:
    """Whether ``param`` (``[N, K / tp]``) takes a slice of the columns of ``loaded``
    (``[N, K]``): a row-parallel layer over several ranks, fed the full checkpoint tensor."""
    return (getattr(layer, "tp_size", 1) > 1 and getattr(layer, "tp_dim", None) == 1
            and loaded.dim() == 2 and param.dim() == 2 and loaded.shape[0] == param.shape[0]
            and loaded.shape[1] == param.shape[1] * layer.tp_size)
