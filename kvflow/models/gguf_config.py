"""A transformers config from a GGUF file's metadata, and the GGUF architectures kvflow reads.

Supported ``general.architecture`` values: ``llama`` (Mixtral when it has
``llama.expert_count``), ``qwen2``, ``qwen3``, ``gemma2``, ``gemma3``, ``granite``, ``olmo2``,
``glm4`` and the mixture-of-experts ``qwen2moe``, ``qwen3moe``, ``granitemoe``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvflow.models.gguf_checks import (
    ArchKeys,
    check_against_tensors,
    check_block_count,
    check_single_file,
    check_unapplied_keys,
)
from kvflow.models.gguf_moe import MOE_ARCHITECTURES, check_no_expert_tensors, moe_kwargs
from kvflow.models.gguf_reader import GGUFMetadata, read_gguf_metadata
from kvflow.models.gguf_rope_scaling import MAX_ROPE_POSITIONS, gguf_rope_scaling

if TYPE_CHECKING:  # pragma: no cover
    from transformers import PretrainedConfig


@dataclass(frozen=True)
class ArchSpec:
    """How one GGUF architecture maps to transformers: model type, class name, whether q/k
    rows are stored permuted, the norm weight offset, and tensor-name overrides."""

    model_type: str  # transformers model_type
    hf_architecture: str  # transformers class name for config.architectures
    permute_qk: bool  # llama.cpp stored q/k rows in its interleaved rotary layout
    # llama.cpp stores Gemma's (1 + w) RMSNorm weights with the 1 added: subtract it back
    norm_offset: float = 0.0
    block_names: tuple[tuple[str, str], ...] = ()  # overrides of gguf_loader._BLOCK_NAMES


_GEMMA_NORMS = (("ffn_norm", "pre_feedforward_layernorm"),
                ("post_attention_norm", "post_attention_layernorm"),
                ("post_ffw_norm", "post_feedforward_layernorm"))

_ARCHS: dict[str, ArchSpec] = {
    "llama": ArchSpec("llama", "LlamaForCausalLM", permute_qk=True),
    "qwen2": ArchSpec("qwen2", "Qwen2ForCausalLM", permute_qk=False),
    "qwen3": ArchSpec("qwen3", "Qwen3ForCausalLM", permute_qk=False),
    # Gemma 3: four norms per layer; llama.cpp's "ffn_norm" is the pre-MLP norm here.
    "gemma3": ArchSpec("gemma3_text", "Gemma3ForCausalLM", permute_qk=False, norm_offset=1.0,
                        block_names=_GEMMA_NORMS),
    "gemma2": ArchSpec("gemma2", "Gemma2ForCausalLM", permute_qk=False, norm_offset=1.0,
                       block_names=_GEMMA_NORMS),
    # Granite: llama.cpp converts it as Llama (q/k rows permuted) plus four scales
    "granite": ArchSpec("granite", "GraniteForCausalLM", permute_qk=True),
    # OLMo 2: no pre-norms, norms after attention and MLP, q/k norms over whole projections
    "olmo2": ArchSpec("olmo2", "Olmo2ForCausalLM", permute_qk=False,
                      block_names=(("post_attention_norm", "post_attention_layernorm"),
                                   ("post_ffw_norm", "post_feedforward_layernorm"))),
    # GLM-4-0414: interleaved partial RoPE (unpermuted), ffn_up = gate and up fused,
    # post_attention_norm / post_ffw_norm the norms on the attention / MLP outputs
    "glm4": ArchSpec("glm4", "Glm4ForCausalLM", permute_qk=False,
                     block_names=(("post_attention_norm", "post_self_attn_layernorm"),
                                  ("post_ffw_norm", "post_mlp_layernorm"),
                                  ("ffn_up", "mlp.gate_up_proj"))),
    # Mixture-of-experts (gguf_moe.py): experts stacked as ffn_{gate,up,down}_exps [E, ...]
    "qwen2moe": ArchSpec("qwen2_moe", "Qwen2MoeForCausalLM", permute_qk=False),
    "qwen3moe": ArchSpec("qwen3_moe", "Qwen3MoeForCausalLM", permute_qk=False),
    "granitemoe": ArchSpec("granitemoe", "GraniteMoeForCausalLM", permute_qk=True),
}
# llama.cpp converts Mixtral as ``llama`` (q/k rows permuted) plus ``llama.expert_count``
_MIXTRAL = ArchSpec("mixtral", "MixtralForCausalLM", permute_qk=True)

SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(_ARCHS)


def gguf_architecture(meta: GGUFMetadata) -> tuple[str, ArchSpec]:
    """The file's ``general.architecture`` and its ArchSpec.

    Raises:
        ValueError: for one part of a split GGUF (see :func:`check_single_file`), or an
            architecture kvflow does not read (the supported ones named).
    """
    check_single_file(meta)
    arch = meta.get("general.architecture")
    if arch not in _ARCHS:
        raise ValueError(
            f"Unsupported GGUF architecture {arch!r} in {meta.path!r}; supported "
            f"architectures: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    if arch == "llama" and meta.get("llama.expert_count"):
        return arch, _MIXTRAL
    return arch, _ARCHS[arch]


def _head_counts(keys: ArchKeys) -> tuple[int, int]:
    """(query heads, KV heads); a per-layer list (some GGUFs) must repeat one value.

    Raises:
        ValueError: naming the file and key of a missing, non-integer, zero or per-layer
            varying head count.
    """
    n_heads = keys.per_layer_int("attention.head_count")
    return n_heads, keys.per_layer_int("attention.head_count_kv", n_heads)


def gguf_head_counts(meta: GGUFMetadata) -> tuple[int, int]:
    """(query heads, KV heads) of a GGUF file of a supported architecture.

    Raises:
        ValueError: see :func:`gguf_architecture` and :func:`_head_counts`.
    """
    arch, _ = gguf_architecture(meta)
    return _head_counts(ArchKeys(meta, arch))


def _head_dim(keys: ArchKeys, tensors: dict, hidden: int, n_heads: int) -> int:
    """head_dim from the q projection's shape (rows = n_heads * head_dim, exact), else the
    metadata, else hidden / n_heads. Raises ValueError when shape and metadata disagree."""
    path, head_dim = keys.meta.path, keys.get("attention.key_length")
    if head_dim is not None:
        head_dim = keys.int("attention.key_length")
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


def _vocab_size(keys: ArchKeys, tensors: dict) -> int:
    if keys.get("vocab_size") is not None:
        return keys.int("vocab_size")
    if "token_embd.weight" in tensors:
        return int(tensors["token_embd.weight"].shape[0])
    return len(keys.meta.get("tokenizer.ggml.tokens", []))


def _context_length(keys: ArchKeys) -> int:
    """``context_length`` (default 2048), at most :data:`MAX_ROPE_POSITIONS`: the rotary table
    holds one row per position, so a corrupt count (2**40) would ask for terabytes at start-up.

    Raises:
        ValueError: naming the key, for a missing-type, non-positive or larger value.
    """
    context = keys.int("context_length", 2048)
    if context > MAX_ROPE_POSITIONS:
        raise keys.error("context_length", f"is {context}, above the {MAX_ROPE_POSITIONS} RoPE "
                         "positions kvflow tables")
    return context


# llama.cpp tells the 27B models by their block count (LLM_TYPE_27B)
_GEMMA_27B_LAYERS = {"gemma3": 62, "gemma2": 46}


def _gemma3_kwargs(keys: ArchKeys, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3 (and Gemma 2) extras. Local layers keep transformers' defaults (Gemma 3: every
    6th layer global, local RoPE base 10k, or ``rope.freq_base_swa`` when the file has it;
    Gemma 2: every 2nd layer global, llama.cpp's pattern too); ``final_logit_softcapping``
    when the file has it, and Gemma 2's ``attn_logit_softcapping`` (0 or absent: none).
    query_pre_attn_scalar is not in the file; llama.cpp's rule (``f_attention_scale`` in
    llama-model.cpp): hidden / heads for the 27B models (Gemma 3: 62 blocks, 5376 / 32 = 168,
    its config.json's value, while its head_dim is 128; Gemma 2: 46 blocks, 4608 / 32 = 144),
    else head_dim (256 for the other sizes, as their config.json)."""
    head_dim = kwargs["head_dim"]
    scalar = (kwargs["hidden_size"] // kwargs["num_attention_heads"]
              if kwargs["num_hidden_layers"] == _GEMMA_27B_LAYERS[keys.arch] else head_dim)
    extra: dict[str, Any] = {"hidden_activation": "gelu_pytorch_tanh",
                             "query_pre_attn_scalar": scalar}
    if keys.get("attention.sliding_window") is not None:
        extra["sliding_window"] = keys.int("attention.sliding_window")
    if keys.get("rope.freq_base_swa") is not None:  # the local layers' RoPE base
        extra["rope_local_base_freq"] = keys.float("rope.freq_base_swa", 10000.0)
    if keys.get("final_logit_softcapping", 0.0) != 0.0:
        extra["final_logit_softcapping"] = keys.float("final_logit_softcapping", 0.0)
    if keys.arch == "gemma2":  # transformers' Gemma2Config defaults both caps; none unless set
        extra.setdefault("final_logit_softcapping", None)
        extra["attn_logit_softcapping"] = None
        if keys.get("attn_logit_softcapping", 0.0) != 0.0:
            extra["attn_logit_softcapping"] = keys.float("attn_logit_softcapping", 0.0)
    return extra


