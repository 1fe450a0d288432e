"""Pre-quantized checkpoints in the compressed-tensors format (how HF FP8 / INT8 models ship,
e.g. the output of llm-compressor): ``config.json`` has a ``quantization_config`` with
``quant_method: "compressed-tensors"``, and the safetensors hold each quantized linear's
``weight`` (float8_e4m3fn or int8), ``weight_scale`` and, for static activations,
``input_scale``.

The config is parsed and matched with the ``compressed-tensors`` package itself
(``QuantizationConfig``, ``is_match``, ``match_targets``): a layer named in ``ignore`` stays
unquantized, else it takes the group of its most specific target (an exact module name, then a
``"re:<regex>"``, then a class name such as ``"Linear"``), as ``apply_quantization_config``
resolves it. A layer kvflow fuses (``qkv_proj``, ``gate_up_proj``) takes the scheme its
checkpoint shards (``q_proj``/``k_proj``/``v_proj``) share; shards with different schemes are a
ValueError.

Schemes kvflow runs (formats ``float-quantized``, ``naive-quantized``, ``int-quantized``):

=============================  ==============================================================
weights                        activations
=============================  ==============================================================
FP8 e4m3, tensor or channel    none (W8A16), dynamic per token, or static per tensor
INT8 symmetric, channel        none (W8A16) or dynamic INT8 per token (W8A8)
=============================  ==============================================================

``pack-quantized`` (llm-compressor's W4A16 / W8A16 presets): symmetric INT4 group or channel
weights and symmetric INT8 channel weights, unpacked at load
(:mod:`kvflow.quant.pack_quantized`).

Anything else (asymmetric or act-ordered packed weights, INT8 group scales, block
strategies, asymmetric INT8, NVFP4/MXFP, quantized output activations, no weight
quantization, a group targeting attention modules) is a ValueError naming the scheme, and so are the config keys the package's parser drops unread:
``transform_config``, a compressed ``sparsity_config``, ``moe_sparsity_config``.
``kv_cache_scheme`` and its calibrated ``k_scale``/``v_scale`` tensors are not read
(``--kv-cache-dtype`` chooses the cache's type; kvflow's 8-bit caches take one scale per row);
the vocabulary tables must be unquantized (``lm_head`` in ``ignore``).
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

    _check_unread_keys(config)
    try:
        return QuantizationConfig.model_validate(config)
    except Exception as e:  # pydantic raises ValidationError (a ValueError) and TypeError
        raise ValueError(f"unreadable compressed-tensors quantization_config: {e}") from e


def _check_unread_keys(config: dict[str, Any]) -> None:
    """Refuse the keys beside the quantization scheme that change the numerics and that
    ``QuantizationConfig`` drops unread: ``transform_config`` (online rotations such as
    QuIP/SpinQuant Hadamards), ``sparsity_config`` with a compressed (not ``dense``) storage
    format, ``moe_sparsity_config``.

    Raises:
        ValueError: naming the key and its value.
    """
    sparsity = config.get("sparsity_config") or {}
    if sparsity.get("format", "dense") != "dense":
        raise ValueError("compressed-tensors sparsity_config.format="
                         f"{sparsity['format']!r} is not supported; kvflow reads dense weights")
    for key in ("transform_config", "moe_sparsity_config"):
        if config.get(key):
            raise ValueError(f"compressed-tensors {key} is not supported ({config[key]!r:.200})")


def _fused_names(packed_modules_mapping: dict[str, tuple[str, Any]]) -> dict[str, list[str]]:
    """{'qkv_proj': ['q_proj', 'k_proj', 'v_proj'], ...} from a model's
    ``packed_modules_mapping`` ({'q_proj': ('qkv_proj', 'q'), ...})."""
    fused: dict[str, list[str]] = {}
    for src, (dst, _) in packed_modules_mapping.items():
        fused.setdefault(dst, []).append(src)
    return fused


def _layer_scheme(config: Any, name: str, module: nn.Module) -> Any | None:
    """The scheme compressed-tensors gives the (unfused) layer ``name``: None when ``ignore``
    names it, else the group of its most specific target -- an exact name, then a regex, then
    a class name (``match_targets``' order), a target listed in two groups taking the later
    one, as ``apply_quantization_config`` resolves it."""
    from compressed_tensors.utils.match import is_match, match_targets

    if config.ignore and is_match(name, module, config.ignore):
        return None
    target_to_scheme = {t: scheme for scheme in config.config_groups.values()
                        for t in scheme.targets}
    matched = match_targets(name, module, target_to_scheme)
    return target_to_scheme[matched[0]] if matched else None


def _numerics(scheme: Any | None) -> dict[str, Any] | None:
    return None if scheme is None else scheme.model_dump(exclude={"targets"})


def scheme_for(config: Any, prefix: str, module: nn.Module,
               packed_modules_mapping: dict[str, tuple[str, Any]]) -> Any | None:
    """The ``QuantizationScheme`` of the layer at ``prefix`` (None: left unquantized). A
    layer kvflow fuses (``qkv_proj``) takes its checkpoint shards' (``q_proj``, ``k_proj``,
    ``v_proj``) common scheme.

    Raises:
        ValueError: when the shards of a fused layer have different schemes (or some are
            ignored): kvflow runs one method per fused layer.
    """
    head, _, last = prefix.rpartition(".")
    shards = _fused_names(packed_modules_mapping).get(last)
    names = [f"{head}.{s}" if head else s for s in shards] if shards else [prefix]
    schemes = [_layer_scheme(config, name, module) for name in names]
    if any(_numerics(s) != _numerics(schemes[0]) for s in schemes[1:]):
        desc = ", ".join(f"{n.rsplit('.', 1)[-1]}: "
                         f"{'unquantized' if s is None else _scheme_desc(s, config.format)}"
                         for n, s in zip(names, schemes))
        raise ValueError(f"the compressed-tensors checkpoint quantizes the shards of {prefix!r} "
                         f"differently ({desc}); kvflow fuses them into one layer, which "
                         "needs one scheme")
    return schemes[0]


def _scheme_desc(scheme: Any, fmt: str | None) -> str:
    """``weights float8/channel, format float-quantized, activations float8/token``."""
    w, act = scheme.weights, scheme.input_activations
    fmt = getattr(scheme, "format", None) or fmt
    weights = "none" if w is None else f"{w.type}{w.num_bits}/{w.strategy}"
    acts = "none" if act is None else f"{act.type}{act.num_bits}/{act.strategy}"
    return f"weights {weights}, format {fmt}, activations {acts}"


def method_for_scheme(scheme: Any, fmt: str | None) -> LinearMethod:
    """The kvflow method that runs a compressed-tensors scheme.

    Raises:
        ValueError: for a scheme or format kvflow cannot run (see the module docstring).
    """
    w, act = scheme.weights, scheme.input_activations
    fmt = getattr(scheme, "format", None) or fmt
    desc = _scheme_desc(scheme, fmt)
    if w is None or scheme.output_activations is not None:
        raise ValueError(f"compressed-tensors scheme not supported ({desc}, output activations "
                         f"{'none' if scheme.output_activations is None else 'quantized'}); "
                         "kvflow runs quantized weights with unquantized outputs")
    if fmt == "pack-quantized":
        from kvflow.quant.pack_quantized import pack_quantized_method

        return pack_quantized_method(scheme, desc)
    if fmt not in _FORMATS or w.num_bits != 8 or not w.symmetric \
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


def check_attention_targets(config: dict[str, Any], model: nn.Module) -> None:
    """Refuse a config group that targets attention modules themselves (``re:.*self_attn$``,
    ``LlamaAttention``): compressed-tensors then quantizes the attention's queries, keys and
    values (its ``is_narrow_match`` rule), which kvflow does not run.

    Raises:
        ValueError: naming the first such module and the group.
    """
    from compressed_tensors.utils.match import is_match, is_narrow_match

    parsed = parse_config(config)
    for name, module in model.named_modules():
        if not type(module).__name__.endswith("Attention") or hasattr(module, "set_quant_method"):
            continue
        for group, scheme in parsed.config_groups.items():
            if is_narrow_match(model, scheme.targets, name, module) and not (
                    parsed.ignore and is_match(name, module, parsed.ignore)):
                raise ValueError(f"compressed-tensors config group {group!r} targets the "
                                 f"attention module {name!r} (attention quantization); kvflow "
                                 "reads quantized linear layers only")


_KV_SCALE_SUFFIXES = (".k_scale", ".v_scale", ".k_proj.output_scale", ".v_proj.output_scale")


def is_unread_kv_scale(config: dict[str, Any], name: str) -> bool:
    """Whether checkpoint tensor ``name`` is a calibrated KV-cache scale of a checkpoint with a
    ``kv_cache_scheme`` (``self_attn.k_scale``/``v_scale``, or the older
    ``k_proj``/``v_proj.output_scale``): kvflow skips it, as it does the scheme (its 8-bit caches
    take one scale per stored row, computed as the row is written)."""
    return bool(config.get("kv_cache_scheme")) and name.endswith(_KV_SCALE_SUFFIXES)


def check_tables(config: dict[str, Any], prefix: str, module: nn.Module) -> None:
    """Vocabulary tables (embedding, LM head) must be left unquantized by the checkpoint.

    Raises:
        ValueError: when a config group targets the table at ``prefix``.
    """
    from compressed_tensors.utils.match import match_name

    parsed = parse_config(config)
    if parsed.kv_cache_scheme is not None:
        logger.warning("the checkpoint's kv_cache_scheme and its k_scale/v_scale tensors are "
                       "not read; --kv-cache-dtype chooses the KV cache's type (8-bit caches "
                       "take one scale per row, computed as it is written)")
    kind = "Linear" if hasattr(module, "compute_logits") else "Embedding"  # HF's class
    ignored = any(match_name(prefix, ign) or ign == kind for ign in parsed.ignore or [])
    targeted = any(match_name(prefix, t) or t == kind
                   for scheme in parsed.config_groups.values() for t in scheme.targets)
    if targeted and not ignored:
        raise ValueError(f"the compressed-tensors checkpoint quantizes {prefix!r}; kvflow "
                         "reads quantized linear layers only (vocabulary tables unquantized)")
