"""Load llama.cpp GGUF checkpoints' weights: dequantized, or kept as their raw GGML blocks.

The header comes from :mod:`kvflow.models.gguf_reader`, the architecture from
:mod:`kvflow.models.gguf_config`; tensor data is read from a memory map and dequantized with
the ``gguf`` package's ``gguf.quants.dequantize``, one tensor at a time. ``gguf`` is imported
lazily, so importing this module is cheap and works on machines without ``gguf``. The config
and tokenizer loaders live in gguf_config.py and gguf_tokenizer.py."""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Iterator
from typing import Any

import torch

from kvflow.config import gguf_moe_experts_choice
from kvflow.kernels.gguf_dequant import SUPPORTED_TYPES as KEPT_TYPES
from kvflow.models.gguf_config import (
    ArchSpec,
    check_gguf_metadata,
    gguf_architecture,
    gguf_head_counts,
)
from kvflow.models.gguf_reader import GGUFMetadata, GGUFTensorInfo, read_gguf_metadata

logger = logging.getLogger(__name__)

# GGUF tensor names -> HF parameter names.
_GLOBAL_NAMES: dict[str, str] = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_NAMES: dict[str, str] = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    # mixture-of-experts (gguf_moe.py): router, stacked experts (yielded one expert at a
    # time as mlp.experts.{e}.*_proj.weight), Qwen2-MoE's shared expert and its gate
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# routers stay floats under --quantization gguf (kvflow keeps MoE routing unquantized)
_ROUTER_SUFFIXES = (".mlp.gate.weight", ".mlp.shared_expert_gate.weight")
_STACKED_EXPERTS_RE = re.compile(r"^(.*\.mlp\.experts)\.(\w+_proj)\.weight$")
_SKIPPED_TENSORS = frozenset({"rope_freqs.weight"})  # RoPE factors, not module parameters
# blk.N.ffn_{gate,up,down}.E.weight: expert E, as early (2023) Mixtral GGUFs store experts
_LEGACY_EXPERT_RE = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)\.(\d+)\.weight$")
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
_GLOBAL_RE = re.compile(r"^(\w+)\.(weight|bias)$")


def _hf_name(gguf_name: str, spec: ArchSpec | None = None) -> str:
    """Map a GGUF tensor name to the HF parameter name (ValueError if unknown)."""
    m = _LEGACY_EXPERT_RE.match(gguf_name)
    if m is not None:  # early Mixtral GGUFs: one tensor per expert
        layer, proj, expert = m.groups()
        return f"model.layers.{layer}.mlp.experts.{expert}.{proj}_proj.weight"
    m = _BLOCK_RE.match(gguf_name)
    if m is not None:
        layer, part, kind = m.groups()
        block_names = {**_BLOCK_NAMES, **dict(spec.block_names if spec else ())}
        if part in block_names:
            return f"model.layers.{layer}.{block_names[part]}.{kind}"
    else:
        m = _GLOBAL_RE.match(gguf_name)
        if m is not None and m.group(1) in _GLOBAL_NAMES:
            return f"{_GLOBAL_NAMES[m.group(1)]}.{m.group(2)}"
    raise ValueError(f"Unrecognized GGUF tensor {gguf_name!r}")


