"""EAGLE-3's taps on the target (arXiv 2503.01840, section 3): the residual stream entering
some of its decoder layers, read during each target forward (vLLM's
``aux_hidden_state_layers``: ``hidden + residual`` before layer ``i``, i.e. transformers'
``output_hidden_states[i]``).

The taps are forward pre-hooks on the target's layers, so the target model is not changed.
They run only in eager forwards: a replayed CUDA graph skips them, so an engine whose head
reads taps runs its steps without graphs (``worker/step_graphs.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from kvflow.models.llama import LlamaModel


class LayerTaps:
    """Reads the residual stream entering the target's layers ``layer_ids`` on each forward.

    Args:
        target: the target model; its decoder stack (``target.model``) must run
            :class:`~kvflow.models.llama.LlamaModel`'s layer loop, which calls each layer as
            ``layer(positions, hidden, residual)`` (Llama, Mistral, Qwen2, Qwen3, ...).
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
        self._states: dict[int, torch.Tensor] = {}
        self._handles = [stack.layers[i].register_forward_pre_hook(self._hook(i))
                         for i in sorted(set(self.layer_ids))]

    def _hook(self, index: int) -> Any:
        def tap(module: nn.Module, args: tuple) -> None:
            _, hidden, residual = args[:3]
            self._states[index] = hidden if residual is None else hidden + residual
        return tap

    def take(self) -> torch.Tensor:
        """[T, len(layer_ids) * H]: the last forward's taps side by side (then forgotten).

        Raises:
            RuntimeError: if a tapped layer did not run since the last ``take`` (a replayed
                graph, a bookkeeping error).
        """
        missing = [i for i in self.layer_ids if i not in self._states]
        if missing:
            raise RuntimeError(f"EAGLE-3: target layers {missing} were not tapped this step")
        states, self._states = self._states, {}
        return torch.cat([states[i] for i in self.layer_ids], dim=-1)

    def remove(self) -> None:
        """Unhook from the target's layers."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
