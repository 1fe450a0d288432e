"""Load llama.cpp GGUF checkpoints: config, dequantized weights and tokenizer.

The header (metadata and tensor table) is parsed by :func:`read_gguf_metadata`, a small
parser of the GGUF v2/v3 layout (``gguf.GGUFReader`` takes seconds on a large vocabulary; see
there); tensor data is read from a memory map and dequantized with the ``gguf`` package's
``gguf.quants.dequantize``, one tensor at a time. transformers only builds the config object
and the tokenizer. ``gguf`` and ``transformers`` are imported lazily, so importing this module
is cheap and works on machines without ``gguf``.

Supported GGUF ``general.architecture`` values: ``llama``, ``qwen2``, ``qwen3``, ``gemma3``.
"""

from __future__ import annotations

import math
import os
import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # pragma: no cover
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

GGUF_MAGIC = b"GGUF"


@dataclass(frozen=True)
class _ArchSpec:
    model_type: str  # transformers model_type
    hf_architecture: str  # transformers class name for config.architectures
    permute_qk: bool  # llama.cpp stored q/k rows in its interleaved rotary layout
    # llama.cpp stores Gemma's (1 + w) RMSNorm weights with the 1 added: subtract it back
    norm_offset: float = 0.0
    block_names: tuple[tuple[str, str], ...] = ()  # overrides of _BLOCK_NAMES


_ARCHS: dict[str, _ArchSpec] = {
    "llama": _ArchSpec("llama", "LlamaForCausalLM", permute_qk=True),
    "qwen2": _ArchSpec("qwen2", "Qwen2ForCausalLM", permute_qk=False),
    "qwen3": _ArchSpec("qwen3", "Qwen3ForCausalLM", permute_qk=False),
    # Gemma 3: four norms per layer; llama.cpp's "ffn_norm" is the pre-MLP norm here.
    "gemma3": _ArchSpec("gemma3_text", "Gemma3ForCausalLM", permute_qk=False, norm_offset=1.0,
                        block_names=(("ffn_norm", "pre_feedforward_layernorm"),
                                     ("post_attention_norm", "post_attention_layernorm"),
                                     ("post_ffw_norm", "post_feedforward_layernorm"))),
}

SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(_ARCHS)

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
}
_SKIPPED_TENSORS = frozenset({"rope_freqs.weight"})  # RoPE factors, not module parameters
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
_GLOBAL_RE = re.compile(r"^(\w+)\.(weight|bias)$")


# --------------------------------------------------------------------------- file access

# GGUF metadata value types (gguf.GGUFValueType): struct formats of the fixed-size ones.
_SCALAR_FORMATS = {
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    10: "Q",
    11: "q",
    12: "d",
}
_NUMPY_TYPES = {
    0: "<u1",
    1: "<i1",
    2: "<u2",
    3: "<i2",
    4: "<u4",
    5: "<i4",
    6: "<f4",
    7: "?",
    10: "<u8",
    11: "<i8",
    12: "<f8",
}
_STRING, _ARRAY = 8, 9
_DEFAULT_ALIGNMENT = 32


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One tensor's header entry.

    ``shape`` is in PyTorch/numpy order (GGUF stores dimensions innermost-first, i.e.
    reversed), ``ggml_type`` a ``gguf.GGMLQuantizationType`` value, ``offset`` the absolute
    byte offset of the data in the file and ``n_bytes`` its size.
    """

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int
    n_bytes: int


@dataclass(frozen=True)
class GGUFMetadata:
    """A GGUF file's header: ``fields`` maps metadata keys to Python values (str, int, float,
    bool, or lists of them) and ``tensors`` lists the tensor entries in file order."""

    path: str
    version: int
    fields: dict[str, Any]
    tensors: tuple[GGUFTensorInfo, ...]

    def get(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key, default)

    def tensor_names(self) -> set[str]:
        return {t.name for t in self.tensors}


def _check_gguf_file(path: str) -> str:
    """Validate that ``path`` is an existing file starting with the GGUF magic."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"GGUF file not found: {path!r}")
    if not os.path.isfile(path):
        raise ValueError(f"{path!r} is not a valid GGUF file: it is not a regular file")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ValueError(
            f"{path!r} is not a valid GGUF file (expected magic {GGUF_MAGIC!r}, got {magic!r})"
        )
    return path