def unpermute_qk(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's rotary-layout permutation of a q/k projection weight or bias.

    llama.cpp's ``convert_hf_to_gguf.py`` (``LlamaModel.permute``) stores each head's rows
    as ``w.reshape(n_head, 2, head_dim // 2, ...).swapaxes(1, 2)`` so that the two rotary
    halves are interleaved (GPT-J style). This applies the inverse,
    ``w.reshape(n_head, head_dim // 2, 2, ...).swapaxes(1, 2)``, giving the HF (NeoX,
    rotate-half) row order. ``n_head`` is the number of heads the rows belong to
    (``num_attention_heads`` for q, ``num_key_value_heads`` for k). Shape is preserved.

    Raises:
        ValueError: when the row count is not a multiple of ``2 * n_head``.
    """
    rows = weight.shape[0]
    if rows % (2 * n_head):
        raise ValueError(f"cannot un-permute {rows} rows for {n_head} heads")
    w = weight.reshape(n_head, rows // n_head // 2, 2, *weight.shape[1:])
    return w.transpose(1, 2).reshape(weight.shape)


def iter_gguf_weights(path: str, dtype: torch.dtype,
                      keep_quantized: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_param_name, tensor)`` for every weight tensor in the GGUF at ``path``.

    Names follow transformers' Llama/Qwen2/Qwen3 layout: ``model.embed_tokens.weight``,
    ``model.layers.{i}.self_attn.{q,k,v,o}_proj.weight`` (plus ``{q,k,v}_proj.bias`` where
    present, e.g. qwen2), ``model.layers.{i}.self_attn.{q,k}_norm.weight`` (qwen3),
    ``model.layers.{i}.mlp.{gate,up,down}_proj.weight``,
    ``model.layers.{i}.{input,post_attention}_layernorm.weight``, ``model.norm.weight`` and
    ``lm_head.weight`` (only if the GGUF has ``output.weight``; otherwise the embeddings are
    tied). MoE files (see :mod:`kvflow.models.gguf_moe`) add the router
    ``model.layers.{i}.mlp.gate.weight`` [E, H], each stacked expert tensor split into one
    ``model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight`` per expert, and
    Qwen2-MoE's ``mlp.shared_expert.{gate,up,down}_proj.weight`` and
    ``mlp.shared_expert_gate.weight`` [1, H]. Each tensor is dequantized with
    ``gguf.quants.dequantize`` to float32, reshaped to the PyTorch shape (GGUF lists
    dimensions in reverse, so a linear weight is ``[out_features, in_features]``), converted to ``dtype`` on the CPU and is contiguous.

    For GGUF architecture ``llama`` the q_proj/k_proj rows (and biases) are un-permuted
    (see :func:`unpermute_qk`; the permutation is llama.cpp's ``convert_hf_to_gguf.py``
    ``LlamaModel.permute``). qwen2/qwen3/gemma3 GGUFs are stored unpermuted; gemma3 norm
    weights are stored as ``1 + w`` and come back as ``w`` (the ``(1 + w)`` RMSNorm's own).

    Tensors are produced one at a time from a memory map, so peak extra memory is about one
    float32 copy of the largest tensor. The file is validated before the iterator is returned.

    With ``keep_quantized``, a 2-D tensor of a quantized GGML type (linear and embedding
    weights) comes as its raw blocks instead: uint8 ``[rows, row_bytes]`` exactly as in the
    file (llama q/k rows un-permuted, which moves whole rows), with the GGML type as the
    tensor's ``ggml_type`` attribute (a ``gguf.GGMLQuantizationType`` value) - when kvflow
    has kernels for that type (``kernels.gguf_dequant.SUPPORTED_TYPES``: Q4_0, Q4_1, Q5_0,
    Q8_0, Q4_K, Q5_K, Q6_K). A tensor of another type (Q2_K, Q3_K, IQ*: common in llama.cpp's
    Q2_K / Q3_K_* mixes) is dequantized as without ``keep_quantized`` and a warning names the
    types, so such a file loads with those tensors in ``dtype`` instead of failing at its
    first forward pass. Routers always come as floats. Expert tensors (stacked ones split
    per expert, or early Mixtral's per-expert ones) come as each expert's raw blocks
    [rows, row_bytes] too (:mod:`kvflow.quant.gguf_moe` keeps them); with
    ``KVFLOW_GGUF_MOE=dequantized`` (:func:`kvflow.config.gguf_moe_experts_choice`) they are
    dequantized to ``dtype`` instead, with a warning naming how many, as they then take
    ``dtype``-sized memory (most of an MoE model's weights).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: not a valid GGUF, unsupported architecture, metadata that is malformed
            or contradicts the tensor shapes (see ``gguf_config.check_gguf_metadata``), or
            an unrecognized tensor (each naming the file).
    """
    meta = read_gguf_metadata(path)
    _, spec = gguf_architecture(meta)
    check_gguf_metadata(meta)
    n_head, n_kv = gguf_head_counts(meta)
    try:
        names = {t.name: _hf_name(t.name, spec) for t in meta.tensors
                 if t.name not in _SKIPPED_TENSORS}
    except ValueError as e:
        raise ValueError(f"{meta.path!r}: {e}") from None
    return _iter_weights(meta, names, spec, n_head, n_kv, dtype, keep_quantized)


def _iter_weights(
    meta: GGUFMetadata,
    names: dict[str, str],
    spec: ArchSpec,
    n_head: int,
    n_kv: int,
    dtype: torch.dtype,
    keep_quantized: bool = False,
) -> Iterator[tuple[str, torch.Tensor]]:
    """The generator behind :func:`iter_gguf_weights` (see there), reading the file through
    one memory map."""
    import numpy as np

    data = np.memmap(meta.path, dtype=np.uint8, mode="r")
    unkept: dict[str, int] = {}  # GGML type name -> tensors dequantized instead of kept
    experts_dequantized: dict[str, int] = {}  # the same for expert tensors (not kept)
    keep_experts = keep_quantized and gguf_moe_experts_choice() == "quantized"
    try:
        for info in meta.tensors:
            if info.name not in names:
                continue
            name = names[info.name]
            expert = ".mlp.experts." in name
            if expert and keep_quantized and not keep_experts \
                    and info.ggml_type not in _FLOAT_TYPES:
                _count(experts_dequantized, info.ggml_type)
            stacked = _STACKED_EXPERTS_RE.match(name)
            if stacked is not None:  # [E, rows, cols]: one expert at a time
                keep = keep_experts and info.ggml_type in KEPT_TYPES
                if keep_experts and not keep and info.ggml_type not in _FLOAT_TYPES:
                    _count(unkept, info.ggml_type)
                yield from _split_experts(data, info, meta.path, *stacked.groups(), dtype, keep)
                continue
            router = name.endswith(_ROUTER_SUFFIXES)
            if keep_quantized and len(info.shape) == 2 and info.ggml_type not in _FLOAT_TYPES \
                    and not router and (keep_experts or not expert):
                if info.ggml_type in KEPT_TYPES:
                    yield name, _raw_blocks(data, info, name, spec, n_head, n_kv)
                    continue
                _count(unkept, info.ggml_type)
            weight = _float_weight(data, info, name, meta.path, spec, n_head, n_kv)
            out = weight.to(dtype).contiguous()
            del weight  # keep at most one float32 copy alive while the caller holds ``out``
            yield name, out
            del out
        _warn_dequantized(meta.path, dtype, experts_dequantized, unkept)
    finally:
        del data


def _float_weight(data: Any, info: GGUFTensorInfo, name: str, path: str, spec: ArchSpec,
                  n_head: int, n_kv: int) -> torch.Tensor:
    """Tensor ``info`` (kvflow name ``name``) dequantized to float32 in PyTorch's layout,
    as transformers holds it: norm weights without the architecture's stored offset
    (gemma3's ``1 + w``), llama q/k rows un-permuted, a shared expert's gate [1, H].

    Raises:
        ValueError: naming the file, for a GGML type gguf cannot dequantize.
    """
    try:
        weight = torch.from_numpy(_dequantize(data, info))
    except ValueError as e:  # a GGML type gguf cannot dequantize: name the file
        raise ValueError(f"{path!r}: {e}") from None
    if spec.norm_offset and name.endswith("norm.weight"):
        weight = weight - spec.norm_offset
    if spec.permute_qk:
        if ".self_attn.q_proj." in name:
            weight = unpermute_qk(weight, n_head)
        elif ".self_attn.k_proj." in name:
            weight = unpermute_qk(weight, n_kv)
    if name.endswith(".mlp.shared_expert_gate.weight"):  # llama.cpp: [H] or [1, H]
        weight = weight.reshape(1, -1)
    return weight


def _warn_dequantized(path: str, dtype: torch.dtype, experts: dict[str, int],
                      unkept: dict[str, int]) -> None:
    """Log, with ``keep_quantized``, which quantized tensors were dequantized to ``dtype``
    instead (GGML type name -> count): MoE experts (always) and tensors of a type without a
    kept-quantized kernel."""
    if experts:
        logger.warning("GGUF %s: MoE expert tensors (%s) dequantized to %s at load "
                       "(KVFLOW_GGUF_MOE=dequantized): they take %s-sized memory (the "
                       "dense layers keep their GGML blocks)",
                       path, ", ".join(f"{n} x {t}" for t, n in sorted(experts.items())),
                       dtype, dtype)
    if unkept:
        logger.warning("GGUF %s: no kept-quantized kernel for %s; those tensors were "
                       "dequantized to %s at load (GGUF layers hold them as float32)",
                       path, ", ".join(f"{n} x {t}" for t, n in sorted(unkept.items())), dtype)


def _count(counts: dict[str, int], ggml_type: int) -> None:
    """One more tensor of ``ggml_type`` (counted by type name, for a warning)."""
    type_name = _type_name(ggml_type)
    counts[type_name] = counts.get(type_name, 0) + 1


def _split_experts(data, info: GGUFTensorInfo, path: str, prefix: str, proj: str,
                   dtype: torch.dtype, keep: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """``(prefix.{e}.proj.weight, [rows, cols] in dtype)`` for each expert of a stacked
    [E, rows, cols] tensor, each dequantized from its own bytes (experts are the outermost
    dimension, so one expert's blocks are contiguous): one expert in float32 at a time.
    ``keep``: each expert's raw blocks instead, uint8 [rows, row_bytes] tagged ``ggml_type``."""
    n_experts = info.shape[0]
    if len(info.shape) != 3 or info.n_bytes % n_experts:
        raise ValueError(f"{path!r}: stacked expert tensor {info.name!r} has shape "
                         f"{info.shape}, not [experts, rows, cols]")
    per_expert = info.n_bytes // n_experts
    for e in range(n_experts):
        one = dataclasses.replace(info, shape=info.shape[1:], offset=info.offset + e * per_expert,
                                  n_bytes=per_expert)
        if keep:
            yield f"{prefix}.{e}.{proj}.weight", _blocks(data, one)
            continue
        try:
            weight = torch.from_numpy(_dequantize(data, one))
        except ValueError as err:  # a GGML type gguf cannot dequantize: name the file
            raise ValueError(f"{path!r}: {err}") from None
        out = weight.to(dtype).contiguous()
        del weight
        yield f"{prefix}.{e}.{proj}.weight", out
        del out


def _type_name(ggml_type: int) -> str:
    """The GGML type's name (``Q3_K``), or its number when ``gguf`` does not know it."""
    from gguf.constants import GGMLQuantizationType

    try:
        return GGMLQuantizationType(ggml_type).name
    except ValueError:
        return str(ggml_type)


_FLOAT_TYPES = frozenset({0, 1, 30})  # GGML F32, F16, BF16: read as floats, never kept raw


def _raw_blocks(data, info: GGUFTensorInfo, name: str, spec: ArchSpec, n_head: int,
                n_kv: int) -> torch.Tensor:
    """uint8 [rows, row_bytes]: one 2-D tensor's quantized blocks as stored (a fresh copy),
    llama q/k rows un-permuted, tagged with ``ggml_type``."""
    blocks = _blocks(data, info)
    if spec.permute_qk and ".self_attn.q_proj." in name:
        blocks = unpermute_qk(blocks, n_head).contiguous()
    elif spec.permute_qk and ".self_attn.k_proj." in name:
        blocks = unpermute_qk(blocks, n_kv).contiguous()
    blocks.ggml_type = int(info.ggml_type)  # type: ignore[attr-defined]
    return blocks


def _blocks(data, info: GGUFTensorInfo) -> torch.Tensor:
    """uint8 [rows, row_bytes]: a 2-D tensor's blocks as stored (a fresh copy), tagged with
    ``ggml_type``."""
    import numpy as np

    raw = data[info.offset : info.offset + info.n_bytes].view(np.ndarray)
    blocks = torch.from_numpy(np.array(raw.reshape(info.shape[0], -1)))
    blocks.ggml_type = int(info.ggml_type)  # type: ignore[attr-defined]
    return blocks


def _dequantize(data, info: GGUFTensorInfo):
    """float32 numpy array of ``info``'s tensor (a fresh, writable, C-contiguous copy)."""
    import numpy as np
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize

    qtype = GGMLQuantizationType(info.ggml_type)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    shape = info.shape or (1,)
    row_bytes = shape[-1] // block_size * type_size
    # A plain-ndarray view of the memmap (slicing np.memmap itself is slow).
    raw = data[info.offset : info.offset + info.n_bytes].view(np.ndarray)
    raw = raw.reshape(*shape[:-1], row_bytes)
    try:
        array = dequantize(raw, qtype)
    except NotImplementedError as e:
        raise ValueError(f"{info.name}: cannot dequantize GGML type {qtype.name}: {e}") from e
    array = np.asarray(array, dtype=np.float32).reshape(info.shape)
    if not array.flags.writeable or not array.flags.c_contiguous or np.may_share_memory(array, raw):
        array = np.array(array, dtype=np.float32, order="C")
    return array
