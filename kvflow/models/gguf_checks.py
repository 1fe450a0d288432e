"""Typed reads of a GGUF file's ``<arch>.*`` metadata and checks of it against the tensor table.

A value of the wrong type (a string head count, a per-layer list where one number is meant), a
zero head count, or a number the tensors contradict (``embedding_length`` vs ``token_embd``,
``block_count`` vs the ``blk.N`` tensors, a ``rope.dimension_count`` below the head size) is
one ``ValueError`` naming the file and the key, instead of a traceback from deep inside the
model or a model that loads and computes with the wrong numbers."""

from __future__ import annotations

import math
import re
from typing import Any

from kvflow.models.gguf_reader import GGUFMetadata

_BLOCK_INDEX_RE = re.compile(r"^blk\.(\d+)\.")


class ArchKeys:
    """Reads ``<arch>.<suffix>`` metadata keys of one GGUF file, checking their types."""

    def __init__(self, meta: GGUFMetadata, arch: str) -> None:
        self.meta, self.arch = meta, arch

    def get(self, suffix: str, default: Any = None) -> Any:
        return self.meta.get(f"{self.arch}.{suffix}", default)

    def error(self, suffix: str, problem: str) -> ValueError:
        """A ValueError naming the file and the key ``<arch>.<suffix>``."""
        return ValueError(f"{self.meta.path!r}: GGUF metadata key '{self.arch}.{suffix}' "
                          f"{problem}")

    def required(self, suffix: str) -> Any:
        """The value of ``<arch>.<suffix>``.

        Raises:
            ValueError: when the file lacks that key.
        """
        value = self.get(suffix)
        if value is None:
            raise self.error(suffix, "is missing")
        return value

    def int(self, suffix: str, default: int | None = None, minimum: int = 1) -> int:
        """An integer key (>= ``minimum``); ``default`` when absent, required when None.

        Raises:
            ValueError: missing (no default), not an integer, or below ``minimum``.
        """
        return self._checked_int(suffix, self.get(suffix, default), minimum)

    def _checked_int(self, suffix: str, value: Any, minimum: int = 1) -> int:
        if value is None:
            raise self.error(suffix, "is missing")
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.error(suffix, f"is {value!r}, not an integer")
        if value < minimum:
            raise self.error(suffix, f"is {value}, below {minimum}")
        return value

    def per_layer_int(self, suffix: str, default: int | None = None) -> int:
        """A positive integer key that llama.cpp also allows as a per-layer list: a list must
        hold one repeated value (kvflow's models have the same count in every layer).

        Raises:
            ValueError: missing (no default), not an integer, below 1, or a list of
                differing values.
        """
        value = self.get(suffix, default)
        if isinstance(value, list):
            if not value or len(set(value)) != 1:
                raise self.error(suffix, f"holds differing per-layer values {value[:8]} "
                                 "(not supported)")
            value = value[0]
        return self._checked_int(suffix, value)

    def float(self, suffix: str, default: float) -> float:
        """A positive, finite number key; ``default`` when absent.

        Raises:
            ValueError: not a number, not finite, or not above zero.
        """
        value = self.get(suffix, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.error(suffix, f"is {value!r}, not a number")
        if not math.isfinite(value) or value <= 0:
            raise self.error(suffix, f"is {value}, not a positive number")
        return float(value)


def check_single_file(meta: GGUFMetadata) -> None:
    """Refuse one part of a split GGUF (``llama-gguf-split``'s ``*-00001-of-0000N.gguf``,
    ``split.count`` > 1): its tensor table holds only that part's tensors (the later parts
    have no model metadata either), which otherwise reads as a ``block_count`` or
    ``general.architecture`` the file contradicts. kvflow, like transformers and vLLM, loads
    single-file GGUFs.

    Raises:
        ValueError: naming the file, ``split.count`` and how to merge the parts.
    """
    count = meta.get("split.count")
    if isinstance(count, int) and not isinstance(count, bool) and count > 1:
        part = meta.get("split.no")
        which = f"part {part + 1} of {count}" if isinstance(part, int) else f"one of {count} parts"
        raise ValueError(f"{meta.path!r} is {which} of a split GGUF (GGUF metadata key "
                         f"'split.count' is {count}); kvflow loads single-file GGUFs: merge "
                         "the parts first with llama.cpp's `llama-gguf-split --merge "
                         "FIRST-PART.gguf MERGED.gguf` and pass the merged file")


def _rows(tensors: dict, name: str) -> int | None:
    """Rows (first PyTorch dimension) of tensor ``name``, None when the file lacks it."""
    info = tensors.get(name)
    return int(info.shape[0]) if info is not None and info.shape else None


def check_block_count(keys: ArchKeys, tensors: dict, n_layers: int) -> None:
    """The file's ``blk.N`` tensors are blocks 0..n_layers-1 exactly (none at all: a
    metadata-only file), checked without building ``range(n_layers)``: a corrupt count may be
    2**40, and per-layer checks (MoE routers) walk it.

    Raises:
        ValueError: naming the file and ``block_count``.
    """
    blocks = {int(m.group(1)) for m in map(_BLOCK_INDEX_RE.match, tensors) if m}
    if blocks and (len(blocks) != n_layers or max(blocks) != n_layers - 1):
        raise keys.error("block_count", f"is {n_layers} but the file has tensors for blocks "
                         f"0..{max(blocks)} ({len(blocks)} blocks)")


def check_against_tensors(keys: ArchKeys, tensors: dict, kwargs: dict[str, Any]) -> None:
    """Check the config numbers in ``kwargs`` (transformers config keys) against the tensor
    shapes of the file (``tensors``: name -> GGUFTensorInfo, PyTorch-order shapes).

    Raises:
        ValueError: naming the file and the metadata key the tensors contradict.
    """
    hidden, vocab = kwargs["hidden_size"], kwargs["vocab_size"]
    embd = tensors.get("token_embd.weight")
    if embd is not None and len(embd.shape) == 2:
        if embd.shape[1] != hidden:
            raise keys.error("embedding_length", f"is {hidden} but token_embd.weight has "
                             f"{embd.shape[1]} columns")
        if embd.shape[0] != vocab:
            raise keys.error("vocab_size", f"is {vocab} but token_embd.weight has "
                             f"{embd.shape[0]} rows")
    check_block_count(keys, tensors, kwargs["num_hidden_layers"])
    head_dim, n_kv = kwargs["head_dim"], kwargs["num_key_value_heads"]
    up_rows = expected_shapes(kwargs)["ffn_up.weight"][0]
    for name, key, expected in (("blk.0.ffn_up.weight", "feed_forward_length", up_rows),
                                ("blk.0.attn_k.weight", "attention.head_count_kv",
                                 n_kv * head_dim)):
        rows = _rows(tensors, name)
        if rows is not None and rows != expected:
            raise keys.error(key, f"disagrees with {name} ({rows} rows, {expected} expected)")
    _check_head_sizes(keys, tensors, head_dim, n_kv,
                      partial_rotary=_hf_arch(kwargs) in PARTIAL_ROTARY_ARCHITECTURES)
    _check_tensor_shapes(keys, tensors, kwargs)


# transformers classes whose GGUF (llama.cpp) layout differs from Llama's in a tensor shape
WHOLE_PROJECTION_QK_NORM = frozenset({"Olmo2ForCausalLM"})  # q/k norm over all heads
FUSED_GATE_UP = frozenset({"Glm4ForCausalLM"})  # ffn_up holds gate and up, [2 * ffn, hidden]
PARTIAL_ROTARY_ARCHITECTURES = frozenset({"Glm4ForCausalLM"})  # rope.dimension_count < head


def _hf_arch(kwargs: dict[str, Any]) -> str:
    return (kwargs.get("architectures") or [""])[0]


def expected_shapes(kwargs: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """PyTorch-order shape of each known tensor kind, from the config numbers in ``kwargs``:
    keys are global names (``token_embd.weight``) and block parts (``attn_q.weight``).
    OLMo 2's q/k norms span the whole projection; GLM-4's ``ffn_up`` is gate and up fused."""
    h, v, f = kwargs["hidden_size"], kwargs["vocab_size"], kwargs["intermediate_size"]
    q = kwargs["num_attention_heads"] * kwargs["head_dim"]
    kv = kwargs["num_key_value_heads"] * kwargs["head_dim"]
    norms = ("attn_norm", "ffn_norm", "post_attention_norm", "post_ffw_norm", "output_norm")
    arch = _hf_arch(kwargs)
    q_norm, k_norm = ((q,), (kv,)) if arch in WHOLE_PROJECTION_QK_NORM else \
        ((kwargs["head_dim"],), (kwargs["head_dim"],))
    up = (2 * f, h) if arch in FUSED_GATE_UP else (f, h)
    return {**_moe_shapes(kwargs),
        "token_embd.weight": (v, h), "output.weight": (v, h),
        **{f"{n}.weight": (h,) for n in norms},
        "attn_q.weight": (q, h), "attn_k.weight": (kv, h), "attn_v.weight": (kv, h),
        "attn_output.weight": (h, q), "attn_q.bias": (q,), "attn_k.bias": (kv,),
        "attn_v.bias": (kv,), "attn_q_norm.weight": q_norm, "attn_k_norm.weight": k_norm,
        "ffn_gate.weight": (f, h), "ffn_up.weight": up, "ffn_down.weight": (h, f),
    }


def _moe_shapes(kwargs: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Shapes of the expert tensors (``gguf_moe``'s config fields; none for a dense model):
    router [E, H], stacked experts [E, F, H] / [E, H, F], shared expert [S, H] / [H, S]."""
    n_experts = kwargs.get("num_experts") or kwargs.get("num_local_experts")
    if not n_experts:
        return {}
    h = kwargs["hidden_size"]
    f = kwargs.get("moe_intermediate_size") or kwargs["intermediate_size"]
    s = kwargs.get("shared_expert_intermediate_size") or 0
    return {"ffn_gate_inp.weight": (n_experts, h), "ffn_gate_exps.weight": (n_experts, f, h),
            "ffn_up_exps.weight": (n_experts, f, h), "ffn_down_exps.weight": (n_experts, h, f),
            "ffn_gate_shexp.weight": (s, h), "ffn_up_shexp.weight": (s, h),
            "ffn_down_shexp.weight": (h, s)}


def _check_tensor_shapes(keys: ArchKeys, tensors: dict, kwargs: dict[str, Any]) -> None:
    """Every tensor of a known kind, in every block, has the shape the metadata implies.

    Raises:
        ValueError: naming the file, the tensor, its shape and the expected one (a tensor
            that disagrees would fail inside a layer, or load silently: a short LM head).
    """
    shapes = expected_shapes(kwargs)
    for name, info in tensors.items():
        m = _BLOCK_INDEX_RE.match(name)
        expected = shapes.get(name[m.end():] if m else name)
        if expected is not None and tuple(info.shape) != expected:
            raise ValueError(
                f"{keys.meta.path!r}: tensor {name!r} has shape {tuple(info.shape)}, but the "
                f"'{keys.arch}.*' metadata implies {expected} (hidden {kwargs['hidden_size']}, "
                f"vocab {kwargs['vocab_size']}, {kwargs['num_attention_heads']} heads / "
                f"{kwargs['num_key_value_heads']} KV heads of {kwargs['head_dim']}, FFN "
                f"{kwargs['intermediate_size']}); the file is inconsistent")


def _check_head_sizes(keys: ArchKeys, tensors: dict, head_dim: int, n_kv: int,
                      partial_rotary: bool = False) -> None:
    """value_length and rope.dimension_count (and their sliding-window ``_swa`` variants) must
    equal head_dim: kvflow's models have one head size for q, k and v in every layer, and
    rotate the whole head (no partial rotary, except where ``partial_rotary``: GLM-4, whose
    ``rope.dimension_count`` may be any even size up to head_dim).

    Raises:
        ValueError: naming the key that differs.
    """
    v_rows = _rows(tensors, "blk.0.attn_v.weight")
    value_len = keys.get("attention.value_length")
    if value_len is None and v_rows is not None and v_rows % n_kv == 0:
        value_len = v_rows // n_kv
    if value_len is not None and keys.int("attention.value_length", value_len) != head_dim:
        raise keys.error("attention.value_length", f"is {value_len}, but the key/query head "
                         f"size is {head_dim}: different v head sizes are not supported")
    if v_rows is not None and v_rows != n_kv * head_dim:
        raise keys.error("attention.value_length", f"disagrees with blk.0.attn_v.weight "
                         f"({v_rows} rows, {n_kv * head_dim} expected)")
    rot = keys.get("rope.dimension_count")
    if partial_rotary and rot is not None:
        if keys.int("rope.dimension_count") > head_dim or rot % 2:
            raise keys.error("rope.dimension_count", f"is {rot}: it must be even and at most "
                             f"the head size {head_dim}")
    elif rot is not None and keys.int("rope.dimension_count") != head_dim:
        raise keys.error("rope.dimension_count", f"is {rot}, but the head size is {head_dim}: "
                         "partial rotary embeddings are not supported")
    for suffix in ("attention.key_length_swa", "attention.value_length_swa",
                   "rope.dimension_count_swa"):  # llama.cpp's sliding-window-layer sizes
        value = keys.get(suffix)
        if value is not None and value != head_dim:
            raise keys.error(suffix, f"is {value!r}, but the head size is {head_dim}: another "
                             "head or rotary size for sliding-window layers is not supported")


# <arch>.* keys of llama.cpp that change the computation, with the value that leaves it as
# kvflow computes these architectures (a key absent is that value too).
_NEUTRAL_VALUES: dict[str, Any] = {
    "attn_logit_softcapping": 0.0,  # Gemma 2's tanh cap on attention scores
    "logit_scale": 1.0,  # Cohere / Granite: logits times this
    "embedding_scale": 1.0,  # Granite: embeddings times this
    "residual_scale": 1.0,  # Granite: each residual branch times this
    "attention.causal": True,  # False: bidirectional attention (embedding models)
    "attention.clamp_kqv": 0.0,  # q/k/v clamped to +-this (DBRX, OLMo)
    "attention.max_alibi_bias": 0.0,  # ALiBi position biases
}


def check_unapplied_keys(keys: ArchKeys, attention_scale: float,
                         applied: frozenset[str] = frozenset()) -> None:
    """Refuse metadata that changes the numerics in ways kvflow does not compute: a key of
    :data:`_NEUTRAL_VALUES` with another value (except those in ``applied``, which the
    architecture's config reads: Granite's scales, Gemma 2's attention soft-cap), an
    ``attention.scale`` other than the scale kvflow's model uses (``attention_scale``:
    ``head_dim ** -0.5``, Gemma 3's ``query_pre_attn_scalar ** -0.5``, Granite's
    ``attention_multiplier``), or a LayerNorm ``attention.layer_norm_epsilon``
    without the ``attention.layer_norm_rms_epsilon`` these RMSNorm models read (llama.cpp
    refuses such a file too; kvflow would have used a default epsilon).

    Raises:
        ValueError: naming the file and the key.
    """
    for suffix, neutral in _NEUTRAL_VALUES.items():
        if suffix in applied:
            continue
        value = keys.get(suffix)
        if value is not None and value != neutral:
            raise keys.error(suffix, f"is {value!r}: kvflow does not apply it to architecture "
                             f"{keys.arch!r} (only {neutral!r} is supported)")
    scale = keys.get("attention.scale")
    if scale is not None and not (isinstance(scale, (int, float)) and
                                  math.isclose(scale, attention_scale, rel_tol=1e-5)):
        raise keys.error("attention.scale", f"is {scale!r}, but kvflow scales attention "
                         f"scores of architecture {keys.arch!r} by {attention_scale:.6g}")
    if keys.get("attention.layer_norm_rms_epsilon") is None and \
            keys.get("attention.layer_norm_epsilon") is not None:
        raise keys.error("attention.layer_norm_rms_epsilon", "is missing (the file gives a "
                         "LayerNorm attention.layer_norm_epsilon; these models use RMSNorm)")
