"""Block-wise FP8 checkpoints (DeepSeek-V3/R1, Qwen3-*-FP8): ``config.json`` has
``quantization_config: {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
"weight_block_size": [128, 128]}`` (transformers' ``FineGrainedFP8Config``, vLLM's ``Fp8Config``
with a block size), and every quantized linear stores

* ``<module>.weight``: float8_e4m3fn ``[N, K]`` (an MoE checkpoint: one per expert; a stacked
  ``[E, N, K]`` tensor is read the same way, block by block over its last two dimensions);
* ``<module>.weight_scale_inv``: float32 ``[ceil(N / bn), ceil(K / bk)]`` for the block size
  ``[bn, bk]``. Despite its name it is a multiplier (DeepSeek-V3's reference
  ``weight_dequant`` and transformers multiply by it): block ``(i, j)`` of the weight,
  rows ``i*bn .. i*bn+bn-1`` and columns ``j*bk .. j*bk+bk-1`` (the last block of a row or
  column cut short where N or K is not a multiple), is ``W = weight * scale_inv[i, j]``.

Layers the checkpoint leaves unquantized (``modules_to_not_convert``, vLLM's
``ignored_layers``; the embedding, LM head, norms and MoE routers) are stored in the model dtype
with no scale and load as they are.

kvflow dequantizes each block-FP8 weight while it reads the checkpoint
(:func:`dequantize_checkpoint`), before the model's loaders see it, so every layer holds a float
weight in ``--dtype`` and runs the unquantized path (the CPU GEMMs with their packed weights).
The loaders then see plain float tensors under the checkpoint's names, which is why fused
q/k/v and gate/up, per-expert MoE weights, DeepSeek's MLA projections (``q_a_proj``,
``q_b_proj``, ``kv_a_proj_with_mqa``, ``kv_b_proj``), tensor and pipeline parallelism need
nothing of their own. The cost is memory: a bf16 weight takes twice its FP8 bytes (fp32: four
times), so a 671B DeepSeek-V3 needs ~1.3 TB in bf16. Keeping FP8 and dequantizing inside the
GEMM was measured slower on CPU (a 2048x2048 weight, 2 threads: bf16 at 1 row 0.31 ms
dequantized at load vs 7.9 ms dequantizing per call, x26; at 256 rows x3.9), and CUDA runs the
same dequantized weights (no block-FP8 GEMM kernel yet).

Refused (ValueError naming the key): ``activation_scheme`` other than ``dynamic`` (the static
scheme's per-tensor input scales go with per-tensor weights, not blocks; vLLM refuses it with
blocks too), ``fmt`` other than ``e4m3``, a missing or malformed ``weight_block_size`` (per-tensor
FP8 checkpoints are not read), ``expert_dtype`` other than ``fp8`` (DeepSeek-V4's FP4 experts),
quantized vocabulary tables (``modules_to_convert``).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from kvflow.quant.fp8 import FP8_DTYPE

logger = logging.getLogger(__name__)

SCALE_SUFFIX = "_scale_inv"


def block_size_of(config: dict[str, Any]) -> tuple[int, int]:
    """The ``[bn, bk]`` block of a block-wise FP8 ``quantization_config`` (``quant_method``
    ``"fp8"``), after checking the keys that change the numerics.

    Raises:
        ValueError: naming the key, for ``activation_scheme`` other than ``"dynamic"``, ``fmt``
            other than ``"e4m3"``, ``weight_block_size`` missing or not two positive integers,
            ``expert_dtype`` other than ``"fp8"``, ``scale_fmt`` other than ``"float"`` /
            ``"ue8m0"``, or a non-empty ``modules_to_convert``.
    """
    scheme = config.get("activation_scheme", "dynamic")
    if str(scheme).lower() != "dynamic":
        raise ValueError(f"fp8 quantization_config.activation_scheme={scheme!r} is not "
                         "supported; kvflow reads block-wise FP8 checkpoints with 'dynamic' "
                         "activations")
    fmt = config.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"fp8 quantization_config.fmt={fmt!r} is not supported; kvflow reads "
                         "float8 'e4m3' weights")
    block = config.get("weight_block_size")
    if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(
            isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise ValueError(f"fp8 quantization_config.weight_block_size={block!r} is not "
                         "supported; kvflow reads block-wise FP8 checkpoints, whose config "
                         "gives two positive integers, e.g. [128, 128] (per-tensor FP8 "
                         "checkpoints are not read)")
    for key, allowed in (("expert_dtype", ("fp8",)), ("scale_fmt", ("float", "ue8m0"))):
        if key in config and config[key] not in allowed:
            raise ValueError(f"fp8 quantization_config.{key}={config[key]!r} is not "
                             f"supported (kvflow reads {', '.join(map(repr, allowed))})")
    if config.get("modules_to_convert"):
        raise ValueError("fp8 quantization_config.modules_to_convert="
                         f"{config['modules_to_convert']!r:.200} (quantized vocabulary tables) "
                         "is not supported; kvflow reads block-FP8 linear layers")
    return block[0], block[1]


def ignored_modules(config: dict[str, Any]) -> list[str]:
    """The modules the checkpoint leaves unquantized: ``modules_to_not_convert``
    (transformers) or ``ignored_layers`` (vLLM, MiniMax), [] when neither is given."""
    names = config.get("modules_to_not_convert")
    if names is None:
        names = config.get("ignored_layers")
    return list(names or [])


def is_ignored(module: str, patterns: Iterable[str]) -> bool:
    """Whether checkpoint module ``module`` (``model.layers.0.mlp.gate``) is named by one of
    ``patterns`` as transformers matches ``modules_to_not_convert``: a pattern (a plain name or
    a regex) matching from the start up to a module boundary (``layers.1`` names
    ``layers.1.mlp``, not ``layers.11``), or a suffix of the name (``lm_head``)."""
    for pattern in patterns:
        if module.endswith(pattern):
            return True
        try:
            if re.match(rf"(?:{pattern})(?:(?<=\.)|(?=\.|$))", module):
                return True
        except re.error:
            continue
    return False


def dequantize_block_fp8(weight: torch.Tensor, scale_inv: torch.Tensor,
                         block: tuple[int, int], name: str = "weight") -> torch.Tensor:
    """``weight * scale_inv`` block by block (see the module docstring).

    Args:
        weight: float8_e4m3fn ``[..., N, K]``.
        scale_inv: ``[..., ceil(N / bn), ceil(K / bk)]``, float32 (any float dtype, e.g.
            float8_e8m0fnu, is widened to float32).
        block: ``(bn, bk)``.
        name: the checkpoint tensor, for the errors.

    Returns:
        float32 ``[..., N, K]``.

    Raises:
        ValueError: naming ``name``, when ``weight`` is not float8_e4m3fn, the scale is not a
            float tensor, or its shape is not the block grid of ``weight``.
    """
    if weight.dtype != FP8_DTYPE:
        raise ValueError(f"checkpoint tensor {name!r} has dtype {weight.dtype}, but its block "
                         f"scale {scale_name(name)!r} goes with a float8_e4m3fn weight")
    if not scale_inv.is_floating_point():
        raise ValueError(f"checkpoint tensor {scale_name(name)!r} has dtype "
                         f"{scale_inv.dtype}; block scales are float32")
    (bn, bk), (n, k) = block, weight.shape[-2:]
    grid = (*weight.shape[:-2], -(-n // bn), -(-k // bk))
    if tuple(scale_inv.shape) != grid:
        raise ValueError(f"checkpoint tensor {name!r} {tuple(weight.shape)} with block "
                         f"{[bn, bk]} needs a scale {scale_name(name)!r} of shape {grid}, got "
                         f"{tuple(scale_inv.shape)}")
    # each scale repeated over its block's rows and columns, cut where the last block is short
    scale = scale_inv.float().repeat_interleave(bn, dim=-2)[..., :n, :]
    return weight.float() * scale.repeat_interleave(bk, dim=-1)[..., :k]


def scale_name(weight_name: str) -> str:
    """The scale tensor of ``weight_name``: ``x.weight`` -> ``x.weight_scale_inv`` (stacked
    experts ``x.gate_up_proj`` -> ``x.gate_up_proj_scale_inv``)."""
    return weight_name + SCALE_SUFFIX


def dequantize_checkpoint(weights: Iterable[tuple[str, torch.Tensor]],
                          config: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with each block-FP8 weight dequantized (float32, under the
    weight's own name; its ``*_scale_inv`` consumed) and every other tensor as it is. A weight
    waits for its scale (and a scale for its weight) wherever in the files it comes.

    Raises:
        ValueError: for a float8 weight without its scale, a scale without its weight, a
            module that ``modules_to_not_convert`` / ``ignored_layers`` names stored as FP8, or
            a scale of the wrong shape (see :func:`dequantize_block_fp8`).
    """
    block, ignored = block_size_of(config), ignored_modules(config)
    pending: dict[str, torch.Tensor] = {}  # weight name -> the weight or its scale, seen first
    for name, tensor in weights:
        if name.endswith(SCALE_SUFFIX):
            weight_name, scale = name[:-len(SCALE_SUFFIX)], tensor
            if weight_name not in pending:
                pending[weight_name] = scale
                continue
            weight = pending.pop(weight_name)
        elif tensor.dtype == FP8_DTYPE:
            weight_name, weight = name, tensor
            _check_not_ignored(weight_name, ignored)
            if weight_name not in pending:
                pending[weight_name] = weight
                continue
            scale = pending.pop(weight_name)
        else:
            yield name, tensor
            continue
        yield weight_name, dequantize_block_fp8(weight, scale, block, weight_name)
    if pending:
        unpaired = sorted(n if t.dtype == FP8_DTYPE else scale_name(n) for n, t in pending.items())
        raise ValueError(f"block-FP8 checkpoint tensors without their pair (a float8 weight "
                         f"and its *{SCALE_SUFFIX} scale): {unpaired[:5]}")


def _check_not_ignored(weight_name: str, ignored: list[str]) -> None:
    """Raises ValueError when the config says the module of ``weight_name`` is unquantized
    but the checkpoint stores it as FP8."""
    module = weight_name.rsplit(".", 1)[0] if weight_name.endswith(".weight") else weight_name
    if ignored and is_ignored(module, ignored):
        raise ValueError(f"checkpoint tensor {weight_name!r} is float8, but the fp8 "
                         "quantization_config's modules_to_not_convert / ignored_layers says "
                         f"{module!r} is not quantized")


def warn_dequantized(dtype: torch.dtype) -> None:
    """Log, once per load, that block-FP8 weights are held dequantized in ``dtype``."""
    factor = torch.empty((), dtype=dtype).element_size()
    logger.warning("block-wise FP8 checkpoint: weights are dequantized at load and held in %s "
                   "(%dx the FP8 bytes of each quantized weight; kvflow has no block-FP8 GEMM)",
                   str(dtype).removeprefix("torch."), factor)
