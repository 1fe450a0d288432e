"""The refusals of :func:`kvflow.models.loader.load_model`, each raising ValueError in one
line: a ``load_format="safetensors"`` source that is not a folder of safetensors files, a
config larger than its checkpoint (or ``dummy`` weights larger than the memory available),
an integer weight in a checkpoint without quantization, and parameters the checkpoint left
unset (whole, or one part of a fused parameter)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from kvflow.distributed.parallel_state import ParallelState
from kvflow.models.checkpoint_config_checks import check_config_against_checkpoint
from kvflow.models.dummy_weight_bytes import check_dummy_weights_fit
from kvflow.models.fused_shards import missing_expert_tensors, missing_shard_tensors
from kvflow.models.model_resolver import ModelSource
from kvflow.models.safetensors_files import checkpoint_files, checkpoint_tensor_headers
from kvflow.quant import QuantConfig


def check_safetensors_source(source: ModelSource) -> None:
    """``load_format="safetensors"`` (vLLM's ``--load-format safetensors``): the weights must
    be a model folder's safetensors files, checked before the model is built.

    Raises:
        ValueError: naming the flag, for a GGUF file or a folder that holds no safetensors
            weight files (or an index naming missing ones).
    """
    flag = "load_format='safetensors'"  # the CLI writes it as the flag typed
    if source.kind == "gguf":
        raise ValueError(f"{flag}: {source.path!r} is a GGUF file, not safetensors; give "
                         "--load-format auto to read it")
    try:
        checkpoint_files(source.path)
    except ValueError as e:
        raise ValueError(f"{flag}: {e}") from None


def check_config_fits(source: ModelSource, hf_config: Any, model_cls: type[nn.Module],
                      load_format: str, dtype: torch.dtype, device: torch.device,
                      quant_config: QuantConfig | None, parallel: ParallelState | None) -> None:
    """Before the model is built: ``dummy`` weights' size (from the config) against the memory
    available, else ``hf_config`` against the checkpoint's safetensors headers, after the
    architecture's ``adapt_config_to_checkpoint`` (if any) fitted it to them (``hf_config``
    may be changed in place). Nothing to check for a GGUF file.

    Raises:
        ValueError: as :func:`kvflow.models.loader.load_model` says for these checks.
    """
    if load_format == "dummy":  # no headers to check the sizes against: the memory they take
        check_dummy_weights_fit(hf_config, model_cls, dtype, device, quant_config is not None,
                                parallel)
    elif source.kind != "gguf":
        headers = checkpoint_tensor_headers(source.path)
        adapt = getattr(model_cls, "adapt_config_to_checkpoint", None)
        if adapt is not None:
            adapt(hf_config, list(headers))
        check_config_against_checkpoint(hf_config, headers, source.path)


def checked_float_weights(weights: Iterable[tuple[str, torch.Tensor]], path: str,
                          quant_config: QuantConfig | None
                          ) -> Iterator[tuple[str, torch.Tensor]]:
    """``weights`` (the checkpoint at ``path``'s (name, tensor) pairs) passed through,
    refusing an integer ``*.weight`` / ``*.bias`` in a checkpoint without quantization:
    loading copies it into the float parameter (an int32 q_proj generated text from
    integer-rounded weights).

    Raises:
        ValueError: naming the tensor, its dtype and the folder.
    """
    for name, tensor in weights:
        if quant_config is None and not tensor.is_floating_point() and \
                name.endswith((".weight", ".bias")):
            raise ValueError(f"checkpoint tensor {name!r} in {path!r} has dtype "
                             f"{tensor.dtype}; the model has no quantization (config.json "
                             "has no quantization_config), so its weights must be floating "
                             "point")
        yield name, tensor


def check_all_loaded(model: nn.Module, loaded: set[str], path: str) -> None:
    """Every parameter of ``model`` that is not ``optional_in_checkpoint`` is among ``loaded``
    (the names ``model.load_weights`` set from the checkpoint at ``path``), and so is every
    part of a fused parameter (``k_proj`` of ``qkv_proj``, an expert).

    Raises:
        ValueError: naming up to 5 parameters (or parts) left unset.
    """
    missing = {n for n, p in model.named_parameters()
               if not getattr(p, "optional_in_checkpoint", False)} - loaded
    if missing:
        raise ValueError(f"checkpoint {path!r} lacks weights for {sorted(missing)[:5]}")
    parts = missing_shard_tensors(model, getattr(model, "packed_modules_mapping", {})) + \
        missing_expert_tensors(model)
    if parts:  # one part of a fused parameter (k_proj of qkv_proj, an expert) never loaded
        raise ValueError(f"checkpoint {path!r} lacks weights for {parts[:5]}")
