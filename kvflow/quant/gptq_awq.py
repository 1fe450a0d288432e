"""GPTQ and AWQ pre-quantized 4-bit checkpoints, unpacked at load into kvflow's ``int4`` kernel
layout (:class:`~kvflow.quant.int4.Int4WeightOnlyMethod`).

Both formats store, per quantized linear layer of ``K`` input and ``N`` output features, with
``G`` groups of ``group_size`` input columns (``group_size == -1``: one group, per channel):

=========  ==========================================  =========================================
tensor     GPTQ (AutoGPTQ / GPTQModel / optimum)        AWQ (AutoAWQ ``version: gemm``)
=========  ==========================================  =========================================
qweight    int32 [K / 8, N]: 8 input rows per word      int32 [K, N / 8]: 8 output columns per
           (row ``8i + j`` at bits ``4j``)              word, in AWQ's order: bits ``4j`` hold
                                                        column ``8c + [0,2,4,6,1,3,5,7][j]``
qzeros     int32 [G, N / 8], columns in order           int32 [G, N / 8], AWQ's order
scales     fp16 [G, N]                                  fp16 [G, N]
g_idx      int32 [K]: the group of each input column    --
=========  ==========================================  =========================================

and ``w[n, k] = scales[g, n] * (q[k, n] - zero[g, n])`` with ``g = g_idx[k]`` (GPTQ) or
``k // group_size``. GPTQ's historical format (``checkpoint_format: gptq``, what AutoGPTQ wrote
and what the Hub's GPTQ models hold) stores ``zero - 1`` in ``qzeros`` (a symmetric checkpoint's
zero 8 is stored as 7); GPTQModel's ``gptq_v2`` stores the zero itself. AWQ stores the zero.

kvflow's int4 convention is ``w = (u - 8) * scale + zero_kv`` (torch's tinygemm kernels), so
``u = q``, ``scale = scales`` and ``zero_kv = (8 - zero) * scales`` give the same weights.

GPTQ's act-order (``desc_act: true``) quantizes input columns in a permuted order, so a group's
columns are scattered (``g_idx``). At load the columns are sorted by ``g_idx`` (stably) so each
group becomes contiguous, and each call gathers the activation's columns in that order: ``x[:,
perm] @ W[:, perm].T`` is ``x @ W.T``. A fused layer (q/k/v, gate/up) needs one order for all
its shards; GPTQ computes it from the layer input's Hessian, which the shards share, so equal
``g_idx`` are required (else a ValueError). Under tensor parallelism a row-parallel layer's act-
ordered groups straddle ranks: refused naming ``desc_act``.

8-bit GPTQ (``bits: 8``, 4 values a word) must be symmetric (every zero point 128): it runs as
:class:`~kvflow.quant.pack_quantized.PackedInt8Method` with ``int8 = q - 128``.

Refused, naming the key: other ``bits`` (``w_bit`` for AWQ, 4 only), 8-bit ``sym: false``, GPTQ ``checkpoint_format``
other than gptq / gptq_v2 (``is_marlin_format``), GPTQModel ``dynamic`` per-module overrides,
a quantized ``lm_head``, AWQ ``version`` other than gemm (gemv, marlin, exllama, ipex) and
``zero_point: false``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from kvflow.quant.base import check_stored_dtype
from kvflow.quant.int4 import Int4WeightOnlyMethod
from kvflow.quant.pack_quantized import PackedInt8Method, _register, store_int4, unpack_int32

# AWQ packs output columns 8c + AWQ_ORDER[j] at bits 4j; column 8c + i sits at slot
# AWQ_REVERSE_ORDER[i] (the inverse permutation).
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)

# vLLM's names for the same checkpoints with its Marlin kernels; kvflow runs its own.
QUANT_ALIASES = {"gptq_marlin": "gptq", "awq_marlin": "awq"}


@dataclass(frozen=True)
class Int4CheckpointFormat:
    """A GPTQ or AWQ checkpoint's layout, from its ``quantization_config``.

    Attributes:
        method: ``"gptq"`` or ``"awq"``.
        bits: 4, or 8 (GPTQ, symmetric only).
        group_size: input columns per scale; None: one scale per output channel.
        zero_offset: added to the stored zero points (1 for GPTQ's ``gptq`` format, else 0).
        skip: module-name fragments left unquantized (AWQ ``modules_to_not_convert``).
        quantize_only: GPTQ ``modules_in_block_to_quantize`` flattened (None: every linear).
    """

    method: str
    group_size: int | None
    zero_offset: int
    bits: int = 4
    skip: tuple[str, ...] = ()
    quantize_only: tuple[str, ...] | None = None


def _first(config: dict[str, Any], keys: tuple[str, ...], default: Any) -> Any:
    return next((config[k] for k in keys if config.get(k) is not None), default)


def parse_int4_checkpoint(config: dict[str, Any]) -> Int4CheckpointFormat:
    """Read and check a ``quant_method: gptq|awq`` ``quantization_config`` (config.json's, or
    AutoAWQ's ``quant_config.json`` keys ``w_bit`` / ``q_group_size``).

    Raises:
        ValueError: naming each key whose value kvflow does not run.
    """
    method = config.get("quant_method")
    bits = _first(config, ("bits", "w_bit"), 4)
    group = int(_first(config, ("group_size", "q_group_size"), 128))
    bits_key = "bits" if "bits" in config or method == "gptq" else "w_bit"
    problems = [] if bits == 4 or (bits == 8 and method == "gptq") else \
        [f"{bits_key}={bits} ({'4 or 8' if method == 'gptq' else '4 only'})"]
    if bits == 8 and config.get("sym") is False:
        problems.append("bits=8 with sym=False (8-bit runs symmetric only)")
    if group != -1 and group <= 0:
        problems.append(f"group_size={group} (a positive size or -1)")
    offset = 0
    if method == "gptq":
        fmt = config.get("checkpoint_format") or "gptq"
        if fmt not in ("gptq", "gptq_v2"):
            problems.append(f"checkpoint_format={fmt!r} (gptq or gptq_v2)")
        if config.get("is_marlin_format"):
            problems.append("is_marlin_format=True (Marlin-repacked weights)")
        if config.get("dynamic"):
            problems.append("dynamic (per-module overrides)")
        if config.get("lm_head"):
            problems.append("lm_head=True (kvflow reads an unquantized LM head)")
        offset = 1 if fmt == "gptq" else 0
    else:
        version = str(config.get("version", "gemm")).lower()
        if version != "gemm":
            problems.append(f"version={config.get('version')!r} (gemm only)")
        if not config.get("zero_point", True):
            problems.append("zero_point=False (gemm checkpoints carry zero points)")
    if problems:
        raise ValueError(f"{method} quantization_config not supported: " + "; ".join(problems))
    only = config.get("modules_in_block_to_quantize")
    return Int4CheckpointFormat(
        method, None if group == -1 else group, offset, bits,
        tuple(config.get("modules_to_not_convert") or ()),
        None if only is None else tuple(_flatten(only)))


def _flatten(names: Any) -> list[str]:
    return [names] if isinstance(names, str) else [n for sub in names for n in _flatten(sub)]


def _is_quantized(fmt: Int4CheckpointFormat, name: str) -> bool:
    """Whether the checkpoint quantizes the (unfused) layer ``name``: not when an entry of
    ``modules_to_not_convert`` occurs in it (vLLM's rule), nor, with
    ``modules_in_block_to_quantize``, when no entry ends it."""
    if any(s in name for s in fmt.skip):
        return False
    return fmt.quantize_only is None or any(name == s or name.endswith(f".{s}")
                                            for s in fmt.quantize_only)


def int4_checkpoint_method(config: dict[str, Any], prefix: str,
                           packed_modules_mapping: dict[str, tuple[str, Any]]
                           ) -> GPTQAWQMethod | GPTQInt8Method | None:
    """The method for the linear layer at ``prefix`` (None: the checkpoint leaves it float).
    A fused layer (``qkv_proj``) is quantized when its checkpoint shards all are.

    Raises:
        ValueError: for an unsupported config, or shards quantized and unquantized alike.
    """
    fmt = parse_int4_checkpoint(config)
    head, _, last = prefix.rpartition(".")
    shards = [src for src, (dst, _) in packed_modules_mapping.items() if dst == last]
    names = [f"{head}.{s}" if head else s for s in shards] or [prefix]
    quantized = {n: _is_quantized(fmt, n) for n in names}
    if len(set(quantized.values())) > 1:
        raise ValueError(f"the {fmt.method} checkpoint quantizes some shards of {prefix!r} and "
                         f"not others ({quantized}); kvflow fuses them into one layer")
    if not quantized[names[0]]:
        return None
    return GPTQInt8Method(fmt) if fmt.bits == 8 else GPTQAWQMethod(fmt)


def biasless_checkpoint_names(model: nn.Module,
                              packed_modules_mapping: dict[str, tuple[str, Any]]) -> set[str]:
    """The checkpoint ``*.bias`` names of ``model``'s GPTQ/AWQ layers that have no bias
    (``q_proj.bias``, ``k_proj.bias``, ``v_proj.bias`` for a fused ``qkv_proj``): older GPTQ
    exports (GPTQ-for-LLaMa's layers) saved a zero bias for every quantized layer, which the
    loader then drops when zero (vLLM skips such biases too)."""
    names = set()
    for prefix, module in model.named_modules():
        if isinstance(getattr(module, "quant_method", None), _PackedCheckpointLoading) \
                and getattr(module, "bias", None) is None:
            head, _, last = prefix.rpartition(".")
            shards = [s for s, (dst, _) in packed_modules_mapping.items() if dst == last]
            names.update(f"{head}.{s}.bias" if head else f"{s}.bias" for s in shards or [last])
    return names


def unpack_nibble_columns(packed: torch.Tensor, awq: bool, bits: int = 4) -> torch.Tensor:
    """int32 [R, C] holding ``32 / bits`` values per word, value ``j`` at bits ``bits * j``
    -> uint8 [R, C * 32 / bits]; ``awq`` (4 bits): the word's values in AWQ's interleaved
    column order."""
    vals = unpack_int32(packed, bits, packed.shape[1] * (32 // bits))
    if awq:
        vals = vals.view(packed.shape[0], -1, 8)[..., list(AWQ_REVERSE_ORDER)].reshape(
            packed.shape[0], -1)
    return vals.to(torch.uint8)


class _PackedCheckpointLoading:
    """Loading shared by the GPTQ/AWQ methods. While loading: ``qweight`` uint8 [N, K]
    (unpacked, output rows first, as every placement loader expects), ``qzeros`` uint8 and
    ``scales`` float32 [N, G] ([N] per channel), GPTQ's ``g_idx`` int32 [K] (optional in the
    checkpoint); after: ``layer.input_perm`` (int64 [K], act order) or None."""

    fmt: Int4CheckpointFormat

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int,
                       params_dtype: torch.dtype) -> None:
        """Raises:
            ValueError: when ``group_size`` does not divide this rank's input columns.
        """
        group = self.fmt.group_size or input_size
        if input_size % group:
            raise ValueError(f"{self.fmt.method} group_size={group} does not divide a "
                             f"layer's {input_size} input columns (this rank's)")
        groups = (output_size, input_size // group) if self.fmt.group_size else (output_size,)
        _register(layer, "qweight", torch.empty(output_size, input_size, dtype=torch.uint8))
        _register(layer, "qzeros", torch.empty(groups, dtype=torch.uint8))
        _register(layer, "scales", torch.empty(groups, dtype=torch.float32))
        if self.fmt.method == "gptq":
            start = getattr(layer, "tp_rank", 0) * input_size if layer.tp_dim == 1 else 0
            _register(layer, "g_idx", (torch.arange(input_size) + start).div(
                group, rounding_mode="floor").to(torch.int32))
            layer.g_idx.optional_in_checkpoint = True  # absent: the plain order above
        self.params_dtype = params_dtype

    def load(self, layer: nn.Module, param: nn.Parameter, loaded: torch.Tensor,
             *shard: Any) -> None:
        """Turn one checkpoint tensor output-rows-first (see the module docstring) and hand
        it to the layer's placement loader (fused offset, TP slice).

        Raises:
            ValueError: for a ``qweight``/``qzeros`` not int32, shapes that do not fit, or
                ``g_idx`` that differ between the shards of a fused layer.
        """
        if param is getattr(layer, "g_idx", None):
            return self._load_g_idx(layer, loaded)
        if param is layer.scales:
            loaded = loaded.float().t()
        else:
            check_stored_dtype(param.new_empty(0, dtype=torch.int32), loaded)
            awq, bits = self.fmt.method == "awq", self.fmt.bits
            if param is layer.qzeros or awq:  # 32 / bits output columns a word
                loaded = unpack_nibble_columns(loaded, awq, bits).t()
            else:  # GPTQ qweight: 32 / bits input rows a word
                loaded = unpack_nibble_columns(loaded.t().contiguous(), False, bits)
        if param.dim() == 1 and loaded.dim() == 2:  # per channel: [N, 1] -> [N]
            loaded = loaded.reshape(-1)
        layer.weight_loader(param, loaded.contiguous(), *shard)

    def _load_g_idx(self, layer: nn.Module, loaded: torch.Tensor) -> None:
        """This rank's input columns of ``g_idx``; a fused layer's shards must agree."""
        k = layer.g_idx.shape[0]
        if layer.tp_dim == 1 and layer.tp_size > 1:
            loaded = loaded.narrow(0, layer.tp_rank * k, k)
        if loaded.shape != (k,):
            raise ValueError(f"g_idx of shape {tuple(loaded.shape)}; the layer has {k} "
                             "input columns (this rank's)")
        if getattr(layer, "_g_idx_loaded", False) and not torch.equal(
                layer.g_idx.data, loaded.to(torch.int32)):
            raise ValueError("the g_idx (desc_act order) of the shards kvflow fuses into one "
                             "layer differ; one activation order per fused layer is needed")
        layer.g_idx.data.copy_(loaded)
        layer._g_idx_loaded = True

    def _unpacked(self, layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q uint8 [N, K], scale float32 [N, G], zero float32 [N, G]) in act order (setting
        ``layer.input_perm``), the checkpoint's tensors removed from ``layer``.

        Raises:
            ValueError: for a ``g_idx`` whose groups are not ``group_size`` columns each
                within this rank (act order under tensor parallelism).
        """
        q, n = layer.qweight.data, layer.qweight.shape[0]
        scale = layer.scales.data.float().reshape(n, -1)
        zero = layer.qzeros.data.float().reshape(n, -1) + self.fmt.zero_offset
        layer.input_perm = None
        if self.fmt.method == "gptq" and self.fmt.group_size:
            perm, cols = _group_order(layer, self.fmt.group_size)
            if perm is not None:
                layer.input_perm = perm.to(q.device)
                q = q[:, perm]
            scale, zero = scale[:, cols], zero[:, cols]
        for name in ("qweight", "qzeros", "scales", "g_idx"):
            if hasattr(layer, name):
                delattr(layer, name)
        return q, scale, zero

    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x [..., K] @ W.T (+ bias)``, the columns of ``x`` gathered in act order first."""
        perm = layer.input_perm
        return super().apply(layer, x if perm is None else x.index_select(-1, perm), bias)


class GPTQAWQMethod(_PackedCheckpointLoading, Int4WeightOnlyMethod):
    """A 4-bit GPTQ or AWQ layer, stored after loading as :class:`Int4WeightOnlyMethod`
    (``weight``, ``weight_scales_and_zeros``).

    Args:
        fmt: the checkpoint's layout (:func:`parse_int4_checkpoint`).
    """

    def __init__(self, fmt: Int4CheckpointFormat) -> None:
        super().__init__(fmt.group_size or 0)
        self.fmt = fmt
        self.name = fmt.method

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Sort act-ordered columns, then store as :class:`Int4WeightOnlyMethod` with
        ``zero_kv = (8 - zero) * scale``.

        Raises:
            ValueError: as :meth:`_PackedCheckpointLoading._unpacked`.
        """
        q, scale, zero = self._unpacked(layer)
        layer._quant_param_names = ("weight", "weight_scales_and_zeros")
        store_int4(self, layer, q, scale, (8.0 - zero) * scale, self.params_dtype)


class GPTQInt8Method(_PackedCheckpointLoading, PackedInt8Method):
    """An 8-bit symmetric GPTQ layer (every zero point 128: ``w = (q - 128) * scale``), stored
    after loading as :class:`~kvflow.quant.pack_quantized.PackedInt8Method`: ``weight`` int8
    [N, K] and ``weight_scale`` float32 [N] (channel) or [N, G] (group scales).

    Args:
        fmt: the checkpoint's layout (:func:`parse_int4_checkpoint`, ``bits == 8``).
    """

    def __init__(self, fmt: Int4CheckpointFormat) -> None:
        super().__init__(fmt.group_size)
        self.fmt = fmt
        self.name = fmt.method

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Raises:
            ValueError: for a zero point other than 128 (an asymmetric 8-bit checkpoint), or
                as :meth:`_PackedCheckpointLoading._unpacked`.
        """
        q, scale, zero = self._unpacked(layer)
        if not bool((zero == 128).all()):
            raise ValueError("gptq bits=8: a zero point is not 128 (asymmetric weights); "
                             "kvflow runs symmetric 8-bit GPTQ only")
        layer._quant_param_names = ("weight", "weight_scale")
        _register(layer, "weight", (q.to(torch.int16) - 128).to(torch.int8))
        _register(layer, "weight_scale", scale.reshape(-1) if self.ckpt_group is None
                  else scale.contiguous())


def _group_order(layer: nn.Module, group: int) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(the column order making each ``g_idx`` group contiguous, None when already; the
    scale columns (this rank's) of the groups in that order).

    Raises:
        ValueError: naming ``desc_act`` when a group does not have ``group`` of this rank's
            columns.
    """
    g_idx = layer.g_idx.data.to(torch.int64)
    k = g_idx.shape[0]
    start = (layer.tp_rank * k // group) if layer.tp_dim == 1 and layer.tp_size > 1 else 0
    perm = torch.argsort(g_idx, stable=True)
    blocks = g_idx[perm].view(-1, group)
    ids = blocks[:, 0] - start
    if not bool((blocks == blocks[:, :1]).all()) or not bool(
            torch.equal(ids.sort().values, torch.arange(k // group))):
        tp = " under tensor parallelism (act-ordered groups straddle ranks)" \
            if layer.tp_dim == 1 and layer.tp_size > 1 else ""
        raise ValueError(f"gptq desc_act: g_idx does not give each group {group} of the "
                         f"layer's {k} input columns{tp}")
    if torch.equal(perm, torch.arange(k)):
        return None, ids
    return perm, ids
