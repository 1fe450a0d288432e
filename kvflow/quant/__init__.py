"""Quantization: which method each layer of a model gets, and the two passes that apply them.

``--quantization`` (``ModelConfig.quantization``) names a scheme, or it is read from the
checkpoint (a GGUF file keeps its quantized blocks; an HF folder's ``quantization_config``
names compressed-tensors, gptq or awq). :func:`get_quant_config` turns that into a
:class:`QuantConfig`, which picks a method per layer by its module path. The model loader then
calls :func:`apply_quant_config` right after building the model (before any weight is loaded)
and :func:`process_weights_after_loading` once the checkpoint is in.

Schemes (one file each): ``unquantized.py`` (the reference), ``int8.py`` (weight-only, per
channel), ``int4.py`` (weight-only, group-wise; the gated MLP's gate/up stay INT8,
:data:`INT4_KEPT_AT_INT8`), ``fp8.py`` (W8A8 with dynamic per-token
activation scales), ``gguf.py`` (llama.cpp blocks kept as they are), ``compressed_tensors.py``
(pre-quantized FP8/INT8 checkpoints), ``fp8_block.py`` (block-wise FP8 checkpoints, ``quant_method``
``fp8`` with a ``weight_block_size``: DeepSeek-V3, Qwen3-*-FP8; dequantized while the checkpoint
is read, :meth:`QuantConfig.checkpoint_weights`, so every layer keeps the unquantized method),
``gptq_awq.py`` (GPTQ 4/8-bit and AWQ 4-bit checkpoints, run as ``int4`` / INT8).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from kvflow.quant.base import EmbeddingMethod, LinearMethod, weight_bytes
from kvflow.quant.moe import FusedMoEMethod

QUANTIZATION_METHODS = ("none", "int8", "int4", "fp8", "gguf", "compressed-tensors", "gptq",
                        "awq", "gptq_marlin", "awq_marlin")
# the quant_method values of an HF quantization_config that kvflow reads
CHECKPOINT_METHODS = ("compressed-tensors", "gptq", "awq")

# Under ``int4`` these projections (the gated MLP's input: gate and up, fused or not) stay
# INT8, as llama.cpp's Q4_K_M keeps its most sensitive tensors at 5-8 bits. Measured on
# gemma-3-270m (perplexity ratio to the unquantized load, fake-quantized weights; the other
# linears INT8): only gate_up at INT4 x1.121, only down_proj x1.109, only o_proj x1.020,
# only qkv_proj x0.909; every linear at INT4 x1.190, all but gate_up x1.031.
INT4_KEPT_AT_INT8 = ("gate_up_proj", "gate_proj", "up_proj")

__all__ = ["INT4_KEPT_AT_INT8", "QUANTIZATION_METHODS", "QuantConfig", "apply_quant_config", "get_quant_config",
           "process_weights_after_loading", "weight_bytes"]


@dataclass
class QuantConfig:
    """Chooses a method per layer.

    Attributes:
        name: the scheme (one of :data:`QUANTIZATION_METHODS`).
        group_size: input columns per scale for group-wise schemes (int4).
        checkpoint_config: the checkpoint's ``quantization_config`` dict, if any.
        packed_modules_mapping: the model's checkpoint-name -> (fused layer, shard) map, so a
            checkpoint config that names ``q_proj`` applies to the fused ``qkv_proj``.
        unread_biases: checkpoint ``*.bias`` names of GPTQ/AWQ layers the model builds
            without a bias (older GPTQ exports saved a zero bias for every layer): dropped when
            zero.
    """

    name: str
    group_size: int = 32
    checkpoint_config: dict[str, Any] | None = None
    packed_modules_mapping: dict[str, tuple[str, Any]] = field(default_factory=dict)
    unread_biases: set[str] = field(default_factory=set)

    @property
    def block_fp8(self) -> bool:
        """Whether this is a block-wise FP8 checkpoint (``quant_method`` ``fp8`` in its
        config.json): its weights are dequantized as they are read
        (:meth:`checkpoint_weights`) and every layer stays unquantized."""
        return self.name == "fp8" and self.checkpoint_config is not None

    @property
    def quantizes_layers(self) -> bool:
        """Whether any layer gets a quantized method (its GEMMs are not the unquantized
        ones); False for a block-FP8 checkpoint, dequantized at load."""
        return not self.block_fp8

    def checkpoint_weights(self, weights: Iterable[tuple[str, torch.Tensor]],
                           dtype: torch.dtype) -> Iterable[tuple[str, torch.Tensor]]:
        """The checkpoint's (name, tensor) pairs as the model's loaders take them: a
        block-FP8 checkpoint's weights dequantized to float32 (the loader casts them to
        ``dtype``; :func:`kvflow.quant.fp8_block.dequantize_checkpoint`), else unchanged.

        Raises:
            ValueError: see :func:`~kvflow.quant.fp8_block.dequantize_checkpoint`.
        """
        if not self.block_fp8:
            return weights
        from kvflow.quant.fp8_block import dequantize_checkpoint, warn_dequantized

        warn_dequantized(dtype)
        return dequantize_checkpoint(weights, self.checkpoint_config or {})

    def linear_method(self, prefix: str, module: nn.Module | None = None
                      ) -> LinearMethod | None:
        """The method for the linear layer ``module`` at module path ``prefix``; None:
        unquantized (every layer of a block-FP8 checkpoint: :attr:`block_fp8`).

        Raises:
            ValueError: for a checkpoint quantization scheme kvflow cannot run.
        """
        if self.block_fp8:
            return None
        if self.name == "int4" and prefix.rsplit(".", 1)[-1] not in INT4_KEPT_AT_INT8:
            from kvflow.quant.int4 import Int4WeightOnlyMethod

            return Int4WeightOnlyMethod(self.group_size)
        if self.name in ("int8", "int4"):
            from kvflow.quant.int8 import Int8WeightOnlyMethod

            return Int8WeightOnlyMethod()
        if self.name == "fp8":
            from kvflow.quant.fp8 import Fp8LinearMethod

            return Fp8LinearMethod()
        if self.name == "gguf":
            from kvflow.quant.gguf import GGUFLinearMethod

            return GGUFLinearMethod()
        if self.name == "compressed-tensors":
            from kvflow.quant.compressed_tensors import compressed_tensors_method

            return compressed_tensors_method(self.checkpoint_config or {}, prefix, module,
                                             self.packed_modules_mapping)
        if self.name in ("gptq", "awq"):
            from kvflow.quant.gptq_awq import int4_checkpoint_method

            return int4_checkpoint_method(self.checkpoint_config or {}, prefix,
                                          self.packed_modules_mapping)
        return None

    def check_kept_float(self, prefix: str, module: nn.Module) -> None:
        """A layer kvflow keeps unquantized (an MoE router) must be unquantized in a
        compressed-tensors checkpoint too.

        Raises:
            ValueError: naming the layer, when the checkpoint's config quantizes it.
        """
        if self.name != "compressed-tensors":
            return
        from kvflow.quant.compressed_tensors import parse_config, scheme_for

        if scheme_for(parse_config(self.checkpoint_config or {}), prefix, module,
                      self.packed_modules_mapping) is not None:
            raise ValueError(f"the compressed-tensors checkpoint quantizes {prefix!r}, which "
                             "kvflow keeps unquantized (MoE routers and gates)")

    def skips_tensor(self, name: str, tensor: Any = None) -> bool:
        """Whether the loader drops checkpoint tensor ``name`` unread: a compressed-tensors
        checkpoint's calibrated KV-cache scales (see ``is_unread_kv_scale``); a GPTQ/AWQ
        layer's zero bias where the model has none (``unread_biases``).

        Raises:
            ValueError: for such a bias that is not zero (dropping it would change the layer).
        """
        if name in self.unread_biases:
            if tensor is not None and bool(tensor.any()):
                raise ValueError(f"checkpoint tensor {name!r} is a non-zero bias of a layer "
                                 "the model's config builds without one")
            return True
        if self.name != "compressed-tensors":
            return False
        from kvflow.quant.compressed_tensors import is_unread_kv_scale

        return is_unread_kv_scale(self.checkpoint_config or {}, name)

    def moe_method(self, prefix: str) -> FusedMoEMethod | None:
        """The method for the experts of the ``FusedMoE`` layer at ``prefix``; None: float
        experts (every scheme but int8 and fp8, which quantize them on load, and gguf, which
        keeps the file's blocks unless ``KVFLOW_GGUF_MOE=dequantized``; a block-FP8
        checkpoint's experts are dequantized as they are read)."""
        if self.block_fp8:
            return None
        if self.name == "gguf":
            from kvflow.config import gguf_moe_experts_choice
            from kvflow.quant.gguf_moe import GGUFFusedMoEMethod

            return GGUFFusedMoEMethod() if gguf_moe_experts_choice() == "quantized" else None
        if self.name == "int8":
            from kvflow.quant.moe import Int8FusedMoEMethod

            return Int8FusedMoEMethod()
        if self.name == "fp8":
            from kvflow.quant.moe import Fp8FusedMoEMethod

            return Fp8FusedMoEMethod()
        return None

    def embedding_method(self, prefix: str, module: nn.Module | None = None
                         ) -> EmbeddingMethod | None:
        """The method for the vocabulary table at ``prefix`` (embedding or LM head); None:
        unquantized. int8 and int4 store the tables in INT8 per row, GGUF keeps its blocks;
        fp8 and compressed-tensors leave them in the model dtype (as HF FP8 checkpoints do).

        Raises:
            ValueError: for a compressed-tensors checkpoint that quantizes the table.
        """
        if self.name == "compressed-tensors":
            from kvflow.quant.compressed_tensors import check_tables

            check_tables(self.checkpoint_config or {}, prefix, module)
        if self.name == "gguf":
            from kvflow.quant.gguf import GGUFEmbeddingMethod

            return GGUFEmbeddingMethod()
        if self.name in ("int8", "int4"):
            from kvflow.quant.int8 import Int8EmbeddingMethod

            return Int8EmbeddingMethod()
        return None


def get_quant_config(requested: str | None, hf_config: Any, source_kind: str,
                     group_size: int | None = 32) -> QuantConfig | None:
    """The quantization to run: ``requested`` (``--quantization``), else what the checkpoint
    says (GGUF: ``gguf``; an HF ``quantization_config``: ``compressed-tensors``, or ``fp8``
    with a ``weight_block_size``), else None (unquantized). ``fp8`` on a block-FP8 checkpoint
    reads it (as vLLM's ``--quantization fp8`` does), not re-quantizes it.

    Raises:
        ValueError: for a scheme that does not fit the checkpoint (``gguf`` on a non-GGUF
            model; ``compressed-tensors``, ``gptq`` or ``awq`` (also vLLM's ``gptq_marlin``,
            ``awq_marlin``) without that config; an unsupported GPTQ/AWQ layout; a checkpoint
            ``quant_method`` kvflow does not know, or an ``fp8`` config it cannot read,
            naming the key: :func:`kvflow.quant.fp8_block.block_size_of`; re-quantizing a
            quantized checkpoint).
    """
    ckpt = getattr(hf_config, "quantization_config", None)
    if ckpt is not None and not isinstance(ckpt, dict):
        ckpt = ckpt.to_dict() if hasattr(ckpt, "to_dict") else dict(vars(ckpt))
    ckpt_method = (ckpt or {}).get("quant_method")
    if ckpt_method is not None and ckpt_method not in (*CHECKPOINT_METHODS, "fp8"):
        raise ValueError(f"checkpoint quantization_config.quant_method={ckpt_method!r} is "
                         "not supported; kvflow reads 'compressed-tensors', 'gptq', 'awq' "
                         "and block-wise 'fp8' checkpoints")
    if ckpt_method == "fp8":
        from kvflow.quant.fp8_block import block_size_of

        block_size_of(ckpt)
    if ckpt_method in ("gptq", "awq"):
        from kvflow.quant.gptq_awq import parse_int4_checkpoint

        parse_int4_checkpoint(ckpt)  # refuse an unsupported layout before building the model
    asked = requested
    if requested is None:
        requested = ckpt_method or "none"
    from kvflow.quant.gptq_awq import QUANT_ALIASES

    requested = QUANT_ALIASES.get(requested, requested)
    if requested == "gguf" and source_kind != "gguf":
        raise ValueError("quantization='gguf' needs a .gguf model")
    if requested in CHECKPOINT_METHODS and ckpt_method is None:
        raise ValueError(_no_checkpoint_config(asked, requested, source_kind))
    if ckpt_method is not None and requested != ckpt_method:
        if requested in CHECKPOINT_METHODS:
            raise ValueError(f"quantization={asked!r} does not match the checkpoint, whose "
                             f"quantization_config.quant_method is {ckpt_method!r}")
        raise ValueError(f"the checkpoint is already quantized ({ckpt_method}); "
                         f"quantization={requested!r} cannot re-quantize it")
    if requested == "none":
        return None
    return QuantConfig(requested, 32 if group_size is None else group_size, ckpt)


def _no_checkpoint_config(asked: str, method: str, source_kind: str) -> str:
    """Why ``--quantization asked`` (``method``, a checkpoint's scheme) is refused on a model
    without a ``quantization_config``: a GGUF file has its own quantization."""
    need = (f"quantization={asked!r} needs a checkpoint whose config.json has a "
            f"quantization_config with quant_method {method!r}")
    if source_kind == "gguf":
        return (f"{need}; this model is a .gguf file, whose weights carry llama.cpp's own "
                "quantization (read as 'gguf'): leave quantization unset, or give gguf")
    return f"{need}, which this model's config.json does not have"


def apply_quant_config(model: nn.Module, quant_config: QuantConfig | None) -> int:
    """Give every linear and vocabulary layer of ``model`` its method (before loading);
    tables tied at construction (a tied LM head) stay tied. Returns the layers changed.

    Raises:
        ValueError: for a checkpoint quantization scheme kvflow cannot run.
    """
    if quant_config is None:
        return 0
    quant_config.packed_modules_mapping = dict(getattr(model, "packed_modules_mapping", {}))
    tied: dict[int, nn.Module] = {}
    changed = 0
    for prefix, module in model.named_modules():
        if not hasattr(module, "set_quant_method"):
            continue
        if not getattr(module, "quantizable", True):  # a router: kept in the model dtype
            quant_config.check_kept_float(prefix, module)
            continue
        weight = getattr(module, "weight", None)
        owner = tied.setdefault(id(module if weight is None else weight), module)
        if owner is not module:  # shares its table with a layer seen earlier: share again
            module.set_quant_method(owner.quant_method)
            for name in owner._quant_param_names:
                setattr(module, name, getattr(owner, name))
            continue
        if isinstance(module.quant_method, EmbeddingMethod):
            method = quant_config.embedding_method(prefix, module)
        elif hasattr(module, "w13_weight"):  # FusedMoE experts
            method = quant_config.moe_method(prefix)
        else:
            method = quant_config.linear_method(prefix, module)
        if method is not None:
            module.set_quant_method(method)
            changed += 1
    if quant_config.name in ("gptq", "awq"):
        from kvflow.quant.gptq_awq import biasless_checkpoint_names

        quant_config.unread_biases = biasless_checkpoint_names(
            model, quant_config.packed_modules_mapping)
    if quant_config.name == "compressed-tensors":
        from kvflow.quant.compressed_tensors import check_attention_targets

        check_attention_targets(quant_config.checkpoint_config or {}, model)
    return changed


def process_weights_after_loading(model: nn.Module) -> None:
    """Run each layer's method's after-loading step once (quantize, repack); a table shared
    by two layers is processed once and shared again, its tensors and their names
    (``_quant_param_names``)."""
    done: dict[int, nn.Module] = {}
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is None:
            continue
        weight = getattr(module, "weight", None)
        key = id(module if weight is None else weight)
        owner = done.get(key)
        if owner is not None and owner is not module:
            # the names too: the step may add tensors (INT8's per-row weight_scale), and
            # whatever walks a layer's tensors by name (a draft's cut LM head) must see them
            module._quant_param_names = owner._quant_param_names
            for name in owner._quant_param_names:
                setattr(module, name, getattr(owner, name))
            continue
        method.process_weights_after_loading(module)
        done[key] = module
