"""The mixture-of-experts part of a GGUF file's config: Mixtral (``llama`` with
``llama.expert_count``), ``qwen2moe``, ``qwen3moe`` and ``granitemoe``.

llama.cpp's ``convert_hf_to_gguf.py`` stacks each layer's experts into three tensors,
``blk.N.ffn_gate_exps`` / ``ffn_up_exps`` [E, F, H] and ``ffn_down_exps`` [E, H, F] (PyTorch
order; Granite's fused ``input_linear`` is split into its gate and up halves), the router as
``ffn_gate_inp`` [E, H], and Qwen2-MoE's shared expert as ``ffn_{gate,up,down}_shexp`` with its
sigmoid gate ``ffn_gate_inp_shexp`` [H]. The metadata says ``<arch>.expert_count``,
``expert_used_count``, ``expert_feed_forward_length`` (F; absent: ``feed_forward_length``) and
``expert_shared_feed_forward_length``. Routing is a softmax over the experts, the top
``expert_used_count`` renormalized as llama.cpp computes each architecture (Mixtral, Granite
MoE, Qwen3-MoE: renormalized; Qwen2-MoE: not) unless ``expert_weights_norm`` says otherwise.
A Qwen MoE layer without a router keeps a dense MLP (transformers' ``mlp_only_layers``).
Early (2023) Mixtral GGUFs store one tensor per expert, ``blk.N.ffn_{gate,up,down}.E``,
read as well."""

from __future__ import annotations

import re
from typing import Any

from kvflow.models.gguf_checks import ArchKeys

# transformers classes of the GGUF MoE architectures (config.architectures[0])
QWEN_MOE = frozenset({"Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"})
MOE_ARCHITECTURES = QWEN_MOE | {"MixtralForCausalLM", "GraniteMoeForCausalLM"}

_ROUTER_RE = re.compile(r"^blk\.(\d+)\.ffn_gate_inp\.weight$")
# any expert-related tensor: router, stacked or per-expert (early Mixtral), shared expert
_MOE_TENSOR_RE = re.compile(r"^blk\.\d+\.ffn_(gate_inp|\w+_exps|\w+_shexp|gate_inp_shexp|"
                            r"(gate|up|down)\.\d+)\.weight$")
_LEGACY_GATE_RE = re.compile(r"^blk\.\d+\.ffn_gate\.(\d+)\.weight$")
_SOFTMAX_GATING = 1  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX


def _rows(tensors: dict, name: str, dim: int = 0) -> int | None:
    info = tensors.get(name)
    return int(info.shape[dim]) if info is not None and len(info.shape) > dim else None


def moe_kwargs(keys: ArchKeys, tensors: dict, hf_arch: str,
               kwargs: dict[str, Any]) -> dict[str, Any]:
    """The transformers config fields of an MoE GGUF file (``hf_arch``: one of
    :data:`MOE_ARCHITECTURES`): Mixtral / Granite MoE ``num_local_experts``,
    ``num_experts_per_tok``, ``intermediate_size`` (the expert width); Qwen MoE
    ``num_experts``, ``num_experts_per_tok``, ``moe_intermediate_size``, ``norm_topk_prob``,
    ``mlp_only_layers`` (layers without ``ffn_gate_inp``) and, for Qwen2-MoE,
    ``shared_expert_intermediate_size``. ``kwargs`` holds the dense fields already read
    (``num_hidden_layers``, ``intermediate_size``).

    Raises:
        ValueError: naming the file and key, for a missing or non-integer expert count, more
            experts used than there are, a count or width the expert tensors contradict,
            gating other than softmax (``expert_gating_func``), scaled routing weights
            (``expert_weights_scale`` other than 1), renormalization off where kvflow's model
            always renormalizes (``expert_weights_norm``), a shared expert where the model
            has none, or (Mixtral, Granite) a layer without a router.
    """
    n_experts = keys.int("expert_count")
    sparse = _sparse_layers(keys, tensors, n_experts)
    n_used, norm = _routing(keys, hf_arch, n_experts)
    dense = _dense_layers(keys, sparse, kwargs["num_hidden_layers"], n_experts, hf_arch)
    first = f"blk.{sparse[0]}"
    expert_ffn = _expert_width(keys, tensors, first, n_experts, kwargs["intermediate_size"])
    shared = _shared_width(keys, tensors, first, hf_arch)
    if hf_arch not in QWEN_MOE:
        extra: dict[str, Any] = {"num_local_experts": n_experts, "num_experts_per_tok": n_used,
                                 "intermediate_size": expert_ffn}
        if hf_arch == "MixtralForCausalLM":
            extra["sliding_window"] = None  # llama.cpp's llama graph attends to everything
        return extra
    extra = {"num_experts": n_experts, "num_experts_per_tok": n_used,
             "moe_intermediate_size": expert_ffn, "norm_topk_prob": norm,
             "mlp_only_layers": dense, "decoder_sparse_step": 1}
    if hf_arch == "Qwen2MoeForCausalLM":
        extra["shared_expert_intermediate_size"] = shared
    return extra


def _sparse_layers(keys: ArchKeys, tensors: dict, n_experts: int) -> list[int]:
    """Indices of the layers with a router (``blk.N.ffn_gate_inp``), ascending; raises
    ValueError if there are none."""
    sparse = sorted(int(m.group(1)) for m in map(_ROUTER_RE.match, tensors) if m)
    if not sparse:
        raise keys.error("expert_count", f"is {n_experts}, but the file has no "
                         "ffn_gate_inp (router) tensors")
    return sparse


