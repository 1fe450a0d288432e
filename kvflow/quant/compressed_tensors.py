"""Pre-quantized checkpoints in the compressed-tensors format (how HF FP8 / INT8 models ship,
e.g. the output of llm-compressor): ``config.json`` has a ``quantization_config`` with
``quant_method: "compressed-tensors"``, and the safetensors hold each quantized linear's
``weight`` (float8_e4m3fn or int8), ``weight_scale`` and, for static activations,
``input_scale``.

The config is parsed and matched with the ``compressed-tensors`` package itself
(``QuantizationConfig``; ``is_match`` with vLLM-style fused names, so a fused ``qkv_proj`` is
quantized when its ``q_proj``/``k_proj``/``v_proj`` are): each config group's ``targets``
(``"Linear"``, a module name or ``"re:<regex>"``) minus ``ignore`` picks the scheme of a layer.
Schemes kvflow runs (formats ``float-quantized``, ``naive-quantized``, ``int-quantized``):

=============================  ==============================================================
weights                        activations
=============================  ==============================================================
FP8 e4m3, tensor or channel    none (W8A16), dynamic per token, or static per tensor
INT8 symmetric, channel        none (W8A16) or dynamic INT8 per token (W8A8)
=============================  ==============================================================

Anything else (packed INT4, group/block strategies, asymmetric INT8, NVFP4/MXFP) is a
ValueError naming the scheme. ``kv_cache_scheme`` is not read (``--kv-cache-dtype`` chooses
the cache's type); the vocabulary tables must be unquantized (``lm_head`` in ``ignore``).
"""

from __future__ import annotations

import logging
from typing import Any

from torch import nn

from kvflow.quant.base import LinearMethod

logger = logging.getLogger(__name__)

_FORMATS = ("float-quantized", "naive-quantized", "int-quantized")


def parse_config(config: dict[str, Any]) -> Any:
    """The checkpoint's ``quantization_config`` as compressed-tensors' ``QuantizationConfig``.

    Raises:
        ValueError: when the config does not parse (the package's validation message).
    """
    from compressed_tensors.quantization import QuantizationConfig

    try:
        return QuantizationConfig.model_validate(config)
    except Exception as e:  # pydantic raises ValidationError (a ValueError) and TypeError
        raise ValueError(f"unreadable compressed-tensors quantization_config: {e}") from e


def _fused_names(packed_modules_mapping: dict[str, tuple[str, Any]]) -> dict[str, list[str]]:
    """{'qkv_proj': ['q_proj', 'k_proj', 'v_proj'], ...} from a model's
    ``packed_modules_mapping`` ({'q_proj': ('qkv_proj', 'q'), ...})."""
    fused: dict[str, list[str]] = {}
    for src, (dst, _) in packed_modules_mapping.items():
        fused.setdefault(dst, []).append(src)
    return fused


def scheme_for(config: Any, prefix: str, module: nn.Module,
               packed_modules_mapping: dict[str, tuple[str, Any]]) -> Any | None:
    """The ``QuantizationScheme`` of the layer at ``prefix`` (None: left unquantized)."""
    from compressed_tensors.utils.match import is_match

    fused = _fused_names(packed_modules_mapping)
    for scheme in config.config_groups.values():
        if is_match(prefix, module, scheme.targets, config.ignore or [], fused):
            return scheme
    return None


def method_for_scheme(scheme: Any, fmt: str | None) -> LinearMethod:
    """The kvflow method that runs a compressed-tensors scheme.

    Raises:
        ValueError: for a scheme or format kvflow cannot run (see the module docstring).
    """
    w, act = scheme.weights, scheme.input_activations
    fmt = getattr(scheme, "format", None) or fmt
    desc = f"weights {w.type}{w.num_bits}/{w.strategy}, format {fmt}, activations " \
           f"{'none' if act is None else f'{act.type}{act.num_bits}/{act.strategy}'}"
    if w is None or fmt not in _FORMATS or w.num_bits != 8 or not w.symmetric \
            or w.strategy not in ("tensor", "channel"):
        raise ValueError(f"compressed-tensors scheme not supported ({desc}); kvflow runs "
                         "8-bit symmetric tensor/channel weights")
    if act is not None and (act.num_bits != 8 or act.type != w.type or not act.symmetric):
        raise ValueError(f"compressed-tensors activations not supported ({desc})")
    if w.type == "float":
        from kvflow.quant.fp8 import Fp8LinearMethod

        static = act is not None and not act.dynamic
        if act is not None and act.dynamic and act.strategy != "token":
            raise ValueError(f"compressed-tensors FP8 activations not supported ({desc})")
        if static and act.strategy != "tensor":
            raise ValueError(f"compressed-tensors static FP8 activations not supported ({desc})")
        return Fp8LinearMethod(prequantized=True, weight_strategy=w.strategy,
                               static_input=static, quantize_input=act is not None)
    if w.strategy != "channel" or (act is not None and not (act.dynamic
                                                            and act.strategy == "token")):
        raise ValueError(f"compressed-tensors INT8 scheme not supported ({desc}); kvflow runs "
                         "channel-wise weights with dynamic per-token activations or none")
    from kvflow.quant.int8 import Int8WeightOnlyMethod

    return Int8WeightOnlyMethod(prequantized=True, quantize_input=act is not None)


def compressed_tensors_method(config: dict[str, Any], prefix: str, module: nn.Module,
                              packed_modules_mapping: dict[str, tuple[str, Any]]
                              ) -> LinearMethod | None:
    """The method for the linear layer at ``prefix`` of a compressed-tensors checkpoint.

    Raises:
        ValueError: for an unreadable config or a scheme kvflow cannot run.
    """
    parsed = parse_config(config)
    scheme = scheme_for(parsed, prefix, module, packed_modules_mapping)
    return None if scheme is None else method_for_scheme(scheme, parsed.format)


def check_tables(config: dict[str, Any], prefix: str, module: nn.Module) -> None:
    """Vocabulary tables (embedding, LM head) must be left unquantized by the checkpoint.

    Raises:
        ValueError: when a config group targets the table at ``prefix``.
    """
    from compressed_tensors.utils.match import match_name

    parsed = parse_config(config)
    if parsed.kv_cache_scheme is not None:
        logger.warning("the checkpoint's kv_cache_scheme is not read; --kv-cache-dtype "
                       "chooses the KV cache's type")
    kind = "Linear" if hasattr(module, "compute_logits") else "Embedding"  # HF's class
    ignored = any(match_name(prefix, ign) or ign == kind for ign in parsed.ignore or [])
    targeted = any(match_name(prefix, t) or t == kind
                   for scheme in parsed.config_groups.values() for t in scheme.targets)
    if targeted and not ignored:
        raise ValueError(f"the compressed-tensors checkpoint quantizes {prefix!r}; kvflow "
                         "reads quantized linear layers only (vocabulary tables unquantized)")
