"""Checks of a config.json's sizes against the safetensors headers of its checkpoint, made
before the model is built.

Every size is allocated at build time, before a weight is read, so a corrupt config.json
whose sizes are still positive integers (``num_hidden_layers`` 2**40, ``vocab_size`` 2**40)
used to fail as torch's ``can't allocate memory: you tried to allocate 281474976710656
bytes``, or built layer after layer until the process was killed for memory. A size the
checkpoint's own tensors cannot fill (more layers than its ``layers.N`` tensors, a wider
embedding than its embedding tensor) is refused here from the headers alone (no tensor data).
A size smaller than the checkpoint's is left to the weight loading, which names the tensor
that does not fit.
"""

from __future__ import annotations

import os
import re
from typing import Any

# checkpoint names of the decoder / encoder layers: model.layers.N. (Llama and most decoders,
# LLaVA's language_model.model.layers.N.), encoder.layer.N. (BERT, RoBERTa)
_LAYER_INDEX_RE = re.compile(r"(?:^|\.)layers?\.(\d+)\.")
# the input embedding table [vocab_size, hidden_size], outside the layers (DeepSeek-V3's MTP
# layer model.layers.61.embed_tokens is a copy of it)
_EMBEDDING_SUFFIXES = ("embed_tokens.weight", "word_embeddings.weight")
# a dense MLP's down projection [hidden_size, intermediate_size] (not an expert's)
_DENSE_DOWN_PROJ_RE = re.compile(r"(?:^|\.)layers\.\d+\.mlp\.down_proj\.weight$")
# one routed expert's down projection [hidden_size, expert width] (Mixtral's w2)
_EXPERT_DOWN_PROJ_RE = re.compile(r"\.experts\.\d+\.(?:down_proj|w2)\.weight$")
# Qwen2-MoE's shared expert [hidden_size, shared_expert_intermediate_size]
_SHARED_DOWN_PROJ_RE = re.compile(r"\.shared_expert\.down_proj\.weight$")
# a layer's key projection [num_key_value_heads * head_dim, hidden_size]
_K_PROJ_RE = re.compile(r"(?:^|\.)layers\.\d+\.self_attn\.k_proj\.weight$")
_EXPERT_INDEX_RE = re.compile(r"\.experts\.(\d+)\.")
# the config field of the routed expert count: Mixtral, Qwen MoE, DeepSeek
_EXPERT_COUNT_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts")
# safetensors dtypes that hold one value per element (not packed quantized blocks)
_UNPACKED_DTYPES = frozenset({"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2", "I8"})

Headers = dict[str, tuple[tuple[int, ...], str]]


def check_config_against_checkpoint(hf_config: Any, headers: Headers, folder: str) -> None:
    """Refuse a config whose ``num_hidden_layers``, ``vocab_size``, ``hidden_size``, MLP widths
    (``intermediate_size`` of a dense ``mlp.down_proj``, the experts' and Qwen2-MoE's shared
    expert's), key heads x head size or routed expert count is larger than the checkpoint's
    tensors (``headers``: name -> (shape, safetensors dtype), see
    :func:`kvflow.models.safetensors_files.checkpoint_tensor_headers`). Checkpoints whose
    tensors follow none of these namings (no ``layers.N.`` tensor, no embedding tensor, no
    per-expert tensor: stacked experts) are not checked for that size.

    Raises:
        ValueError: naming ``folder``'s config.json, the field, its value and the tensors
            that contradict it.
    """
    path = os.path.join(folder, "config.json")
    _check_layer_count(hf_config, headers, path)
    _check_embedding(hf_config, headers, path)
    _check_widths(hf_config, headers, path)
    _check_key_rows(hf_config, headers, path)
    _check_expert_count(hf_config, headers, path)


def _check_layer_count(hf_config: Any, headers: Headers, path: str) -> None:
    layers = getattr(hf_config, "num_hidden_layers", None)
    indices = {int(m.group(1)) for m in map(_LAYER_INDEX_RE.search, headers) if m}
    if not isinstance(layers, int) or not indices or layers <= max(indices) + 1:
        return
    raise ValueError(f"model config {path!r}: num_hidden_layers={layers} is more than the "
                     f"checkpoint holds: its tensors are for layers 0..{max(indices)} "
                     f"({len(indices)} layers)")


