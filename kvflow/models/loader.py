"""Builds a model from a resolved source: HF folder (config.json + safetensors) or GGUF file."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from kvflow.attention.layer import AttentionContext
from kvflow.distributed.parallel_state import ParallelState
from kvflow.models.hf_config_checks import (
    check_rope_parameters,
    check_rope_positions,
    read_config_json,
    unread_field_warnings,
)
from kvflow.models.hf_overrides import config_from_dict
from kvflow.models.load_checks import (
    check_all_loaded,
    check_config_fits,
    check_safetensors_source,
    checked_float_weights,
)
from kvflow.models.model_resolver import ModelSource, resolve_tokenizer
from kvflow.models.registry import get_model_class
from kvflow.models.safetensors_files import (
    checkpoint_tensor_names,  # noqa: F401 (spec_decode.head_loading reads it from here)
    iter_safetensors,
)
from kvflow.models.tokenizer_files import tokenizer_files_problem
from kvflow.quant import QuantConfig, apply_quant_config, process_weights_after_loading

logger = logging.getLogger(__name__)


def load_hf_config(source: ModelSource, warn_unread: bool = False,
                   hf_overrides: dict[str, Any] | None = None,
                   trust_remote_code: bool = False) -> Any:
    """The model's HF config (a transformers PretrainedConfig).

    Args:
        source: the resolved model.
        warn_unread: log a warning for each config.json field transformers' model class
            never reads (:func:`~kvflow.models.hf_config_checks.unread_field_warnings`);
            the engine core asks for it, once per engine, the other readers do not.
        hf_overrides: ``ModelConfig.hf_overrides`` (parsed), merged into config.json before
            it is checked and read (:mod:`kvflow.models.hf_overrides`); every reader of the
            engine's config passes them, so all see the same merged config. Refused for a
            GGUF file (its metadata is not a config.json).
        trust_remote_code: let transformers run the folder's own config class (``auto_map``;
            ``--trust-remote-code``); off, such a config is refused in one line; with ``hf_overrides`` the merged
            config is built from transformers' own classes (no repo code runs).

    Raises:
        ValueError: if config.json is missing, cannot be parsed, or its sizes, other fields
            or RoPE parameters are missing or invalid (see
            :func:`kvflow.models.hf_config_checks.read_config_json`,
            :func:`~kvflow.models.hf_config_checks.check_rope_parameters` and
            :func:`~kvflow.models.hf_config_checks.check_rope_positions`).
    """
    if source.kind == "gguf":
        if hf_overrides:
            raise ValueError(f"--hf-overrides (hf_overrides) merges into a model folder's "
                             f"config.json; {source.path!r} is a GGUF file, which has none")
        from kvflow.models.gguf_config import load_gguf_config

        return load_gguf_config(source.path)
    from transformers import AutoConfig

    path = os.path.join(source.path, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"model folder {source.path!r} has no config.json")
    raw = read_config_json(path, hf_overrides)
    for warning in unread_field_warnings(raw, path) if warn_unread else ():
        logger.warning("%s", warning)
    try:
        with quiet_model_type_warning():
            config = config_from_dict(raw, source.path) if hf_overrides else \
                AutoConfig.from_pretrained(source.path, trust_remote_code=trust_remote_code)
    except Exception as e:  # transformers raises many types for a bad config
        raise ValueError(f"cannot read model config {path!r}: {_one_line(e)}") from e
    config = hoist_text_config(config)
    check_rope_parameters(config, path, raw)
    check_rope_positions(config, path)
    return config


def hoist_text_config(config: Any) -> Any:
    """A vision-language config (``text_config`` + ``vision_config``, e.g. Qwen2-VL) with its
    language model's fields also readable at the top level (``vocab_size``,
    ``num_hidden_layers``, ``rope_parameters``, ...), as kvflow reads them from every model;
    fields the top level has already keep their values (llava-hf/llava-1.5-7b-hf's
    config.json repeats ``vocab_size`` there). Other configs (no ``text_config``, or one
    whose sizes are already at the top level) are returned as they are."""
    text = getattr(config, "text_config", None)
    if text is None or hasattr(config, "hidden_size"):
        return config
    for name, value in text.to_dict().items():
        if not hasattr(config, name):
            setattr(config, name, value)
    return config


def iter_weights(source: ModelSource, dtype: torch.dtype,
                 keep_quantized: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every checkpoint tensor. ``keep_quantized`` (GGUF): quantized tensors
    come as their raw blocks (see :func:`kvflow.models.gguf_loader.iter_gguf_weights`)."""
    if source.kind == "gguf":
        from kvflow.models.gguf_loader import iter_gguf_weights

        yield from iter_gguf_weights(source.path, dtype, keep_quantized)
    else:
        yield from iter_safetensors(source.path)


