"""Loading an EAGLE-1 or EAGLE-3 head checkpoint (safetensors or EAGLE's own
``pytorch_model.bin``; EAGLE-3's with its layer taps on the target and ``d2t`` vocabulary) and
a DeepSeek-V3 checkpoint's MTP layer, as the speculative heads kvflow/spec_decode/eagle.py
runs."""

from __future__ import annotations

import copy
import os
from typing import Any

import torch

from kvflow.attention.layer import AttentionContext
from kvflow.config import EngineConfig
from kvflow.layers.rope_parameters import extend_rope_positions, rope_max_positions
from kvflow.models.eagle import EAGLE_PACKED, EagleLlamaHead
from kvflow.models.eagle3 import Eagle3LlamaHead, default_aux_layer_ids
from kvflow.models.fused_shards import missing_shard_tensors
from kvflow.models.loader import checkpoint_tensor_names, iter_safetensors, load_model
from kvflow.quant import get_quant_config, process_weights_after_loading
from kvflow.spec_decode.draft_vocab import HeadVocab
from kvflow.spec_decode.layer_taps import LayerTaps


def tensor_names(folder: str) -> list[str]:
    """The head checkpoint's tensor names (safetensors headers, else a ``pytorch_model.bin``).

    Raises:
        ValueError: for a folder with neither.
    """
    if os.path.isfile(os.path.join(folder, "pytorch_model.bin")) and \
            not any(f.endswith(".safetensors") for f in os.listdir(folder)):
        return list(_bin_weights(folder))
    return checkpoint_tensor_names(folder)


def _bin_weights(folder: str) -> dict[str, torch.Tensor]:
    """The tensors of a ``pytorch_model.bin`` (EAGLE's own releases ship one), read with
    ``weights_only`` (no code runs)."""
    return torch.load(os.path.join(folder, "pytorch_model.bin"), map_location="cpu",
                      weights_only=True)


def load_mtp(config: EngineConfig, source: Any, hf_config: Any, ctx: AttentionContext,
              target: torch.nn.Module, dtype: torch.dtype, device: torch.device
              ) -> torch.nn.Module:
    """The first MTP layer of a DeepSeek-V3 checkpoint (kvflow/models/deepseek_mtp.py),
    loaded as the target is (its block-FP8 weights dequantized into ``dtype``).

    Raises:
        ValueError: for a config without MTP layers, or a checkpoint lacking their tensors.
    """
    mc = config.model_config
    layer = f"model.layers.{hf_config.num_hidden_layers}."
    count = getattr(hf_config, "num_nextn_predict_layers", None)
    found = source.kind == "hf" and any(n.startswith(layer)
                                        for n in checkpoint_tensor_names(source.path))
    if not count or not found:
        raise ValueError("method 'deepseek_mtp' needs a DeepSeek-V3 HF checkpoint with MTP "
                         f"layers (num_nextn_predict_layers >= 1 and {layer}* tensors); this "
                         f"one has num_nextn_predict_layers={count} and "
                         f"{'' if found else 'no '}{layer}* tensors")
    mtp_config = copy.deepcopy(hf_config)
    mtp_config.architectures = ["DeepSeekMTPModel"]
    quant = get_quant_config(None, hf_config, source.kind, mc.quantization_group_size)
    head = load_model(source, mtp_config, ctx, dtype, device, mc.load_format, mc.seed, quant)
    head.bind_target(target)
    return head


def load_head(folder: str, hf_config: Any, ctx: AttentionContext, names: list[str],
              target: torch.nn.Module, dtype: torch.dtype, device: torch.device,
              head_cls: type[torch.nn.Module] = EagleLlamaHead, **head_kwargs: Any
              ) -> torch.nn.Module:
    """Build the head (``head_cls``: EAGLE-1's, or EAGLE-3's with ``head_kwargs``) on
    ``device`` in ``dtype`` and load its checkpoint.

    Raises:
        ValueError: for a tensor that does not fit, or parameters left unset (named).
    """
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            head = head_cls(hf_config, ctx, names, target, **head_kwargs)
    finally:
        torch.set_default_dtype(old)
    bin_file = os.path.isfile(os.path.join(folder, "pytorch_model.bin")) and \
        not any(f.endswith(".safetensors") for f in os.listdir(folder))
    weights = _bin_weights(folder).items() if bin_file else iter_safetensors(folder)
    loaded = head.load_weights((n, t.to(dtype) if t.is_floating_point() else t)
                               for n, t in weights)
    missing = {n for n, _ in head.named_parameters()} - loaded
    if missing:
        raise ValueError(f"the EAGLE head checkpoint lacks {sorted(missing)[:5]}")
    parts = missing_shard_tensors(head, EAGLE_PACKED)  # k_proj beside q_proj and v_proj
    if parts:
        raise ValueError(f"the EAGLE head checkpoint lacks {parts[:5]}")
    with torch.device(device):
        process_weights_after_loading(head)
    return head.eval()


