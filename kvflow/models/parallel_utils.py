"""Pipeline-parallel building blocks shared by the model files.

A pipeline stage builds only its own decoder layers (a contiguous range, see
:func:`kvflow.distributed.parallel_state.pp_layer_range`); the other layers, and the
embedding / final norm / LM head where another stage owns them, are :class:`PPMissingLayer`
placeholders, so module names and layer indices (and therefore checkpoint names and KV-cache
layer names) are the same on every stage. A stage's ``forward`` takes the previous stage's
:data:`~kvflow.distributed.comm.IntermediateTensors` instead of token ids and returns its own
for the next stage; only the last stage returns final hidden states.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from kvflow.distributed.comm import CommGroup
from kvflow.distributed.parallel_state import pp_layer_range


class PPMissingLayer(nn.Identity):
    """Stands where another pipeline stage owns the module (no parameters)."""


def make_layers(num_layers: int, pp: CommGroup, build: Callable[[int], nn.Module]
                ) -> tuple[int, int, nn.ModuleList]:
    """The decoder layers of pipeline stage ``pp.rank``.

    Args:
        num_layers: the model's decoder layers.
        pp: the pipeline group (one member: every layer is built).
        build: ``layer_idx -> module`` for the layers this stage owns.

    Returns:
        (start, end, layers): this stage owns ``[start, end)``; ``layers`` has all
        ``num_layers`` entries, the others :class:`PPMissingLayer`.

    Raises:
        ValueError: if there are fewer layers than stages.
    """
    start, end = pp_layer_range(num_layers, pp.rank, pp.world_size)
    return start, end, nn.ModuleList(build(i) if start <= i < end else PPMissingLayer()
                                     for i in range(num_layers))


def is_pp_missing(name: str, model: nn.Module) -> bool:
    """Whether parameter ``name`` belongs to a module another pipeline stage owns (its
    checkpoint tensor is skipped here)."""
    module: nn.Module = model
    for part in name.split(".")[:-1]:
        module = getattr(module, part, None)
        if module is None or isinstance(module, PPMissingLayer):
            return isinstance(module, PPMissingLayer)
    return False