def _granite_kwargs(keys: ArchKeys, head_dim: int) -> dict[str, Any]:
    """Granite's four multipliers from llama.cpp's keys (``convert_hf_to_gguf.py`` writes
    transformers' ``*_multiplier`` / ``logits_scaling`` as ``*_scale``): ``embedding_scale``,
    ``residual_scale``, ``logit_scale`` (the logits' divisor) default 1, and
    ``attention.scale`` defaults to ``head_dim ** -0.5`` (llama.cpp's rule for a file
    without it; transformers' config default would be 1)."""
    return {"embedding_multiplier": keys.float("embedding_scale", 1.0),
            "residual_multiplier": keys.float("residual_scale", 1.0),
            "logits_scaling": keys.float("logit_scale", 1.0),
            "attention_multiplier": keys.float("attention.scale", head_dim ** -0.5)}


# <arch>.* keys of _NEUTRAL_VALUES (gguf_checks) that an architecture's config reads
_APPLIED_KEYS: dict[str, frozenset[str]] = {
    "gemma2": frozenset({"attn_logit_softcapping"}),
    "granite": frozenset({"embedding_scale", "residual_scale", "logit_scale"}),
    "granitemoe": frozenset({"embedding_scale", "residual_scale", "logit_scale"}),
}


def _token_kwargs(meta: GGUFMetadata) -> dict[str, Any]:
    """bos/eos/pad token ids and the model name, where the file has them.

    Raises:
        ValueError: naming the file and the key, for a token id that is not an integer
            (llama.cpp reads them as uint32).
    """
    kwargs: dict[str, Any] = {}
    for gguf_key, hf_key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                             ("padding_token_id", "pad_token_id")):
        value = meta.get(f"tokenizer.ggml.{gguf_key}")
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise ValueError(f"{meta.path!r}: GGUF metadata key 'tokenizer.ggml.{gguf_key}' is "
                             f"{value!r:.80}, not an integer token id")
        if value is not None:
            kwargs[hf_key] = value
    name = meta.get("general.name")
    if name:
        kwargs["name_or_path"] = str(name)
    return kwargs