def _routing(keys: ArchKeys, hf_arch: str, n_experts: int) -> tuple[int, bool]:
    """``(expert_used_count, renormalize top-k)`` after checking the routing is one kvflow
    computes (softmax gating, unscaled weights, renormalized unless Qwen); raises ValueError
    naming the key otherwise."""
    n_used = keys.int("expert_used_count")
    if n_used > n_experts:
        raise keys.error("expert_used_count", f"is {n_used}, more than the "
                         f"{n_experts} experts (expert_count)")
    gating = keys.get("expert_gating_func")
    if gating is not None and gating != _SOFTMAX_GATING:
        raise keys.error("expert_gating_func", f"is {gating!r}: kvflow routes these "
                         f"architectures by softmax only ({_SOFTMAX_GATING})")
    scale = keys.get("expert_weights_scale")
    if scale is not None and scale != 1.0:
        raise keys.error("expert_weights_scale", f"is {scale!r}: scaled routing weights are "
                         "not supported for this architecture (only 1.0)")
    norm = keys.get("expert_weights_norm", hf_arch != "Qwen2MoeForCausalLM")
    if not isinstance(norm, bool):
        raise keys.error("expert_weights_norm", f"is {norm!r}, not a boolean")
    if hf_arch not in QWEN_MOE and not norm:
        raise keys.error("expert_weights_norm", f"is false, but {hf_arch} always "
                         "renormalizes the top-k routing weights")
    return n_used, norm


def _dense_layers(keys: ArchKeys, sparse: list[int], n_layers: int, n_experts: int,
                  hf_arch: str) -> list[int]:
    """The layers without a router (Qwen's ``mlp_only_layers``); raises ValueError if there
    are any and ``hf_arch`` has experts in every layer (Mixtral, Granite MoE)."""
    dense = [i for i in range(n_layers) if i not in sparse]
    if dense and hf_arch not in QWEN_MOE:
        raise keys.error("expert_count", f"is {n_experts}, but layers {dense[:8]} have no "
                         f"ffn_gate_inp router ({hf_arch} has experts in every layer)")
    return dense


def _expert_width(keys: ArchKeys, tensors: dict, first: str, n_experts: int,
                  dense_ffn: int) -> int:
    """The expert FFN width F (``expert_feed_forward_length``, default ``dense_ffn``) after
    checking the first sparse layer ``first`` (``"blk.N"``): its router routes to
    ``n_experts`` experts and its expert gate weights (stacked, or per expert in early Mixtral
    files) have F rows. Raises ValueError naming the key otherwise."""
    router_rows = _rows(tensors, f"{first}.ffn_gate_inp.weight")
    if router_rows != n_experts:
        raise keys.error("expert_count", f"is {n_experts}, but {first}.ffn_gate_inp.weight "
                         f"routes to {router_rows} experts")
    expert_ffn = keys.int("expert_feed_forward_length", dense_ffn)
    exp_rows = _rows(tensors, f"{first}.ffn_gate_exps.weight", 1)
    legacy = _rows(tensors, f"{first}.ffn_gate.0.weight")  # early Mixtral files: per expert
    if exp_rows is None and legacy is not None:
        exp_rows = legacy
        legacy_experts = {m.group(1) for m in map(_LEGACY_GATE_RE.match, tensors) if m
                          and m.group(0).startswith(f"{first}.")}
        if len(legacy_experts) != n_experts:
            raise keys.error("expert_count", f"is {n_experts}, but {first} has "
                             f"{len(legacy_experts)} ffn_gate.E expert tensors")
    if exp_rows is not None and exp_rows != expert_ffn:
        raise keys.error("expert_feed_forward_length", f"is {expert_ffn}, but "
                         f"{first}'s expert gate weights have {exp_rows} rows")
    return expert_ffn


def _shared_width(keys: ArchKeys, tensors: dict, first: str, hf_arch: str) -> int:
    """The shared expert's FFN width (``expert_shared_feed_forward_length``; 0: none), checked
    against ``{first}.ffn_gate_shexp.weight``; raises ValueError if they disagree or
    ``hf_arch`` is not Qwen2-MoE (the only one with a shared expert)."""
    shexp_rows = _rows(tensors, f"{first}.ffn_gate_shexp.weight")
    shared = keys.int("expert_shared_feed_forward_length", shexp_rows or 0, minimum=0)
    if shexp_rows is not None and shexp_rows != shared:
        raise keys.error("expert_shared_feed_forward_length", f"is {shared}, but "
                         f"{first}.ffn_gate_shexp.weight has {shexp_rows} rows")
    if shared and hf_arch != "Qwen2MoeForCausalLM":
        raise keys.error("expert_shared_feed_forward_length", f"is {shared}: a shared "
                         f"expert is not supported for {hf_arch}")
    if shared and shexp_rows is None:
        raise keys.error("expert_shared_feed_forward_length", f"is {shared}, but the file "
                         f"has no {first}.ffn_gate_shexp.weight")
    return shared


def check_no_expert_tensors(keys: ArchKeys, tensors: dict) -> None:
    """A file read as a dense model must hold no expert tensors (they would match no
    parameter, or be dropped).

    Raises:
        ValueError: naming the file, the tensor and the missing ``<arch>.expert_count``.
    """
    stray = next((name for name in tensors if _MOE_TENSOR_RE.match(name)), None)
    if stray is not None:
        raise keys.error("expert_count", f"is missing, but the file has the "
                         f"mixture-of-experts tensor {stray!r}")
