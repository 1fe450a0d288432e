"""Linear layers that know how to load (and, with tensor parallelism, shard) their weights.

Each parameter carries a ``weight_loader(param, loaded_weight, shard_id=None)``: the layer that
defines a layout (fused q/k/v, fused gate/up, column or row split) is the one that knows how a
checkpoint tensor lands in it. ``tp_rank``/``tp_size`` are passed in explicitly; with
``tp_size == 1`` every loader is a plain copy. The one collective, the all-reduce of a
row-parallel layer's partial sums, goes through the ``tp_group`` (a
:class:`~kvflow.distributed.comm.CommGroup`) the layer is given.

The weight itself belongs to the layer's quantization method (``kvflow/quant/base.py``:
``create_weights`` / ``load`` / ``process_weights_after_loading`` / ``apply``): the layer keeps its
shape, TP placement and bias, and ``forward`` is ``quant_method.apply``. Unquantized is the
default; ``set_quant_method`` swaps in another scheme before loading, so a new scheme never
changes these classes.
"""

from __future__ import annotations

import torch
from torch import nn

from kvflow.distributed.comm import CommGroup
from kvflow.kernels.gemm import GemmPathMixin
from kvflow.quant.base import LinearMethod
from kvflow.quant.unquantized import UnquantizedLinearMethod


def _set_loader(param: nn.Parameter, loader) -> nn.Parameter:
    param.weight_loader = loader  # type: ignore[attr-defined]
    return param


class LinearBase(GemmPathMixin, nn.Module):
    """y = x @ W.T (+ b). W: [output_size_per_partition, input_size_per_partition], stored as
    the quantization method says (default: unquantized, in the model dtype).

    Attributes:
        shard_ids: the checkpoint shards fused into this layer, in row order (``(None,)`` for
            an unfused one); quantization methods that keep shards apart read it.
        quantizable: False keeps the layer unquantized under any ``--quantization`` (MoE
            routers: a rounded router logit can flip an expert choice).
    """

    shard_ids: tuple = (None,)
    quantizable: bool = True  # False: --quantization leaves this layer (a router) unquantized

    def __init__(self, input_size: int, output_size: int, bias: bool, tp_dim: int | None,
                 tp_rank: int = 0, tp_size: int = 1,
                 quant_method: LinearMethod | None = None) -> None:
        super().__init__()
        self.tp_rank, self.tp_size, self.tp_dim = tp_rank, tp_size, tp_dim
        self.input_size_per_partition, self.output_size_per_partition = input_size, output_size
        self.params_dtype = torch.get_default_dtype()
        self.bias = None
        if bias:
            self.bias = _set_loader(nn.Parameter(torch.empty(output_size), requires_grad=False),
                                    self.weight_loader)
        self.quant_method: LinearMethod | None = None
        self.set_quant_method(quant_method or UnquantizedLinearMethod())

    def set_quant_method(self, method: LinearMethod) -> None:
        """Replace the weight parameters with those of ``method`` (call before loading); each
        new parameter loads through ``method.load``."""
        for name in getattr(self, "_quant_param_names", ()):
            delattr(self, name)
        before = set(self._parameters)
        self.quant_method = method
        method.create_weights(self, self.input_size_per_partition,
                              self.output_size_per_partition, self.params_dtype)
        self._quant_param_names = tuple(n for n in self._parameters if n not in before)
        for name in self._quant_param_names:
            param = self._parameters[name]
            _set_loader(param, lambda p, loaded, *shard: method.load(self, p, loaded, *shard))

    def _shard(self, param: nn.Parameter, loaded: torch.Tensor) -> torch.Tensor:
        if self.tp_dim is None or self.tp_size == 1 or (param.dim() == 1 and self.tp_dim == 1):
            return loaded
        size = param.shape[self.tp_dim]
        return loaded.narrow(self.tp_dim, self.tp_rank * size, size)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        """Copy this TP rank's slice of the full checkpoint tensor ``loaded`` into ``param``.

        Raises:
            ValueError: when the slice's shape is not ``param``'s, dimensions of size 1 aside
                (a checkpoint scale ``[N, 1]`` loads into ``[N]``): a config that does not
                describe the checkpoint, or a transposed or flattened tensor, which a reshape
                of the same number of values would load scrambled.
        """
        shard = self._shard(param, loaded)
        if _sizes(shard) != _sizes(param):
            raise ValueError(f"shape {tuple(loaded.shape)} does not fit the "
                             f"{tuple(param.shape)} the config gives this rank")
        param.data.copy_(shard.reshape(param.shape))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)


def _sizes(tensor: torch.Tensor) -> tuple[int, ...]:
    """``tensor``'s dimensions without those of size 1."""
    return tuple(d for d in tensor.shape if d != 1)


def _check_columns(loaded: torch.Tensor, param: nn.Parameter) -> None:
    """A fused sub-projection's checkpoint tensor must match the fused ``param`` past the
    rows (its input features): ``copy_`` would broadcast a single column over every column,
    or raise a torch error naming neither the tensor nor the config.

    Raises:
        ValueError: naming both shapes.
    """
    if tuple(loaded.shape[1:]) != tuple(param.shape[1:]):
        raise ValueError(f"shape {tuple(loaded.shape)}: the config gives it "
                         f"{list(param.shape[1:])} past the rows (input features)")


def _check_rows(loaded: torch.Tensor, rows: int) -> None:
    """A fused sub-projection's full checkpoint tensor must have the ``rows`` its config
    gives (narrowing a larger one would load part of it silently).

    Raises:
        ValueError: naming both row counts.
    """
    if loaded.dim() == 0 or loaded.shape[0] != rows:
        raise ValueError(f"shape {tuple(loaded.shape)}: the config gives it {rows} "
                         "rows (output features)")


class ReplicatedLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__(input_size, output_size, bias, tp_dim=None)


class ColumnParallelLinear(LinearBase):
    """Output features split across TP ranks (no communication in forward)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 tp_rank: int = 0, tp_size: int = 1) -> None:
        if output_size % tp_size:
            raise ValueError(f"output_size {output_size} not divisible by tp_size {tp_size}")
        super().__init__(input_size, output_size // tp_size, bias, 0, tp_rank, tp_size)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections fused into one matmul (e.g. gate_up_proj).

    Checkpoint tensors arrive one per sub-projection with ``shard_id`` = its index.
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False,
                 tp_rank: int = 0, tp_size: int = 1) -> None:
        self.output_sizes = output_sizes
        self.shard_ids = tuple(range(len(output_sizes)))
        super().__init__(input_size, sum(output_sizes), bias, tp_rank, tp_size)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: int | None = None) -> None:
        """Copy sub-projection ``shard_id``'s full tensor ``loaded`` (this rank's rows of it)
        into its place in the fused ``param``.

        Raises:
            ValueError: when ``shard_id`` is None or not an index of ``output_sizes``, or
                ``loaded``'s rows or columns are not the config's.
        """
        if shard_id is None or not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(f"MergedColumnParallelLinear needs a shard_id in "
                             f"[0, {len(self.output_sizes)}), got {shard_id!r}")
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        size = self.output_sizes[shard_id] // self.tp_size
        _check_rows(loaded, self.output_sizes[shard_id])
        _check_columns(loaded, param)
        shard = loaded.narrow(0, self.tp_rank * size, size)
        param.data.narrow(0, offset, size).copy_(shard)


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections fused into one matmul; KV heads are split (or replicated) by TP.

    Checkpoint tensors arrive with ``shard_id`` in {"q", "k", "v"}.
    """

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False, tp_rank: int = 0, tp_size: int = 1) -> None:
        self.head_dim = head_dim
        self.num_heads = num_heads // tp_size
        self.num_kv_heads = max(1, num_kv_heads // tp_size)
        self.num_kv_replicas = max(1, tp_size // num_kv_heads)
        self.total_num_heads, self.total_num_kv_heads = num_heads, num_kv_heads
        self.shard_ids = ("q", "k", "v")
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim * tp_size
        super().__init__(hidden_size, out, bias, tp_rank, tp_size)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: str | None = None) -> None:
        """Copy the full q, k or v projection ``loaded`` (this rank's heads of it) into its
        place in the fused ``param``.

        Raises:
            ValueError: when ``shard_id`` is not "q", "k" or "v", or ``loaded``'s rows or
                columns are not the config's.
        """
        if shard_id not in ("q", "k", "v"):
            raise ValueError(f"QKVParallelLinear needs a shard_id of 'q', 'k' or 'v', "
                             f"got {shard_id!r}")
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        offset, size, rank = {"q": (0, q_size, self.tp_rank),
                              "k": (q_size, kv_size, self.tp_rank // self.num_kv_replicas),
                              "v": (q_size + kv_size, kv_size,
                                    self.tp_rank // self.num_kv_replicas)}[shard_id]
        heads = self.total_num_heads if shard_id == "q" else self.total_num_kv_heads
        _check_rows(loaded, heads * self.head_dim)
        _check_columns(loaded, param)
        param.data.narrow(0, offset, size).copy_(loaded.narrow(0, rank * size, size))


class RowParallelLinear(LinearBase):
    """Input features split across TP ranks; the partial sums are all-reduced over
    ``tp_group`` (needed when ``tp_size > 1``). The bias is added once, on TP rank 0."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 tp_rank: int = 0, tp_size: int = 1, tp_group: CommGroup | None = None) -> None:
        if input_size % tp_size:
            raise ValueError(f"input_size {input_size} not divisible by tp_size {tp_size}")
        super().__init__(input_size // tp_size, output_size, bias, 1, tp_rank, tp_size)
        self.tp_group = tp_group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, input_size / tp_size] -> [T, output_size], summed over the TP ranks.

        Raises:
            RuntimeError: when ``tp_size > 1`` and the layer was built without a ``tp_group``.
        """
        return self.reduce_partial(self.forward_partial(x))

    def forward_partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's partial sum: x [T, input_size / tp_size] -> [T, output_size] over its
        input columns (the bias on TP rank 0 only), before the all-reduce."""
        bias = self.bias if self.tp_rank == 0 else None
        return self.quant_method.apply(self, x, bias)

    def reduce_partial(self, y: torch.Tensor) -> torch.Tensor:
        """Sum the ranks' partial outputs ``y`` [T, output_size] (one all-reduce over the TP
        group; the identity on one rank).

        Raises:
            RuntimeError: when ``tp_size > 1`` and the layer was built without a ``tp_group``.
        """
        if self.tp_size > 1:
            y = require_group(self.tp_group, self.tp_size).all_reduce(y)
        return y


def require_group(group: CommGroup | None, size: int) -> CommGroup:
    """``group``, checked to be a group of ``size`` ranks.

    Raises:
        RuntimeError: when ``group`` is None or of another size (a layer built for tensor
            parallelism without its process group).
    """
    if group is None or group.world_size != size:
        raise RuntimeError(f"a layer split over {size} ranks needs their process group, got "
                           f"{group!r}")
    return group