def _config_kwargs(meta: GGUFMetadata) -> tuple[ArchSpec, dict[str, Any]]:
    """The architecture's spec and the transformers config's keyword arguments from the
    metadata, checked against the file's tensors as they are read.

    Raises:
        ValueError: for an unsupported architecture, a metadata key of the wrong type or value,
            or one the tensors contradict (each naming the key).
    """
    arch, spec = gguf_architecture(meta)
    keys = ArchKeys(meta, arch)
    tensors = {t.name: t for t in meta.tensors}
    moe = spec.hf_architecture in MOE_ARCHITECTURES
    _check_experts(keys, tensors, arch, moe)
    kwargs = _common_kwargs(meta, keys, tensors, spec)
    head_dim = kwargs["head_dim"]
    check_block_count(keys, tensors, kwargs["num_hidden_layers"])  # before any per-layer walk
    if moe:
        kwargs.update(moe_kwargs(keys, tensors, spec.hf_architecture, kwargs))
    check_against_tensors(keys, tensors, kwargs)
    kwargs.update(_architecture_kwargs(keys, arch, kwargs, head_dim))
    scale = kwargs.get("attention_multiplier",
                       kwargs.get("query_pre_attn_scalar", head_dim) ** -0.5)
    check_unapplied_keys(keys, scale, _APPLIED_KEYS.get(arch, frozenset()))
    rope_scaling = gguf_rope_scaling(keys, tensors, kwargs)
    if rope_scaling is not None:
        kwargs["rope_scaling"] = rope_scaling
    return spec, kwargs