def _to_model_dtype(tensor: torch.Tensor, dtype: torch.dtype, name: str = "",
                    keep_fp32: tuple[str, ...] = ()) -> torch.Tensor:
    """Float checkpoint tensors in the model dtype, or in float32 when the name contains one of
    the model's ``keep_in_fp32`` fragments (e.g. DeepSeek's router weight and correction bias);
    quantized ones (int8, fp8, GGUF blocks) and quantization scales (``*_scale``, GPTQ/AWQ
    ``*.scales``, kept in their own precision) exactly as stored."""
    if tensor.is_floating_point() and tensor.element_size() > 1 and \
            not name.endswith(("_scale", ".scales")):
        keep = any(fragment in name for fragment in keep_fp32)
        return tensor.float() if keep else tensor.to(dtype)
    return tensor


@contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def _init_dummy_weights(model: nn.Module, seed: int) -> None:
    """Random weights of the right shapes and dtypes (for benchmarks without weight files):
    normal(0, 0.02) drawn on the parameter's own device, norms at 1."""
    generators: dict[torch.device, torch.Generator] = {}
    for name, param in model.named_parameters():
        if "norm" in name:
            param.data.fill_(1.0)
            continue
        gen = generators.get(param.device)
        if gen is None:
            gen = generators[param.device] = torch.Generator(param.device).manual_seed(seed)
        param.data.normal_(0.0, 0.02, generator=gen)


def load_model(source: ModelSource, hf_config: Any, ctx: AttentionContext, dtype: torch.dtype,
               device: torch.device, load_format: str = "auto", seed: int = 0,
               quant_config: QuantConfig | None = None,
               parallel: ParallelState | None = None) -> nn.Module:
    """Instantiate the architecture (this rank's shard and pipeline stage when ``parallel``
    spans several processes; an architecture with an ``adapt_config_to_checkpoint(hf_config,
    tensor_names)`` classmethod first fits the config to the checkpoint's layout), give its layers their quantization methods, load the weights
    and run the methods' after-loading step (quantize on load, repack).

    ``load_format``: ``auto`` (the source's files), ``safetensors`` (vLLM's: a folder's
    safetensors files only, as ``auto`` reads them) or ``dummy`` (random weights).

    Raises:
        ValueError: for an unsupported architecture, a config whose layer count or embedding
            size is larger than the checkpoint's tensors (checked from the safetensors headers
            before the model is built, :mod:`kvflow.models.checkpoint_config_checks`),
            missing weights, ``load_format="dummy"`` weights whose size from the config
            exceeds the memory available (:mod:`kvflow.models.dummy_weight_bytes`), a
            checkpoint that leaves
            parameters unset (also one part of a fused parameter: ``k_proj`` of ``qkv_proj``),
            or ``load_format="safetensors"`` on a GGUF file or a folder without safetensors.
    """
    if load_format == "safetensors":
        check_safetensors_source(source)
    model_cls = get_model_class(getattr(hf_config, "architectures", None))
    check_config_fits(source, hf_config, model_cls, load_format, dtype, device,
                      quant_config, parallel)
    model = _build_model(model_cls, hf_config, ctx, dtype, device, quant_config, parallel)
    if load_format == "dummy":
        _init_dummy_weights(model, seed)
    else:
        _load_checkpoint_weights(model, source, dtype, quant_config)
    with torch.device(device):
        process_weights_after_loading(model)
    return model.eval()


def _build_model(model_cls: type[nn.Module], hf_config: Any, ctx: AttentionContext,
                 dtype: torch.dtype, device: torch.device, quant_config: QuantConfig | None,
                 parallel: ParallelState | None) -> nn.Module:
    """The architecture instantiated on ``device`` in ``dtype`` (its uninitialized
    parameters), its layers given their quantization methods and its MoE float expert stacks
    materialized (unless kept as GGUF blocks)."""
    with _default_dtype(dtype), torch.device(device):
        model = model_cls(hf_config, ctx, parallel=parallel or ParallelState.single(device))
        apply_quant_config(model, quant_config)
        for module in model.modules():  # MoE float expert stacks, unless kept as GGUF blocks
            if hasattr(module, "materialize_float_weights"):
                module.materialize_float_weights()
    return model


def _load_checkpoint_weights(model: nn.Module, source: ModelSource, dtype: torch.dtype,
                             quant_config: QuantConfig | None) -> None:
    """The checkpoint's tensors loaded into ``model`` (in ``dtype`` but for its
    ``keep_in_fp32`` names and GGUF blocks kept quantized; tensors ``quant_config`` skips left
    out), then checked complete.

    Raises:
        ValueError: naming up to 5 parameters the checkpoint left unset, whole or a part of a
            fused parameter (``k_proj`` of ``qkv_proj``, an expert).
    """
    keep = quant_config is not None and quant_config.name == "gguf"
    keep_fp32 = getattr(model, "keep_in_fp32", ())
    weights = checked_float_weights(iter_weights(source, dtype, keep), source.path,
                                    quant_config)
    if quant_config is not None:  # a block-FP8 checkpoint's weights dequantized here
        weights = quant_config.checkpoint_weights(weights, dtype)
    loaded = model.load_weights((n, _to_model_dtype(t, dtype, n, keep_fp32))
                                for n, t in weights
                                if quant_config is None
                                or not quant_config.skips_tensor(n, t))
    check_all_loaded(model, loaded, source.path)


