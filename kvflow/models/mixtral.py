"""Mixtral (Jiang et al., "Mixtral of Experts", 2024, arXiv:2401.04088) and the sparse-MoE
decoder shared with Qwen MoE (``kvflow/models/qwen_moe.py``).

A sparse-MoE decoder is the Llama decoder (``kvflow/models/llama.py``: attention, RoPE,
RMSNorm, the layer and model ``forward``s are imported, not copied) with the dense MLP of some
or all layers replaced by a :class:`SparseMoeBlock`: a router, the experts in one
:class:`~kvflow.layers.moe.FusedMoE`, and optionally a gated shared expert (Qwen2-MoE).

Checkpoint names: per-expert tensors ``...experts.{e}.{w1,w3,w2}.weight`` (Mixtral) or
``...experts.{e}.{gate,up,down}_proj.weight`` (Qwen), or transformers 5's stacked
``...experts.gate_up_proj`` / ``...experts.down_proj``, all land in ``experts.w13_weight`` /
``experts.w2_weight`` through ``FusedMoE.weight_loader(param, tensor, shard_id, expert_id)``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from types import SimpleNamespace
from typing import Any, ClassVar

import torch
from torch import nn

from kvflow.attention.layer import AttentionContext
from kvflow.distributed.parallel_state import ParallelState
from kvflow.layers.activation import require_silu
from kvflow.layers.linear import ReplicatedLinear
from kvflow.layers.moe import FusedMoE
from kvflow.layers.norm import RMSNorm
from kvflow.layers.rotary import RotaryEmbedding
from kvflow.models.fused_shards import note_loaded_expert
from kvflow.models.llama import (
    AttentionBias,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaModel,
    make_lm_head,
    make_rotary_embedding,
)
from kvflow.models.parallel_utils import is_pp_missing

# checkpoint projection name -> (FusedMoE parameter, weight_loader shard_id)
_EXPERT_PROJ = {"w1": ("w13_weight", "w1"), "gate_proj": ("w13_weight", "w1"),
                "w3": ("w13_weight", "w3"), "up_proj": ("w13_weight", "w3"),
                "w2": ("w2_weight", "w2"), "down_proj": ("w2_weight", "w2"),
                "gate_up_proj": ("w13_weight", "w13")}
_PER_EXPERT = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<expert>\d+)\.(?P<proj>\w+)\.weight$")
_STACKED = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<proj>gate_up_proj|down_proj)$")


def gated_mlp(config: Any, intermediate_size: int, parallel: ParallelState) -> LlamaMLP:
    """A gated MLP of the given width with the config's ``hidden_act`` and ``mlp_bias``
    (DeepSeek-V2 in transformers; absent elsewhere: SwiGLU without bias); Llama's, so its
    gate/up fusion, loaders and tensor parallelism apply."""
    sub = SimpleNamespace(hidden_size=config.hidden_size, intermediate_size=intermediate_size,
                          mlp_bias=bool(getattr(config, "mlp_bias", False)),
                          hidden_act=getattr(config, "hidden_act", None))
    return LlamaMLP(sub, parallel)


class SparseMoeBlock(nn.Module):
    """``forward(hidden [T, H]) -> [T, H]``: router logits ``gate(hidden)`` [T, E], routed
    experts, plus ``sigmoid(shared_expert_gate(hidden)) * shared_expert(hidden)`` when a
    shared expert is configured (Qwen2-MoE).

    Args:
        config: HF config (``hidden_size``, ``num_experts_per_tok``).
        num_experts / intermediate_size: expert count and each expert's MLP width.
        renormalize: renormalize the top-k routing weights (see ``select_experts``).
        shared_intermediate_size: width of the shared expert, 0 for none.
        parallel: the rank's groups: with ``parallel.ep`` the experts are placed whole on
            the EP ranks, else every expert is split over the TP ranks (the shared expert is
            always split like a dense MLP).
    """

    def __init__(self, config: Any, num_experts: int, intermediate_size: int, renormalize: bool,
                 shared_intermediate_size: int, parallel: ParallelState) -> None:
        super().__init__()
        tp = parallel.tp
        self.gate = ReplicatedLinear(config.hidden_size, num_experts)
        split = {"ep_group": parallel.ep} if parallel.ep is not None else \
            {"tp_rank": tp.rank, "tp_size": tp.world_size, "tp_group": tp}
        self.experts = FusedMoE(num_experts, config.num_experts_per_tok, config.hidden_size,
                                intermediate_size, renormalize, **split)
        self.shared_expert = self.shared_expert_gate = None
        if shared_intermediate_size:
            self.shared_expert = gated_mlp(config, shared_intermediate_size, parallel)
            self.shared_expert_gate = ReplicatedLinear(config.hidden_size, 1)
        for router in (self.gate, self.shared_expert_gate):
            if router is not None:  # routing stays in the model dtype under --quantization
                router.quantizable = False

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        out = self.experts(hidden, self.gate(hidden))
        if self.shared_expert is not None:
            gate = torch.sigmoid(self.shared_expert_gate(hidden))
            out = out + gate * self.shared_expert(hidden)
        return out


class MoeDecoderLayer(LlamaDecoderLayer):
    """Llama's decoder layer (its ``forward``) around a given MLP module."""

    def __init__(self, config: Any, layer_idx: int, ctx: AttentionContext,
                 rotary_emb: RotaryEmbedding, bias: AttentionBias, qk_norm: bool, mlp: nn.Module,
                 parallel: ParallelState) -> None:
        nn.Module.__init__(self)
        self.self_attn = self.attention_cls(config, layer_idx, ctx, rotary_emb, bias, qk_norm,
                                            parallel)
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class MoeModel(LlamaModel):
    """Llama's model (its ``forward``) with ``make_mlp(layer_idx)`` choosing each layer's MLP
    (layers of ``layer_cls``, constructed as :class:`MoeDecoderLayer`)."""

    def __init__(self, config: Any, ctx: AttentionContext, bias: AttentionBias, qk_norm: bool,
                 make_mlp: Callable[[int], nn.Module], parallel: ParallelState,
                 layer_cls: type[MoeDecoderLayer] = MoeDecoderLayer) -> None:
        nn.Module.__init__(self)
        rotary_emb = make_rotary_embedding(config)
        self._init_stage(config, parallel, lambda i: layer_cls(
            config, i, ctx, rotary_emb, bias, qk_norm, make_mlp(i), parallel))