def _check_embedding(hf_config: Any, headers: Headers, path: str) -> None:
    tables = {name: shape for name, (shape, dtype) in headers.items()
              if name.endswith(_EMBEDDING_SUFFIXES) and not _LAYER_INDEX_RE.search(name)
              and len(shape) == 2 and dtype in _UNPACKED_DTYPES}
    if not tables:
        return
    name, (rows, cols) = min(tables.items(), key=lambda item: len(item[0]))
    for field, value, size in (("vocab_size", getattr(hf_config, "vocab_size", None), rows),
                               ("hidden_size", getattr(hf_config, "hidden_size", None), cols)):
        if isinstance(value, int) and value > size:
            raise ValueError(f"model config {path!r}: {field}={value} is larger than the "
                             f"checkpoint's embedding {name!r} of shape [{rows}, {cols}] "
                             "([vocab_size, hidden_size])")


def _check_widths(hf_config: Any, headers: Headers, path: str) -> None:
    """The MLP widths against the columns of their down projections [hidden, width]: the
    dense ``intermediate_size``, the experts' (``moe_intermediate_size``, else Mixtral's
    ``intermediate_size``) and Qwen2-MoE's ``shared_expert_intermediate_size``."""
    expert_field = "moe_intermediate_size" \
        if getattr(hf_config, "moe_intermediate_size", None) is not None else "intermediate_size"
    for field, pattern, what in (("intermediate_size", _DENSE_DOWN_PROJ_RE, "MLP"),
                                 (expert_field, _EXPERT_DOWN_PROJ_RE, "experts"),
                                 ("shared_expert_intermediate_size", _SHARED_DOWN_PROJ_RE,
                                  "shared expert")):
        value = getattr(hf_config, field, None)
        widths = {name: shape[1] for name, (shape, dtype) in headers.items()
                  if pattern.search(name) and len(shape) == 2 and dtype in _UNPACKED_DTYPES}
        if not isinstance(value, int) or not widths or value <= max(widths.values()):
            continue
        name = max(widths, key=widths.__getitem__)
        raise ValueError(f"model config {path!r}: {field}={value} is larger than the "
                         f"checkpoint's {what}: {name!r} has {widths[name]} columns "
                         f"([hidden_size, {field}])")


def _check_expert_count(hf_config: Any, headers: Headers, path: str) -> None:
    """The routed expert count against the checkpoint's per-expert tensors (``experts.N.``;
    stacked expert tensors are not checked)."""
    field = next((f for f in _EXPERT_COUNT_FIELDS
                  if isinstance(getattr(hf_config, f, None), int)), None)
    indices = {int(m.group(1)) for m in map(_EXPERT_INDEX_RE.search, headers) if m}
    if field is None or not indices or getattr(hf_config, field) <= max(indices) + 1:
        return
    raise ValueError(f"model config {path!r}: {field}={getattr(hf_config, field)} is more "
                     f"than the checkpoint holds: its expert tensors are for experts "
                     f"0..{max(indices)}")


def _check_key_rows(hf_config: Any, headers: Headers, path: str) -> None:
    """``num_key_value_heads`` x ``head_dim`` (``hidden_size / num_attention_heads`` when the
    config has none) against the rows of the layers' ``self_attn.k_proj.weight``: the head
    size also sizes the rotary table, built first."""
    heads = getattr(hf_config, "num_attention_heads", None)
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None)
    if head_dim is None and isinstance(heads, int) and isinstance(
            getattr(hf_config, "hidden_size", None), int):
        head_dim = hf_config.hidden_size // heads
    rows = {name: shape[0] for name, (shape, dtype) in headers.items()
            if _K_PROJ_RE.search(name) and len(shape) == 2 and dtype in _UNPACKED_DTYPES}
    if not (isinstance(kv_heads, int) and isinstance(head_dim, int)) or not rows or \
            kv_heads * head_dim <= max(rows.values()):
        return
    name = max(rows, key=rows.__getitem__)
    raise ValueError(f"model config {path!r}: head_dim={head_dim} x num_key_value_heads="
                     f"{kv_heads} is more rows than the checkpoint's {name!r} has "
                     f"({rows[name]})")
