"""Collectives over one process group, as the layers and the model runner use them.

A :class:`CommGroup` is one axis of the parallel layout (the tensor-parallel ranks of a pipeline
stage, the stages of a pipeline, ...) seen from one process: its members' global ranks, this
process's index among them, and the torch.distributed group that connects them. A group of one
process has no torch group at all and every collective is the identity, so single-process code
runs the same layers without a special case. Groups are plain objects owned by the worker
(:class:`kvflow.distributed.parallel_state.ParallelState`), never module globals, so two
engines in one process do not share them.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

# Hidden states (and the residual) that one pipeline stage hands the next, by name.
IntermediateTensors = dict[str, torch.Tensor]


class CommGroup:
    """One process group from this process's point of view.

    Args:
        ranks: the members' global ranks, in group order.
        rank: this process's global rank (must be in ``ranks``).
        device_group: the torch.distributed group of ``ranks`` (None when ``ranks`` has one
            member: nothing to communicate).
        device: where tensors received from other ranks are allocated.

    Raises:
        ValueError: if ``rank`` is not a member, or a group of several ranks has no
            ``device_group``.
    """

    def __init__(self, ranks: Sequence[int], rank: int, device_group: Any = None,
                 device: torch.device | None = None) -> None:
        if rank not in ranks:
            raise ValueError(f"rank {rank} is not a member of group {list(ranks)}")
        if len(ranks) > 1 and device_group is None:
            raise ValueError(f"group {list(ranks)} of several ranks needs a process group")
        self.ranks = list(ranks)
        self.global_rank = rank
        self.rank = self.ranks.index(rank)  # index in the group: tp_rank, pp_rank, ...
        self.world_size = len(self.ranks)
        self.device_group = device_group
        self.device = device or torch.device("cpu")
        self._pending: list[tuple[Any, torch.Tensor]] = []  # sends in flight (pipeline)
        self.comm_time_s = 0.0  # seconds inside this group's collectives (incl. waiting)

    @classmethod
    def single(cls, device: torch.device | None = None) -> CommGroup:
        """A group of this process alone (every collective is the identity)."""
        return cls([0], 0, None, device)

    @property
    def is_first_rank(self) -> bool:
        return self.rank == 0

    @property
    def is_last_rank(self) -> bool:
        return self.rank == self.world_size - 1

    def __repr__(self) -> str:
        return f"CommGroup(ranks={self.ranks}, rank={self.rank})"

    # ---- collectives -------------------------------------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the group, in place; returns ``x`` (any shape and dtype)."""
        if self.world_size > 1:
            start = time.perf_counter()
            dist.all_reduce(x, group=self.device_group)
            self.comm_time_s += time.perf_counter() - start
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's ``x`` along ``dim`` in group-rank order.

        Args:
            x: this rank's part; every rank's has the same shape.

        Returns:
            ``x``'s shape with ``dim`` ``world_size`` times longer.
        """
        if self.world_size == 1:
            return x
        start = time.perf_counter()
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous(), group=self.device_group)
        self.comm_time_s += time.perf_counter() - start
        return torch.cat(parts, dim=dim)

    def reduce_scatter(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Sum ``x`` over the group and keep this rank's ``1 / world_size`` slice of ``dim``.

        gloo has no reduce-scatter: there it is an all-reduce followed by the slice (same
        result, ``world_size`` times the bytes received).

        Raises:
            ValueError: if ``x.shape[dim]`` is not divisible by the group size.
        """
        if self.world_size == 1:
            return x
        if x.shape[dim] % self.world_size:
            raise ValueError(f"reduce_scatter: dim {dim} of shape {tuple(x.shape)} is not "
                             f"divisible by the group size {self.world_size}")
        size = x.shape[dim] // self.world_size
        if dist.get_backend(self.device_group) == "gloo":
            return self.all_reduce(x.clone()).narrow(dim, self.rank * size, size).contiguous()
        parts = [p.contiguous() for p in x.split(size, dim=dim)]
        out = torch.empty_like(parts[0])
        dist.reduce_scatter(out, parts, group=self.device_group)
        return out

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Overwrite ``x`` (any shape and dtype, the same on every rank) in place with group
        rank 0's; returns ``x``."""
        if self.world_size > 1:
            start = time.perf_counter()
            dist.broadcast(x, src=self.ranks[0], group=self.device_group)
            self.comm_time_s += time.perf_counter() - start
        return x

    def barrier(self) -> None:
        """Wait until every rank of the group reaches this call."""
        if self.world_size > 1:
            dist.barrier(group=self.device_group)

    # ---- ring (context parallelism) ---------------------------------------------------------
    def ring_shift(self, x: torch.Tensor) -> RingShift:
        """Start passing ``x`` one step around the ring: send it to group rank ``rank + 1``
        and receive the same-shaped tensor of rank ``rank - 1`` (both mod ``world_size``),
        without waiting (Ring Attention's K/V rotation, Liu et al. 2023). Every rank of the
        group must call it with the same shape and dtype. The send and the receive are issued
        as one batch (``batch_isend_irecv``), so two ranks that send to each other do not
        deadlock on NCCL.

        Args:
            x: this rank's tensor (any shape and dtype; not modified until ``wait``).

        Returns:
            A :class:`RingShift` whose ``wait()`` gives the previous rank's tensor.
        """
        if self.world_size == 1:
            return RingShift([], x, self)
        n = self.world_size
        x = x.contiguous()
        received = torch.empty_like(x)
        ops = [dist.P2POp(dist.isend, x, self.ranks[(self.rank + 1) % n], self.device_group),
               dist.P2POp(dist.irecv, received, self.ranks[(self.rank - 1) % n],
                          self.device_group)]
        return RingShift(dist.batch_isend_irecv(ops), received, self, keep=x)

    # ---- point to point (pipeline stages) ----------------------------------------------------
    def send_tensors(self, tensors: IntermediateTensors, dst: int) -> None:
        """Send named tensors to group rank ``dst`` without waiting for the receiver: one
        int64 header (count, then per tensor: name length, name bytes, ndim, shape, dtype
        code), then the tensors. The previous call's sends are completed first, so at most
        one message per group is in flight. ``recv_tensors`` on ``dst`` receives them."""
        self.wait_sends()
        names = sorted(tensors)
        parts = [tensors[n].contiguous() for n in names]
        fields = [len(parts)]
        for name, t in zip(names, parts):
            encoded = list(name.encode())
            fields += [len(encoded), *encoded, t.dim(), *t.shape, _DTYPE_CODES[t.dtype]]
        header = torch.tensor(fields, dtype=torch.int64, device=self.device)
        size = torch.tensor([header.numel()], dtype=torch.int64, device=self.device)
        peer = self.ranks[dst]
        self._pending = [(dist.isend(t, peer, group=self.device_group), t)
                         for t in (size, header, *parts)]

    def wait_sends(self) -> None:
        """Complete the sends of the last ``send_tensors`` call."""
        start = time.perf_counter()
        for work, _ in self._pending:
            work.wait()
        self._pending = []
        self.comm_time_s += time.perf_counter() - start

    def recv_tensors(self, src: int) -> IntermediateTensors:
        """Receive what ``send_tensors`` sent from group rank ``src`` (blocks until it has).

        Returns:
            name -> tensor on this group's device, shapes and dtypes as sent.
        """
        peer, start = self.ranks[src], time.perf_counter()
        size = torch.empty(1, dtype=torch.int64, device=self.device)
        dist.recv(size, peer, group=self.device_group)
        header = torch.empty(int(size.item()), dtype=torch.int64, device=self.device)
        dist.recv(header, peer, group=self.device_group)
        fields, out = header.tolist(), {}
        pos = 1
        for _ in range(fields[0]):
            name_len = fields[pos]
            name = bytes(fields[pos + 1:pos + 1 + name_len]).decode()
            pos += 1 + name_len
            ndim = fields[pos]
            shape, dtype = fields[pos + 1:pos + 1 + ndim], _CODE_DTYPES[fields[pos + 1 + ndim]]
            pos += ndim + 2
            out[name] = torch.empty(shape, dtype=dtype, device=self.device)
            dist.recv(out[name], peer, group=self.device_group)
        self.comm_time_s += time.perf_counter() - start
        return out


class RingShift:
    """A ring step in flight (:meth:`CommGroup.ring_shift`); ``wait()`` returns the tensor
    received from the previous rank (for one rank: the tensor itself)."""

    def __init__(self, works: list[Any], received: torch.Tensor, group: CommGroup,
                 keep: torch.Tensor | None = None) -> None:
        self._works, self._received, self._group = works, received, group
        self._keep = keep  # the tensor being sent stays alive until the send completes

    def wait(self) -> torch.Tensor:
        start = time.perf_counter()
        for work in self._works:
            work.wait()
        self._works, self._keep = [], None
        self._group.comm_time_s += time.perf_counter() - start
        return self._received


_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.int64: 3,
                torch.int32: 4, torch.uint8: 5}
_CODE_DTYPES = {code: dtype for dtype, code in _DTYPE_CODES.items()}