def _check_experts(keys: ArchKeys, tensors: dict[str, Any], arch: str, moe: bool) -> None:
    """A dense architecture's file has no ``expert_count`` and no expert tensors.

    Raises:
        ValueError: naming ``expert_count`` or the first expert tensor of a dense
            architecture.
    """
    if keys.get("expert_count", 0) and not moe:
        raise keys.error("expert_count", f"is {keys.get('expert_count')}: mixture-of-experts "
                         f"GGUF files of architecture {arch!r} are not supported")
    if not moe:
        check_no_expert_tensors(keys, tensors)


def _common_kwargs(meta: GGUFMetadata, keys: ArchKeys, tensors: dict[str, Any],
                   spec: ArchSpec) -> dict[str, Any]:
    """The config keys every architecture has: sizes (tokens, dimensions, heads, layers),
    norm epsilon, context length, RoPE base, tied embeddings, attention bias and the special
    tokens.

    Raises:
        ValueError: for a missing or bad size key (named).
    """
    hidden = keys.int("embedding_length")
    n_heads, n_kv_heads = _head_counts(keys)
    head_dim = _head_dim(keys, tensors, hidden, n_heads)
    return {
        "architectures": [spec.hf_architecture],
        "vocab_size": _vocab_size(keys, tensors),
        "hidden_size": hidden,
        "num_hidden_layers": keys.int("block_count"),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv_heads,
        "head_dim": head_dim,
        "intermediate_size": keys.int("feed_forward_length"),
        "rms_norm_eps": keys.float("attention.layer_norm_rms_epsilon", 1e-6),
        "max_position_embeddings": _context_length(keys),
        "rope_theta": keys.float("rope.freq_base", 10000.0),
        "tie_word_embeddings": "output.weight" not in tensors,
        # transformers' Qwen2 always has q/k/v biases (and ignores this key); Llama/Qwen3 use it.
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        **_token_kwargs(meta),
    }


def _architecture_kwargs(keys: ArchKeys, arch: str, kwargs: dict[str, Any],
                         head_dim: int) -> dict[str, Any]:
    """The config keys of one architecture family: Gemma's (norms, soft-capping, ...) or
    the others' SiLU activation; Granite's multipliers; GLM-4's rotated fraction of a head.

    Raises:
        ValueError: for ``final_logit_softcapping`` on an architecture other than Gemma's, or
            a bad family key (named).
    """
    if arch in ("gemma2", "gemma3"):
        extra = _gemma3_kwargs(keys, kwargs)
    else:
        extra = {"hidden_act": "silu"}
        if keys.get("final_logit_softcapping", 0.0) != 0.0:
            raise keys.error("final_logit_softcapping", f"is {keys.get('final_logit_softcapping')}"
                             f": logit soft-capping is not supported for architecture {arch!r}")
    if arch in ("granite", "granitemoe"):
        extra.update(_granite_kwargs(keys, head_dim))
    if arch == "glm4":  # the rotated part of each head
        extra["partial_rotary_factor"] = keys.int("rope.dimension_count", head_dim) / head_dim
    return extra


def check_gguf_metadata(meta: GGUFMetadata) -> None:
    """Everything :func:`load_gguf_config` checks of the metadata (types, values, agreement
    with the tensor table), without building the config (the weight loader's check).

    Raises:
        ValueError: naming the file and the offending key.
    """
    _config_kwargs(meta)


def load_gguf_config(path: str) -> PretrainedConfig:
    """Build a transformers config for the GGUF checkpoint at ``path`` from its metadata.

    Returns a ``LlamaConfig`` / ``Qwen2Config`` / ``Qwen3Config`` (``AutoConfig.for_model``)
    with ``architectures`` set (``["LlamaForCausalLM"]`` for GGUF architecture ``llama``,
    ``["Qwen2ForCausalLM"]`` for ``qwen2``, ``["Qwen3ForCausalLM"]`` for ``qwen3``; Gemma 2 /
    Gemma 3 / Granite configs for ``gemma2`` / ``gemma3`` / ``granite``, with their extra
    fields, see :func:`_gemma3_kwargs` and :func:`_granite_kwargs`; Mixtral / Qwen2-MoE /
    Qwen3-MoE / Granite MoE configs for MoE files, see :func:`gguf_moe.moe_kwargs`) and
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