def load_tokenizer(source: ModelSource, tokenizer_path: str | None = None,
                   download_dir: str | None = None, options: dict[str, Any] | None = None,
                   token: str | bool | None = None) -> Any:
    """The model's tokenizer (transformers), with its chat template (the tokenizer's; else
    a processor's ``chat_template.json``, :func:`processor_chat_template`): the model's own, or
    ``tokenizer_path`` (a folder, a ``.gguf`` file, a packaged model name or a Hub repo id
    ``org/name[@revision]`` fetched into ``download_dir``; see
    :func:`~kvflow.models.model_resolver.resolve_tokenizer`). ``options``: further
    ``AutoTokenizer.from_pretrained`` arguments (``ModelConfig.tokenizer_options``:
    ``trust_remote_code``); remote code is run only with ``trust_remote_code=True``;
    ``token``: the Hub token of a ``tokenizer_path`` download.

    Raises:
        ValueError: one line: if no tokenizer can be loaded from there, or it needs custom
            code (``trust_remote_code``).
    """
    from transformers import AutoTokenizer

    if tokenizer_path is not None:
        source = resolve_tokenizer(tokenizer_path, download_dir, token)
    if source.kind == "gguf":
        from kvflow.models.gguf_tokenizer import load_gguf_tokenizer

        return load_gguf_tokenizer(source.path)
    try:
        with quiet_model_type_warning():
            tokenizer = AutoTokenizer.from_pretrained(
                source.path, **{"trust_remote_code": False, **(options or {})})
    except Exception as e:  # transformers raises many types
        problem = tokenizer_files_problem(source.path)
        if problem is not None:
            raise ValueError(f"cannot load a tokenizer from {source.path!r}: {problem}; pass a "
                             "tokenizer with --tokenizer (LLM(tokenizer=...))") from e
        raise ValueError(f"cannot load a tokenizer from {source.path!r}: "
                         f"{_one_line(e)}") from e
    if getattr(tokenizer, "chat_template", None) is None:
        tokenizer.chat_template = processor_chat_template(source.path)
    return tokenizer


def processor_chat_template(folder: str) -> str | None:
    """The chat template a multimodal processor saved as ``chat_template.json``
    (``{"chat_template": "..."}``, transformers' older processor format, e.g.
    llava-hf/llava-1.5-7b-hf), which the tokenizer does not read; vLLM falls back to the
    processor's template the same way. None when the folder has none or it is unreadable."""

    file = os.path.join(folder, "chat_template.json")
    if not os.path.isfile(file):
        return None
    try:
        with open(file, encoding="utf-8") as f:
            template = json.load(f).get("chat_template")
    except (OSError, ValueError, AttributeError):
        return None
    return template if isinstance(template, str) else None


@contextmanager
def quiet_model_type_warning() -> Iterator[None]:
    """Within the block, drop transformers' "You are using a model of type X to instantiate a
    model of type Y" warning. AutoTokenizer reads a config whose ``model_type`` transformers does
    not know (a ``trust_remote_code`` model) through the base config class, which logs it; kvflow
    then refuses that config in one line of its own, so the warning only doubled the output."""
    import logging

    def drop(record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("You are using a model of type")

    config_logger = logging.getLogger("transformers.configuration_utils")
    config_logger.addFilter(drop)
    try:
        yield
    finally:
        config_logger.removeFilter(drop)


def _one_line(error: Exception) -> str:
    """transformers' error as one line: a refusal to run a repo's custom code said plainly,
    else the first line of its message, with the next one when the first only introduces it
    (a validation error: "Class validation error for validator 'validate_architecture':" and
    then the reason)."""
    text = str(error).strip()
    if "trust_remote_code" in text:
        return ("it needs custom code from its repo (auto_map, trust_remote_code), and kvflow "
                "does not run remote code; use a model of an architecture transformers ships")
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        return type(error).__name__
    if lines[0].endswith(":") and len(lines) > 1:
        return f"{lines[0]} {lines[1]}"
    return lines[0]


def resolve_eos_token_id(tokenizer: Any, hf_config: Any) -> int | None:
    """The token id that ends generation: the tokenizer's EOS when it has one, else the model
    config's (the first one when the config lists several), else None.

    Args:
        tokenizer: a transformers tokenizer, or None (``skip_tokenizer_init``).
        hf_config: anything with an ``eos_token_id`` attribute (an HF PretrainedConfig, or the
            core process's ``EngineReady`` that carries the config's resolved id), or None.
    """
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is not None:
        return eos
    eos = getattr(hf_config, "eos_token_id", None)
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    return eos if isinstance(eos, int) else None
