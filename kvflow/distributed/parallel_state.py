"""The process groups of one engine's workers: tensor, pipeline, expert, data and context
parallel.

Global ranks are laid out as an array of shape ``[dp, pp, cp, tp]`` (tensor parallel
innermost, so a TP group is a run of neighbouring ranks, i.e. GPUs of one machine joined by
NVLink); a group of one axis is a line of that array along the axis. Data-parallel replicas are
separate engines with worlds of their own (``kvflow serve --data-parallel-size``), so inside one
engine ``dp = 1`` and the DP group is this rank alone. The expert-parallel group spans the data,
context and tensor axes of one pipeline stage (expert parallelism is refused with context
parallelism, so this is the TP group), so MoE layers place whole experts on the ranks that
split attention by heads.

Each worker builds its :class:`ParallelState` once (:func:`init_parallel_state`) and owns it;
layers receive the groups they need at construction. Nothing here is a module global: the only
process-wide state is torch.distributed's default group, which exists only in worker processes
of a multi-rank engine, so several single-rank engines share a process freely.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from kvflow.config import ParallelConfig
from kvflow.distributed.comm import CommGroup

logger = logging.getLogger(__name__)

# Axis order of the rank array, outermost first.
_AXES = ("dp", "pp", "cp", "tp")


@dataclass
class ParallelState:
    """This worker's groups.

    Attributes:
        world: every rank of the engine.
        tp / pp / dp / cp: the groups along each axis that contain this rank.
        ep: the expert-parallel group when ``enable_expert_parallel`` (MoE layers then hold
            ``num_experts / ep.world_size`` whole experts each), else None (every rank holds
            a slice of every expert).
        initialized_here: whether :func:`init_parallel_state` started torch.distributed (and
            :func:`destroy_parallel_state` must tear it down).
    """

    world: CommGroup
    tp: CommGroup
    pp: CommGroup
    dp: CommGroup
    cp: CommGroup
    ep: CommGroup | None = None
    initialized_here: bool = False

    @classmethod
    def single(cls, device: torch.device | None = None,
               expert_parallel: bool = False) -> ParallelState:
        """The state of a one-process engine: every group is this process alone."""
        one = CommGroup.single(device)
        return cls(one, one, one, one, one, one if expert_parallel else None)

    @property
    def rank(self) -> int:
        return self.world.global_rank

    @property
    def is_driver(self) -> bool:
        """The rank whose sampled tokens are returned: TP and CP rank 0 of the last pipeline
        stage (every rank of that stage samples the same tokens)."""
        return self.pp.is_last_rank and self.tp.rank == 0 and self.cp.rank == 0


def group_ranks(sizes: dict[str, int], axes: tuple[str, ...]) -> list[list[int]]:
    """Every group that spans ``axes`` of the rank array ``[dp, pp, cp, tp]``.

    Args:
        sizes: axis name -> size, for every name in ``_AXES``.
        axes: the axes one group spans (e.g. ``("tp",)``, or ``("dp", "cp", "tp")`` for
            expert parallelism).

    Returns:
        The groups' global ranks; each rank is in exactly one group. Example: ``pp=2, tp=2``
        gives TP groups ``[[0, 1], [2, 3]]`` and PP groups ``[[0, 2], [1, 3]]``.
    """
    ranks = np.arange(int(np.prod([sizes[a] for a in _AXES]))).reshape(
        [sizes[a] for a in _AXES])
    inner = [_AXES.index(a) for a in axes]
    outer = [i for i in range(len(_AXES)) if i not in inner]
    group_size = int(np.prod([sizes[a] for a in axes]))
    return ranks.transpose(outer + inner).reshape(-1, group_size).tolist()


def _sizes(config: ParallelConfig) -> dict[str, int]:
    """The axes of one engine's world (a data-parallel replica is an engine of its own)."""
    return {"dp": 1, "pp": config.pipeline_parallel_size,
            "cp": config.context_parallel_size, "tp": config.tensor_parallel_size}


def init_parallel_state(config: ParallelConfig, rank: int, init_method: str, backend: str,
                        device: torch.device, timeout_s: float = 600.0) -> ParallelState:
    """Join the engine's process group and build this rank's groups.

    Every rank of the engine must call this with the same arguments except ``rank``: groups
    are created collectively, in the same order everywhere.

    Args:
        config: the parallel sizes.
        rank: this process's global rank in ``[0, world_size)``.
        init_method: torch.distributed rendezvous (``file://...`` for one machine,
            ``tcp://host:port`` for several; the port picked free by the executor).
        backend: the platform's collective backend (``gloo`` on CPU, ``nccl`` on CUDA).
        device: where received tensors are allocated.
        timeout_s: how long a collective may wait for a peer before it fails.

    Raises:
        ValueError: if ``rank`` is outside the world.
    """
    sizes = _sizes(config)
    world_size = int(np.prod(list(sizes.values())))
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a world of {world_size}")
    if world_size == 1:
        return ParallelState.single(device, config.enable_expert_parallel)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))
    groups = {name: _make_group(group_ranks(sizes, axes), rank, backend, device)
              for name, axes in (("tp", ("tp",)), ("pp", ("pp",)), ("dp", ("dp",)),
                                 ("cp", ("cp",)), ("ep", ("dp", "cp", "tp")))}
    world = CommGroup(list(range(world_size)), rank, dist.group.WORLD, device)
    logger.info("rank %d: tp %s, pp %s, cp %s", rank, groups["tp"].ranks, groups["pp"].ranks,
                groups["cp"].ranks)
    return ParallelState(world, groups["tp"], groups["pp"], groups["dp"], groups["cp"],
                         groups["ep"] if config.enable_expert_parallel else None,
                         initialized_here=True)


def _make_group(all_groups: list[list[int]], rank: int, backend: str,
                device: torch.device) -> CommGroup:
    """Create every group of one axis (collectively) and return the one holding ``rank``."""
    mine = None
    for ranks in all_groups:
        handle = dist.new_group(ranks, backend=backend) if len(ranks) > 1 else None
        if rank in ranks:
            mine = CommGroup(ranks, rank, handle, device)
    return mine


def destroy_parallel_state(state: ParallelState | None) -> None:
    """Tear down the process groups this rank created (idempotent; a no-op for a
    one-process engine)."""
    if state is not None and state.initialized_here and dist.is_initialized():
        dist.destroy_process_group()
        state.initialized_here = False


def pp_layer_range(num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """The contiguous layers ``[start, end)`` of pipeline stage ``pp_rank``.

    Layers are split as evenly as possible; the first ``num_layers % pp_size`` stages take
    one extra layer (the last stage also runs the final norm, LM head and sampler).

    Raises:
        ValueError: if there are fewer layers than stages.
    """
    if num_layers < pp_size:
        raise ValueError(f"pipeline_parallel_size={pp_size} exceeds the model's {num_layers} "
                         "layers")
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    return start, start + base + (1 if pp_rank < extra else 0)