class SparseMoeForCausalLM(LlamaForCausalLM):
    """Base of the MoE causal LMs: same interface as :class:`LlamaForCausalLM`
    (``forward(input_ids [T], positions [T]) -> [T, H]``, ``compute_logits``, ``load_weights``).

    Subclasses say how to build each layer's MLP (:meth:`make_mlp`), which attention
    projections carry a bias (:meth:`attention_bias_for`), and which checkpoint name fragments
    to rename.

    Raises:
        ValueError: from the constructor when ``hidden_act`` is not SiLU (the fused experts
            compute SwiGLU only).
    """

    checkpoint_renames: ClassVar[dict[str, str]] = {}
    decoder_layer_cls: ClassVar[type[LlamaDecoderLayer]] = MoeDecoderLayer

    def __init__(self, config: Any, ctx: AttentionContext,
                 parallel: ParallelState | None = None) -> None:
        nn.Module.__init__(self)
        require_silu(getattr(config, "hidden_act", None), type(self).__name__)
        self.config = config
        parallel = parallel or ParallelState.single()
        self.model = MoeModel(config, ctx, self.attention_bias_for(config), self.qk_norm,
                              lambda i: self.make_mlp(config, i, parallel), parallel,
                              self.decoder_layer_cls)
        self.lm_head = make_lm_head(config, parallel, self.model.embed_tokens,
                                    getattr(config, "tie_word_embeddings", False))

    def make_mlp(self, config: Any, layer_idx: int, parallel: ParallelState) -> nn.Module:
        """The MLP of layer ``layer_idx``: a :class:`SparseMoeBlock` or, for dense layers, a
        dense MLP; subclasses say which.

        Raises:
            NotImplementedError: here; every subclass overrides it.
        """
        raise NotImplementedError

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HF-named tensors: expert tensors here, everything else through
        :meth:`LlamaForCausalLM.load_weights`. Returns the names of loaded parameters.

        Raises:
            ValueError: for a checkpoint tensor that matches no parameter.
        """
        params = dict(self.named_parameters())
        loaded: set[str] = set()

        def dense_weights() -> Iterator[tuple[str, torch.Tensor]]:
            """Load expert tensors as they stream past; yield every other (renamed) tensor.

            Raises:
                ValueError: for an expert tensor that matches no parameter.
            """
            for stored, tensor in weights:
                name = stored
                for old, new in self.checkpoint_renames.items():
                    name = name.replace(old, new)
                target = _expert_target(name)
                if target is None:
                    yield name, tensor
                    continue
                param_name, shard_id, expert_id = target
                if param_name not in params and is_pp_missing(param_name, self):
                    continue  # a layer of another pipeline stage
                if param_name not in params:
                    raise ValueError(f"checkpoint tensor {name!r} matches no parameter of "
                                     f"{type(self).__name__}")
                param = params[param_name]
                try:
                    param.weight_loader(param, tensor, shard_id, expert_id)
                except ValueError as e:
                    raise ValueError(f"checkpoint tensor {name!r}: {e}") from None
                note_loaded_expert(param, shard_id, expert_id, stored)
                loaded.add(param_name)

        return loaded | super().load_weights(dense_weights())


def _expert_target(name: str) -> tuple[str, str, int | None] | None:
    """(parameter name, shard_id, expert_id) for an expert tensor's checkpoint name, else None."""
    match = _PER_EXPERT.match(name) or _STACKED.match(name)
    if match is None or match["proj"] not in _EXPERT_PROJ:
        return None
    param, shard_id = _EXPERT_PROJ[match["proj"]]
    expert = match.groupdict().get("expert")
    return f"{match['prefix']}.{param}", shard_id, None if expert is None else int(expert)


class MixtralForCausalLM(SparseMoeForCausalLM):
    """Mixtral: every layer is sparse (``num_local_experts`` experts of width
    ``intermediate_size``, top ``num_experts_per_tok``, renormalized), no q/k/v bias, optional
    sliding window. HF stores the block as ``block_sparse_moe``; it is ``mlp`` here."""

    checkpoint_renames: ClassVar[dict[str, str]] = {".block_sparse_moe.": ".mlp."}

    def make_mlp(self, config: Any, layer_idx: int, parallel: ParallelState) -> nn.Module:
        return SparseMoeBlock(config, config.num_local_experts, config.intermediate_size,
                              renormalize=True, shared_intermediate_size=0, parallel=parallel)