def load_eagle3(folder: str, hf_config: Any, ctx: AttentionContext, target: torch.nn.Module,
                dtype: torch.dtype, device: torch.device
                ) -> tuple[Eagle3LlamaHead, HeadVocab, LayerTaps]:
    """The EAGLE-3 head (kvflow/models/eagle3.py) loaded, its vocabulary (``d2t``) and the
    taps on the target's layers it reads (the config's ``eagle_aux_hidden_state_layer_ids``,
    else vLLM's default ``(2, L // 2, L - 3)``).

    Raises:
        ValueError: naming the config field or tensor: ``eagle_config.use_aux_hidden_state``
            false, a ``target_hidden_size`` other than ``hidden_size``, layer ids outside the
            target, a ``d2t`` mapping outside the vocabulary or twice onto one token, a
            tensor that does not fit, parameters left unset.
    """
    eagle_config = getattr(hf_config, "eagle_config", None) or {}
    if isinstance(eagle_config, dict) and eagle_config.get("use_aux_hidden_state") is False:
        raise ValueError("eagle_config.use_aux_hidden_state=false (an EAGLE-3 head fed the "
                         "target's final hidden state) is not supported: method 'eagle3' "
                         "needs a head with fc over the target's layer taps")
    target_hidden = getattr(hf_config, "target_hidden_size", None)
    if target_hidden not in (None, hf_config.hidden_size):
        raise ValueError(f"target_hidden_size={target_hidden} other than the head's "
                         f"hidden_size={hf_config.hidden_size} is not supported")
    ids = getattr(hf_config, "eagle_aux_hidden_state_layer_ids", None)
    what = "eagle_aux_hidden_state_layer_ids"
    if not ids:
        ids = default_aux_layer_ids(target.config.num_hidden_layers)
        what = ("the default EAGLE-3 layer ids (2, L // 2, L - 3; set eagle_aux_hidden_state_"
                "layer_ids in the head's config.json)")
    taps = LayerTaps(target, list(ids), what)
    try:
        head = load_head(folder, hf_config, ctx, tensor_names(folder), target, dtype, device,
                         Eagle3LlamaHead, num_taps=len(taps.layer_ids))
        token_ids = head.draft_token_ids()
        vocab = hf_config.vocab_size
        if token_ids.min() < 0 or token_ids.max() >= vocab or \
                len(torch.unique(token_ids)) != len(token_ids):
            raise ValueError(f"the EAGLE-3 head's d2t maps its {len(token_ids)} draft ids "
                             f"outside the vocabulary of {vocab} tokens or twice onto one "
                             "token")
    except ValueError:
        taps.remove()
        raise
    return head, HeadVocab(head, token_ids, vocab), taps


def extend_head_positions(head_config: Any, target_config: Any) -> None:
    """Give an EAGLE head's RoPE table at least the target's positions, in place, before the
    head is built (:func:`~kvflow.layers.rope_parameters.extend_rope_positions`). A head applies its
    RoPE at the target's positions; checkpoints often declare fewer (2048 for the common
    Llama 3 EAGLE and EAGLE-3 heads), and a table that short made every step past it raise.
    SGLang raises the head's ``max_position_embeddings`` instead (kvflow did too), which for a
    head with dynamic NTK or LongRoPE scaling also changes the rotation of positions it
    covered."""
    if getattr(head_config, "max_position_embeddings", None) is None or \
            getattr(target_config, "max_position_embeddings", None) is None:
        return
    extend_rope_positions(head_config, rope_max_positions(target_config))
