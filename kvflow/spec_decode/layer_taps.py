"""EAGLE-3's taps on the target (arXiv 2503.01840, section 3): the residual stream entering
some of its decoder layers, read during each target forward (vLLM's
``aux_hidden_state_layers``: ``hidden + residual`` before layer ``i``, i.e. transformers'
``output_hidden_states[i]``).

The target's forward returns them (``LlamaModel.aux_hidden_state_layers``, as vLLM's Llama
returns ``(hidden, aux_hidden_states)``): no hooks, so a replayed CUDA graph or CPU step graph
produces them as the eager forward does, in the graph runner's fixed buffers
(``worker/step_graphs.py``). With no taps set the target runs its plain layer loop.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from kvflow.models.llama import LlamaModel


class LayerTaps:
    """Sets the target's decoder stack to return the residual stream entering its layers
    ``layer_ids`` with each forward, and puts them side by side for the head.

    Args:
        target: the target model; its decoder stack (``target.model``) must run
            :class:`~kvflow.models.llama.LlamaModel`'s forward, which returns the taps
            (Llama, Mistral, Qwen2, Qwen3, ...).
        layer_ids: the layers tapped, in the order their states are concatenated.
        what: the name the error messages give ``layer_ids`` (the config field).

    Raises:
        ValueError: for another decoder stack, or a layer id outside ``[0, num_layers)``.
    """

    def __init__(self, target: nn.Module, layer_ids: Sequence[int], what: str) -> None:
        stack = getattr(target, "model", None)
        if stack is None or type(stack).forward is not LlamaModel.forward:
            raise ValueError(f"{what}: EAGLE-3 taps need a target whose decoder stack is "
                             f"kvflow's LlamaModel (Llama, Mistral, Qwen2, Qwen3 ...); "
                             f"{type(target).__name__} has another")
        num_layers = len(stack.layers)
        bad = [i for i in layer_ids if not (isinstance(i, int) and 0 <= i < num_layers)]
        if bad or not layer_ids:
            raise ValueError(f"{what}={list(layer_ids)}: layer ids must be in [0, "
                             f"{num_layers}) for a target of {num_layers} layers")
        self.layer_ids = tuple(layer_ids)
        self._stack: LlamaModel | None = stack
        stack.aux_hidden_state_layers = self.layer_ids

    def combine(self, taps: list[torch.Tensor] | None) -> torch.Tensor:
        """[T, len(layer_ids) * H]: one forward's taps ([T, H] each, in ``layer_ids`` order:
        ``worker/forward_pass.py`` ``split_aux_hidden``) side by side.

        Raises:
            RuntimeError: for a forward that returned no taps (a bookkeeping error).
        """
        if taps is None or len(taps) != len(self.layer_ids):
            raise RuntimeError(f"EAGLE-3: the target's forward returned no taps of layers "
                               f"{list(self.layer_ids)}")
        return torch.cat(taps, dim=-1)

    def remove(self) -> None:
        """Stop the target's forward returning the taps."""
        if self._stack is not None:
            self._stack.aux_hidden_state_layers = ()
            self._stack = None