class _HeaderParser:
    """Sequential little-endian reader over the file's bytes (an mmap)."""

    def __init__(self, buf, size: int):
        self.buf, self.size, self.pos = buf, size, 0

    def unpack(self, fmt: str) -> Any:
        value = struct.unpack_from("<" + fmt, self.buf, self.pos)[0]
        self.pos += struct.calcsize("<" + fmt)
        return value

    def string(self) -> str:
        """The next GGUF string (uint64 byte length, then UTF-8 bytes; bad bytes replaced).

        Raises:
            ValueError: when the string runs past the end of the file.
            struct.error: when its length field does.
        """
        n = self.unpack("Q")
        if self.pos + n > self.size:
            raise ValueError("string runs past the end of the file")
        value = bytes(self.buf[self.pos : self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return value

    def value(self, vtype: int) -> Any:
        """The next metadata value of GGUF type ``vtype``: a scalar, a string, or a list for an
        array (nested arrays as nested lists).

        Raises:
            ValueError: for an unknown value or array item type, or a string or array past
                the end of the file.
            struct.error: when a scalar or length field runs past the end of the file.
        """
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            item_type, count = self.unpack("I"), self.unpack("Q")
            if item_type == _STRING:
                return [self.string() for _ in range(count)]
            if item_type in _NUMPY_TYPES:
                import numpy as np

                dtype = np.dtype(_NUMPY_TYPES[item_type])
                if self.pos + count * dtype.itemsize > self.size:
                    raise ValueError("array runs past the end of the file")
                arr = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos)
                values = arr.tolist()
                del arr  # release the buffer export so the mmap can close
                self.pos += count * dtype.itemsize
                return values
            if item_type == _ARRAY:
                return [self.value(_ARRAY) for _ in range(count)]
            raise ValueError(f"unknown array item type {item_type}")
        if vtype in _SCALAR_FORMATS:
            return self.unpack(_SCALAR_FORMATS[vtype])
        raise ValueError(f"unknown metadata value type {vtype}")


def read_gguf_metadata(path: str) -> GGUFMetadata:
    """Parse a GGUF file's header (metadata key/values and tensor infos) without its data.

    This is a small pure-Python parser of the GGUF v2/v3 little-endian layout (as documented
    in ggml's ``docs/gguf.md`` and implemented by ``gguf.GGUFReader``). It exists because
    ``gguf.GGUFReader`` builds a numpy memmap slice per metadata array element, which takes
    ~5-8 s for a 49k-token vocabulary on a small CPU (more for 150k-token Qwen vocabularies);
    this parser reads the same header in well under a second. Tests check it against
    ``GGUFReader``.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: ``path`` is not a valid (v2/v3, little-endian) GGUF file.
    """
    import mmap

    path = _check_gguf_file(path)
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            try:
                return _parse_header(path, mm, size)
            except (struct.error, ValueError, IndexError, OverflowError, MemoryError) as e:
                raise ValueError(f"{path!r} is not a valid GGUF file: {e}") from e


def _parse_header(path: str, buf, size: int) -> GGUFMetadata:
    p = _HeaderParser(buf, size)
    p.pos = 4  # magic, checked by _check_gguf_file
    version = p.unpack("I")
    if version & 0xFFFF == 0:
        raise ValueError("big-endian GGUF files are not supported")
    if version not in (2, 3):
        raise ValueError(f"unsupported GGUF version {version} (supported: 2, 3)")
    n_tensors, n_kv = p.unpack("Q"), p.unpack("Q")
    if n_tensors > size or n_kv > size:
        raise ValueError(f"implausible header counts ({n_tensors} tensors, {n_kv} keys)")
    fields: dict[str, Any] = {}
    for _ in range(n_kv):
        key = p.string()
        fields[key] = p.value(p.unpack("I"))
    infos = []
    for _ in range(n_tensors):
        name = p.string()
        n_dims = p.unpack("I")
        if n_dims > 8:
            raise ValueError(f"tensor {name!r} has {n_dims} dimensions")
        dims = [p.unpack("Q") for _ in range(n_dims)]
        infos.append((name, dims, p.unpack("I"), p.unpack("Q")))
    alignment = int(fields.get("general.alignment", _DEFAULT_ALIGNMENT))
    if alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"invalid general.alignment {alignment}")
    data_start = -(-p.pos // alignment) * alignment

    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    tensors = []
    for name, dims, ggml_type, offset in infos:
        try:
            qtype = GGMLQuantizationType(ggml_type)
            block_size, type_size = GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            raise ValueError(f"tensor {name!r} has unknown ggml type {ggml_type}") from None
        n_elems = math.prod(dims)
        if dims and dims[0] % block_size:
            raise ValueError(f"tensor {name!r}: row of {dims[0]} not a multiple of {block_size}")
        n_bytes = n_elems // block_size * type_size
        start = data_start + offset
        if start + n_bytes > size:
            raise ValueError(f"tensor {name!r} data runs past the end of the file (truncated?)")
        shape = tuple(int(d) for d in reversed(dims))
        tensors.append(GGUFTensorInfo(name, shape, int(ggml_type), start, n_bytes))
    return GGUFMetadata(path, version, fields, tuple(tensors))


def _architecture(meta: GGUFMetadata) -> tuple[str, _ArchSpec]:
    arch = meta.get("general.architecture")
    if arch not in _ARCHS:
        raise ValueError(
            f"Unsupported GGUF architecture {arch!r} in {meta.path!r}; supported "
            f"architectures: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return arch, _ARCHS[arch]


# --------------------------------------------------------------------------- config


class _ArchKeys:
    """Reads ``<arch>.<suffix>`` metadata keys of one GGUF file."""

    def __init__(self, meta: GGUFMetadata, arch: str) -> None:
        self.meta, self.arch = meta, arch

    def get(self, suffix: str, default: Any = None) -> Any:
        return self.meta.get(f"{self.arch}.{suffix}", default)

    def required(self, suffix: str) -> Any:
        """The value of ``<arch>.<suffix>``.

        Raises:
            ValueError: when the file lacks that key.
        """
        value = self.get(suffix)
        if value is None:
            raise ValueError(f"{self.meta.path!r}: GGUF metadata key '{self.arch}.{suffix}' "
                             "is missing")
        return value


def _head_counts(keys: _ArchKeys) -> tuple[int, int]:
    """(query heads, KV heads); a per-layer KV-head list (some GGUFs) gives its maximum."""
    n_heads = int(keys.required("attention.head_count"))
    n_kv_heads = keys.get("attention.head_count_kv", n_heads)
    if isinstance(n_kv_heads, list):
        n_kv_heads = max(n_kv_heads)
    return n_heads, int(n_kv_heads)


def _head_dim(keys: _ArchKeys, tensors: dict, hidden: int, n_heads: int) -> int:
    """head_dim from the q projection's shape (rows = n_heads * head_dim, exact), else the
    metadata, else hidden / n_heads. Raises ValueError when shape and metadata disagree."""
    path, head_dim = keys.meta.path, keys.get("attention.key_length")
    q = tensors.get("blk.0.attn_q.weight")
    if q is None:
        return int(head_dim if head_dim is not None else hidden // n_heads)
    q_rows = q.shape[0]
    if q_rows % n_heads:
        raise ValueError(f"{path!r}: attn_q rows {q_rows} not divisible by {n_heads} heads")
    if head_dim is not None and int(head_dim) != q_rows // n_heads:
        raise ValueError(f"{path!r}: {keys.arch}.attention.key_length={head_dim} disagrees "
                         f"with attn_q shape ({q_rows} rows / {n_heads} heads)")
    return q_rows // n_heads


def _vocab_size(keys: _ArchKeys, tensors: dict) -> int:
    vocab_size = keys.get("vocab_size")
    if vocab_size is not None:
        return int(vocab_size)
    if "token_embd.weight" in tensors:
        return int(tensors["token_embd.weight"].shape[0])
    return len(keys.meta.get("tokenizer.ggml.tokens", []))


def _rope_scaling(keys: _ArchKeys) -> dict[str, Any] | None:
    scaling_type = keys.get("rope.scaling.type")
    if scaling_type in (None, "none"):
        return None
    rope_scaling: dict[str, Any] = {"rope_type": scaling_type}
    factor = keys.get("rope.scaling.factor")
    if factor is not None:
        rope_scaling["factor"] = float(factor)
    orig = keys.get("rope.scaling.original_context_length")
    if orig is not None:
        rope_scaling["original_max_position_embeddings"] = int(orig)
    return rope_scaling


def _gemma3_kwargs(keys: _ArchKeys, head_dim: int) -> dict[str, Any]:
    """Gemma 3 extras. Local layers keep transformers' defaults (every 6th layer global, local
    RoPE base 10k); query_pre_attn_scalar is not in the file: head_dim, as llama.cpp uses for
    every size but 27B (and transformers' default of 256 for the 270M-12B sizes)."""
    kwargs: dict[str, Any] = {"hidden_activation": "gelu_pytorch_tanh",
                              "query_pre_attn_scalar": head_dim}
    window = keys.get("attention.sliding_window")
    if window is not None:
        kwargs["sliding_window"] = int(window)
    return kwargs


def _token_kwargs(meta: GGUFMetadata) -> dict[str, Any]:
    """bos/eos/pad token ids and the model name, where the file has them."""
    kwargs: dict[str, Any] = {}
    for gguf_key, hf_key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                             ("padding_token_id", "pad_token_id")):
        value = meta.get(f"tokenizer.ggml.{gguf_key}")
        if value is not None:
            kwargs[hf_key] = int(value)
    name = meta.get("general.name")
    if name:
        kwargs["name_or_path"] = str(name)
    return kwargs


def _config_kwargs(meta: GGUFMetadata) -> tuple[_ArchSpec, dict[str, Any]]:
    arch, spec = _architecture(meta)
    keys = _ArchKeys(meta, arch)
    tensors = {t.name: t for t in meta.tensors}
    if "rope_freqs.weight" in tensors:
        raise ValueError(
            f"{meta.path!r}: GGUF has a 'rope_freqs' tensor (llama3-style RoPE scaling), which "
            "kvflow cannot map back to a transformers rope config"
        )
    hidden = int(keys.required("embedding_length"))
    n_heads, n_kv_heads = _head_counts(keys)
    head_dim = _head_dim(keys, tensors, hidden, n_heads)
    kwargs: dict[str, Any] = {
        "architectures": [spec.hf_architecture],
        "vocab_size": _vocab_size(keys, tensors),
        "hidden_size": hidden,
        "num_hidden_layers": int(keys.required("block_count")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv_heads,
        "head_dim": head_dim,
        "intermediate_size": int(keys.required("feed_forward_length")),
        "rms_norm_eps": float(keys.get("attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": int(keys.get("context_length", 2048)),
        "rope_theta": float(keys.get("rope.freq_base", 10000.0)),
        "tie_word_embeddings": "output.weight" not in tensors,
        # transformers' Qwen2 always has q/k/v biases (and ignores this key); Llama/Qwen3 use it.
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        **_token_kwargs(meta),
    }
    if arch == "gemma3":
        kwargs.update(_gemma3_kwargs(keys, head_dim))
    else:
        kwargs["hidden_act"] = "silu"
    rope_scaling = _rope_scaling(keys)
    if rope_scaling is not None:
        kwargs["rope_scaling"] = rope_scaling
    return spec, kwargs


def load_gguf_config(path: str) -> PretrainedConfig:
    """Build a transformers config for the GGUF checkpoint at ``path`` from its metadata.

    Returns a ``LlamaConfig`` / ``Qwen2Config`` / ``Qwen3Config`` (``AutoConfig.for_model``)
    with ``architectures`` set (``["LlamaForCausalLM"]`` for GGUF architecture ``llama``,
    ``["Qwen2ForCausalLM"]`` for ``qwen2``, ``["Qwen3ForCausalLM"]`` for ``qwen3``) and
    ``vocab_size``, ``hidden_size``, ``num_hidden_layers``, ``num_attention_heads``,
    ``num_key_value_heads``, ``head_dim`` (taken from the ``attn_q`` tensor shape, which is
    exact even where head_dim != hidden_size / num_heads), ``intermediate_size``,
    ``rms_norm_eps``, ``max_position_embeddings``, the RoPE base (``rope_theta``; with
    transformers >= 5 it lives in ``config.rope_parameters["rope_theta"]``),
    ``tie_word_embeddings`` (True iff the GGUF has no ``output.weight`` tensor) and the
    bos/eos/pad token ids from the tokenizer metadata.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: ``path`` is not a valid GGUF file, its ``general.architecture`` is not
            one of :data:`SUPPORTED_ARCHITECTURES`, or required metadata is missing.
    """
    spec, kwargs = _config_kwargs(read_gguf_metadata(path))
    from transformers import AutoConfig

    return AutoConfig.for_model(spec.model_type, **kwargs)


# --------------------------------------------------------------------------- weights


def _hf_name(gguf_name: str, spec: _ArchSpec | None = None) -> str:
    """Map a GGUF tensor name to the HF parameter name (ValueError if unknown)."""
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
    tied). Each tensor is dequantized with ``gguf.quants.dequantize`` to float32, reshaped to
    the PyTorch shape (GGUF lists dimensions in reverse, so a linear weight is
    ``[out_features, in_features]``), converted to ``dtype`` on the CPU and is contiguous.

    For GGUF architecture ``llama`` the q_proj/k_proj rows (and biases) are un-permuted
    (see :func:`unpermute_qk`; the permutation is llama.cpp's ``convert_hf_to_gguf.py``
    ``LlamaModel.permute``). qwen2/qwen3/gemma3 GGUFs are stored unpermuted; gemma3 norm
    weights are stored as ``1 + w`` and come back as ``w`` (the ``(1 + w)`` RMSNorm's own).

    Tensors are produced one at a time from a memory map, so peak extra memory is about one
    float32 copy of the largest tensor. The file is validated before the iterator is returned.

    With ``keep_quantized``, a 2-D tensor of a quantized GGML type (linear and embedding
    weights) comes as its raw blocks instead: uint8 ``[rows, row_bytes]`` exactly as in the
    file (llama q/k rows un-permuted, which moves whole rows), with the GGML type as the
    tensor's ``ggml_type`` attribute (a ``gguf.GGMLQuantizationType`` value).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: not a valid GGUF, unsupported architecture, or an unrecognized tensor.
    """
    meta = read_gguf_metadata(path)
    arch, spec = _architecture(meta)
    n_head = int(meta.get(f"{arch}.attention.head_count"))
    n_kv = meta.get(f"{arch}.attention.head_count_kv", n_head)
    n_kv = int(max(n_kv) if isinstance(n_kv, list) else n_kv)
    names = {t.name: _hf_name(t.name, spec) for t in meta.tensors
             if t.name not in _SKIPPED_TENSORS}
    return _iter_weights(meta, names, spec, n_head, n_kv, dtype, keep_quantized)


def _iter_weights(
    meta: GGUFMetadata,
    names: dict[str, str],
    spec: _ArchSpec,
    n_head: int,
    n_kv: int,
    dtype: torch.dtype,
    keep_quantized: bool = False,
) -> Iterator[tuple[str, torch.Tensor]]:
    import numpy as np

    data = np.memmap(meta.path, dtype=np.uint8, mode="r")
    try:
        for info in meta.tensors:
            if info.name not in names:
                continue
            name = names[info.name]
            if keep_quantized and len(info.shape) == 2 and info.ggml_type not in _FLOAT_TYPES:
                yield name, _raw_blocks(data, info, name, spec, n_head, n_kv)
                continue
            weight = torch.from_numpy(_dequantize(data, info))
            if spec.norm_offset and name.endswith("norm.weight"):
                weight = weight - spec.norm_offset
            if spec.permute_qk:
                if ".self_attn.q_proj." in name:
                    weight = unpermute_qk(weight, n_head)
                elif ".self_attn.k_proj." in name:
                    weight = unpermute_qk(weight, n_kv)
            out = weight.to(dtype).contiguous()
            del weight  # keep at most one float32 copy alive while the caller holds ``out``
            yield name, out
            del out
    finally:
        del data


_FLOAT_TYPES = frozenset({0, 1, 30})  # GGML F32, F16, BF16: read as floats, never kept raw


def _raw_blocks(data, info: GGUFTensorInfo, name: str, spec: _ArchSpec, n_head: int,
                n_kv: int) -> torch.Tensor:
    """uint8 [rows, row_bytes]: one 2-D tensor's quantized blocks as stored (a fresh copy),
    llama q/k rows un-permuted, tagged with ``ggml_type``."""
    import numpy as np

    raw = data[info.offset : info.offset + info.n_bytes].view(np.ndarray)
    blocks = torch.from_numpy(np.array(raw.reshape(info.shape[0], -1)))
    if spec.permute_qk and ".self_attn.q_proj." in name:
        blocks = unpermute_qk(blocks, n_head).contiguous()
    elif spec.permute_qk and ".self_attn.k_proj." in name:
        blocks = unpermute_qk(blocks, n_kv).contiguous()
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


# --------------------------------------------------------------------------- tokenizer


def load_gguf_tokenizer(path: str) -> PreTrainedTokenizerBase:
    """Build a transformers (fast) tokenizer from the GGUF's tokenizer metadata.

    Uses ``AutoTokenizer.from_pretrained(dirname, gguf_file=basename)`` (a
    ``PreTrainedTokenizerFast``-style tokenizer; GGUF ``tokenizer.ggml.add_bos_token`` is
    honoured by transformers). The returned tokenizer has ``chat_template`` set from the GGUF
    key ``tokenizer.chat_template`` when transformers did not set it, and its bos/eos/pad
    tokens are made to match ``tokenizer.ggml.{bos,eos,padding}_token_id`` when present. The
    result is saved under the kvflow cache directory and reloaded from there next time (see
    ``_tokenizer_cache_dir``).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: ``path`` is not a valid GGUF file.
    """
    meta = read_gguf_metadata(path)  # validates the file first (fast)
    from transformers import AutoTokenizer

    cached = _tokenizer_cache_dir(meta.path)
    if cached is not None and os.path.isfile(os.path.join(cached, "tokenizer_config.json")):
        try:
            return AutoTokenizer.from_pretrained(cached)
        except (OSError, ValueError):
            pass  # unreadable cache entry: rebuild it below
    directory, filename = os.path.split(os.path.abspath(meta.path))
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=filename)
    template = meta.get("tokenizer.chat_template")
    if template and not tokenizer.chat_template:
        tokenizer.chat_template = str(template)
    for attr, key in (
        ("bos_token", "bos_token_id"),
        ("eos_token", "eos_token_id"),
        ("pad_token", "padding_token_id"),
    ):
        token_id = meta.get(f"tokenizer.ggml.{key}")
        if token_id is not None and getattr(tokenizer, f"{attr}_id") != token_id:
            token = tokenizer.convert_ids_to_tokens(int(token_id))
            if token is not None:
                setattr(tokenizer, attr, token)
    if cached is not None:
        _save_tokenizer_cache(tokenizer, cached)
    return tokenizer


def _tokenizer_cache_dir(path: str) -> str | None:
    """Cache folder for the tokenizer built from ``path``, keyed by the file's absolute path,
    size and mtime (None when the file cannot be stat'ed). transformers rebuilds a GGUF
    tokenizer through ``gguf.GGUFReader``, minutes for a 262k vocabulary (Gemma 3) on a small
    CPU; a saved ``tokenizer.json`` loads in about a second."""
    import hashlib

    from kvflow.config import cache_dir

    try:
        st = os.stat(path)
    except OSError:
        return None
    key = f"{os.path.abspath(path)}|{st.st_size}|{st.st_mtime_ns}".encode()
    return os.path.join(cache_dir(), "tokenizers", hashlib.sha256(key).hexdigest()[:24])


def _save_tokenizer_cache(tokenizer: Any, folder: str) -> None:
    """Save into a temporary folder and rename it into place (best effort: a read-only cache
    only costs the next load its speed)."""
    import shutil
    import tempfile

    tmp = None
    try:
        os.makedirs(os.path.dirname(folder), exist_ok=True)
        tmp = tempfile.mkdtemp(dir=os.path.dirname(folder))
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, folder)
    except OSError:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
