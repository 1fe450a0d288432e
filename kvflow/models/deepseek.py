"""DeepSeek-V2 (arXiv:2405.04434) and DeepSeek-V3 (arXiv:2412.19437): multi-head latent
attention (MLA) and DeepSeekMoE, on the Llama decoder's layer and model ``forward``s.

Attention (``DeepseekV2Attention``): queries come from ``q_proj``, or through a low-rank
``q_a_proj -> q_a_layernorm -> q_b_proj`` when ``q_lora_rank`` is set; ``kv_a_proj_with_mqa``
gives each token its KV latent (``kv_lora_rank``, RMS-normalized by ``kv_a_layernorm``) and one
RoPE key (``qk_rope_head_dim``) shared by all heads; ``kv_b_proj`` would expand the latent into
per-head no-RoPE keys (``qk_nope_head_dim``) and values (``v_head_dim``). kvflow runs the
absorbed form (:mod:`kvflow.attention.mla`): ``kv_b_proj``'s key half is folded into the queries,
its value half applied after attention, and the paged cache holds only
``[latent | rope key]`` per token. RoPE is applied to the ``qk_rope_head_dim`` parts only, in
DeepSeek's interleaved-pair layout (V3 with ``rope_interleave: false``: the two-halves layout),
and YaRN's ``mscale_all_dim`` also multiplies the softmax scale by its square, as transformers
does (``yarn_apply_mscale``).

MLP: the first ``first_k_dense_replace`` layers are dense SwiGLU MLPs (``intermediate_size``),
the others (every ``moe_layer_freq``-th by DeepSeek's code, all by transformers'; kvflow follows
the checkpoint, see :func:`is_moe_layer`) DeepSeekMoE: ``n_routed_experts`` routed experts of
width ``moe_intermediate_size`` chosen by :class:`~kvflow.layers.moe.GroupedTopKRouting` from
an fp32 router, plus ``n_shared_experts`` always-on experts fused into one MLP of width
``n_shared_experts x moe_intermediate_size``. V2 scores with a softmax (``topk_method``
greedy or group_limited_greedy); V3 with a sigmoid and ``noaux_tc``. V2's weights are scaled by
``routed_scaling_factor`` unless ``norm_topk_prob`` renormalizes them instead, which DeepSeek's
V2 code does only for top-k above 1 (transformers 5 ignores ``norm_topk_prob`` for V2, which
every published V2 config sets false); V3 renormalizes when ``norm_topk_prob`` and always
scales.

Checkpoints: HF names (``self_attn.kv_b_proj.weight``, ``mlp.gate.weight``,
``mlp.gate.e_score_correction_bias``, per-expert or stacked expert tensors,
``mlp.shared_experts.*``); V3's multi-token-prediction layers (``model.layers.{N}`` for
``N >= num_hidden_layers``) are skipped. The router weight and correction bias stay fp32.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from kvflow.attention.layer import AttentionContext
from kvflow.attention.mla import MLAAttention
from kvflow.distributed.parallel_state import ParallelState
from kvflow.layers.activation import require_silu
from kvflow.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from kvflow.layers.moe import FusedMoE, GroupedTopKRouting
from kvflow.layers.norm import RMSNorm
from kvflow.layers.rope_parameters import get_rope_parameters, rope_max_positions
from kvflow.layers.rotary import RotaryEmbedding, yarn_mscale
from kvflow.models.llama import LlamaDecoderLayer, LlamaModel, make_lm_head
from kvflow.models.mixtral import SparseMoeForCausalLM, gated_mlp

LATENT_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm: DeepSeek's default, not rms_norm_eps


def mla_softmax_scale(config: Any) -> float:
    """``(qk_nope_head_dim + qk_rope_head_dim) ** -0.5``, times ``yarn_mscale(factor,
    mscale_all_dim) ** 2`` when a scaled RoPE sets ``mscale_all_dim`` (DeepSeek's YaRN)."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    _, scaling = get_rope_parameters(config)
    if scaling and scaling.get("mscale_all_dim"):
        scale *= yarn_mscale(scaling["factor"], scaling["mscale_all_dim"]) ** 2
    return scale


class KVBProjection(nn.Module):
    """``kv_b_proj``: the latent's up-projection [heads x (qk_nope + v), kv_lora_rank], split by
    heads over TP ranks. MLA absorbs it, so it is never a GEMM over the cache: ``w_uk`` /
    ``w_uv`` are views of the weight for the absorbed products (and it is not packed)."""

    def __init__(self, kv_lora_rank: int, num_heads: int, qk_nope_head_dim: int,
                 v_head_dim: int, tp_rank: int, tp_size: int) -> None:
        super().__init__()
        self.num_heads, self.tp_rank, self.tp_size = num_heads // tp_size, tp_rank, tp_size
        self.qk_nope_head_dim, self.v_head_dim = qk_nope_head_dim, v_head_dim
        rows = self.num_heads * (qk_nope_head_dim + v_head_dim)
        self.weight = nn.Parameter(torch.empty(rows, kv_lora_rank), requires_grad=False)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        """Copy this rank's heads (a contiguous run of rows) of the full checkpoint tensor.

        Raises:
            ValueError: when ``loaded`` is not [heads x (qk_nope_head_dim + v_head_dim),
                kv_lora_rank] as the config gives it.
        """
        rows = param.shape[0]
        expected = (rows * self.tp_size, param.shape[1])
        if tuple(loaded.shape) != expected:
            raise ValueError(f"shape {tuple(loaded.shape)}: the config gives [num_attention_heads"
                             f" x (qk_nope_head_dim + v_head_dim), kv_lora_rank] = "
                             f"{list(expected)}")
        param.data.copy_(loaded.narrow(0, self.tp_rank * rows, rows))

    def _per_head(self) -> torch.Tensor:
        return self.weight.view(self.num_heads, self.qk_nope_head_dim + self.v_head_dim, -1)

    def w_uk(self) -> torch.Tensor:
        """[H, qk_nope_head_dim, kv_lora_rank]: head h's no-RoPE key is ``latent @ w_uk[h].T``."""
        return self._per_head()[:, :self.qk_nope_head_dim]

    def w_uv(self) -> torch.Tensor:
        """[H, v_head_dim, kv_lora_rank]: head h's value is ``latent @ w_uv[h].T``."""
        return self._per_head()[:, self.qk_nope_head_dim:]


class DeepseekV2Attention(nn.Module):
    """MLA, absorbed: ``forward(positions [T], hidden [T, H]) -> [T, H]``. Tensor parallelism
    splits the heads (q / kv_b / o projections); every rank computes and caches the whole
    latent, which all heads share.

    Raises:
        ValueError: if the heads do not divide over the TP ranks.
    """

    def __init__(self, config: Any, ctx: AttentionContext, rotary_emb: RotaryEmbedding,
                 parallel: ParallelState) -> None:
        super().__init__()
        tp = parallel.tp
        tp_rank, tp_size = tp.rank, tp.world_size
        heads, hidden = config.num_attention_heads, config.hidden_size
        if heads % tp_size:
            raise ValueError(f"{heads} attention heads cannot be split over tp_size {tp_size}")
        self.num_heads = heads // tp_size
        self.nope, self.rope = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.kv_lora_rank, self.v_head_dim = config.kv_lora_rank, config.v_head_dim
        bias = bool(getattr(config, "attention_bias", False))
        q_out = heads * (self.nope + self.rope)
        self.q_lora_rank = getattr(config, "q_lora_rank", None)
        if self.q_lora_rank:
            self.q_a_proj = ReplicatedLinear(hidden, self.q_lora_rank, bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = ColumnParallelLinear(self.q_lora_rank, q_out, False, tp_rank, tp_size)
        else:
            self.q_proj = ColumnParallelLinear(hidden, q_out, False, tp_rank, tp_size)
        self.kv_a_proj_with_mqa = ReplicatedLinear(hidden, self.kv_lora_rank + self.rope, bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = KVBProjection(self.kv_lora_rank, heads, self.nope, self.v_head_dim,
                                       tp_rank, tp_size)
        self.o_proj = RowParallelLinear(heads * self.v_head_dim, hidden, bias, tp_rank, tp_size,
                                        tp_group=tp)
        self.rotary_emb = rotary_emb
        self.attn = MLAAttention(self.num_heads, self.kv_lora_rank, self.rope,
                                 mla_softmax_scale(config), ctx)

    def _queries(self, hidden: torch.Tensor) -> torch.Tensor:
        """[T, heads, qk_nope + qk_rope]."""
        if self.q_lora_rank:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        else:
            q = self.q_proj(hidden)
        return q.view(hidden.shape[0], self.num_heads, self.nope + self.rope)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        q_nope, q_rope = self._queries(hidden).split([self.nope, self.rope], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(hidden).split([self.kv_lora_rank, self.rope],
                                                               dim=-1)
        latent = self.kv_a_layernorm(latent.contiguous())
        q_rope, k_rope = self.rotary_emb(positions, q_rope.contiguous(),
                                         k_rope.reshape(num_tokens, 1, self.rope))
        # q_nope . (latent @ W_UK[h].T) == (q_nope @ W_UK[h]) . latent: absorb W_UK into q.
        q_latent = torch.bmm(q_nope.transpose(0, 1), self.kv_b_proj.w_uk())  # [heads, T, rank]
        q = torch.cat([q_latent.transpose(0, 1), q_rope], dim=-1)
        kv_c = torch.cat([latent, k_rope.view(num_tokens, self.rope)], dim=-1)
        attended = self.attn(q, kv_c)  # [T, heads, kv_lora_rank]
        out = torch.bmm(attended.transpose(0, 1), self.kv_b_proj.w_uv().transpose(1, 2))
        return self.o_proj(out.transpose(0, 1).reshape(num_tokens, -1))


class RouterGate(nn.Module):
    """The MoE router, in fp32 as DeepSeek and transformers run it: ``forward(hidden [T, H])
    -> logits [T, E] float32``."""

    def __init__(self, hidden_size: int, num_experts: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=torch.float32),
                                   requires_grad=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden.float(), self.weight)


class DeepseekMoE(nn.Module):
    """Routed experts (:class:`FusedMoE` with DeepSeek's routing) plus the shared experts:
    ``forward(hidden [T, H]) -> [T, H]``. With ``parallel.ep`` the routed experts are placed
    whole on the EP ranks, else split over the TP ranks; the shared experts are split like a
    dense MLP."""

    def __init__(self, config: Any, routing: GroupedTopKRouting,
                 parallel: ParallelState) -> None:
        super().__init__()
        tp = parallel.tp
        num_experts, width = config.n_routed_experts, config.moe_intermediate_size
        self.gate = RouterGate(config.hidden_size, num_experts)
        split = {"ep_group": parallel.ep} if parallel.ep is not None else \
            {"tp_rank": tp.rank, "tp_size": tp.world_size, "tp_group": tp}
        self.experts = FusedMoE(num_experts, routing.top_k, config.hidden_size, width,
                                routing.renormalize, routing=routing, **split)
        shared = getattr(config, "n_shared_experts", None) or 0
        self.shared_experts = gated_mlp(config, width * shared, parallel) if shared else None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        out = self.experts(hidden, self.gate(hidden))
        if self.shared_experts is not None:
            out = out + self.shared_experts(hidden)
        return out


def is_moe_layer(config: Any, layer_idx: int) -> bool:
    """Whether decoder layer ``layer_idx`` has a DeepSeekMoE MLP: as the checkpoint holds it
    when :meth:`DeepseekV2ForCausalLM.adapt_config_to_checkpoint` recorded its layout
    (``config.kvflow_moe_layers``), else DeepSeek's rule: MoE from layer
    ``first_k_dense_replace`` on, every ``moe_layer_freq``-th."""
    layout = getattr(config, "kvflow_moe_layers", None)
    if layout is not None and layer_idx in layout:
        return layout[layer_idx]
    return (bool(getattr(config, "n_routed_experts", None))
            and layer_idx >= (getattr(config, "first_k_dense_replace", None) or 0)
            and layer_idx % (getattr(config, "moe_layer_freq", None) or 1) == 0)


class DeepseekDecoderLayer(LlamaDecoderLayer):
    """Llama's decoder layer (its ``forward``) around MLA and a dense or MoE MLP."""

    def __init__(self, config: Any, layer_idx: int, ctx: AttentionContext,
                 rotary_emb: RotaryEmbedding, routing: GroupedTopKRouting,
                 parallel: ParallelState) -> None:
        nn.Module.__init__(self)
        self.self_attn = DeepseekV2Attention(config, ctx, rotary_emb, parallel)
        self.mlp = DeepseekMoE(config, routing, parallel) if is_moe_layer(config, layer_idx) \
            else gated_mlp(config, config.intermediate_size, parallel)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class DeepseekModel(LlamaModel):
    """Llama's model (its ``forward`` and pipeline stages) over DeepSeek decoder layers."""

    def __init__(self, config: Any, ctx: AttentionContext, rotary_emb: RotaryEmbedding,
                 routing: GroupedTopKRouting, parallel: ParallelState) -> None:
        nn.Module.__init__(self)
        self._init_stage(config, parallel, lambda i: DeepseekDecoderLayer(
            config, i, ctx, rotary_emb, routing, parallel))


class DeepseekV2ForCausalLM(SparseMoeForCausalLM):
    """DeepSeek-V2 / V2-Lite / V2.5: MLA + DeepSeekMoE with softmax routing. Same interface as
    :class:`~kvflow.models.llama.LlamaForCausalLM`; ``uses_mla`` makes the engine give it an
    MLA attention backend and latent KV-cache specs.

    Raises:
        ValueError: from the constructor when ``hidden_act`` is not SiLU (the fused experts
            compute SwiGLU only).
    """

    uses_mla: ClassVar[bool] = True
    rope_interleaved_default: ClassVar[bool] = True
    # LoRA: MLA's query and latent projections and o_proj, the dense and shared-expert MLPs;
    # not kv_b_proj (absorbed into the queries and the output, never run as a matmul)
    supported_lora_modules: ClassVar[tuple[str, ...]] = (
        "q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj", "gate_up_proj",
        "down_proj")
    packed_modules_mapping: ClassVar[dict[str, tuple[str, Any]]] = {
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
    checkpoint_renames: ClassVar[dict[str, str]] = {
        ".mlp.gate.e_score_correction_bias": ".mlp.experts.e_score_correction_bias"}
    keep_in_fp32: ClassVar[tuple[str, ...]] = (".mlp.gate.weight", "e_score_correction_bias")

    def __init__(self, config: Any, ctx: AttentionContext,
                 parallel: ParallelState | None = None) -> None:
        nn.Module.__init__(self)
        require_silu(getattr(config, "hidden_act", None), type(self).__name__)
        self.config = config
        parallel = parallel or ParallelState.single()
        self.model = DeepseekModel(config, ctx, self.make_rotary(config),
                                   self.routing_for(config), parallel)
        self.lm_head = make_lm_head(config, parallel, self.model.embed_tokens,
                                    getattr(config, "tie_word_embeddings", False))

    @classmethod
    def make_rotary(cls, config: Any) -> RotaryEmbedding:
        """RoPE over the ``qk_rope_head_dim`` parts, interleaved pairs unless the config's
        ``rope_interleave`` is false (one table shared by all layers)."""
        theta, scaling = get_rope_parameters(config)
        interleaved = getattr(config, "rope_interleave", cls.rope_interleaved_default)
        dim = config.qk_rope_head_dim
        return RotaryEmbedding(dim, rope_max_positions(config), theta, scaling, rotary_dim=dim,
                               is_neox_style=not interleaved)

    @classmethod
    def routing_for(cls, config: Any) -> GroupedTopKRouting:
        """V2: softmax scores, ``topk_method`` greedy or group_limited_greedy; the weights
        renormalized when ``norm_topk_prob`` and ``num_experts_per_tok > 1``, else scaled by
        ``routed_scaling_factor`` (DeepSeek's V2 gate: a single expert keeps its probability
        times the factor, as transformers computes it too)."""
        renormalize = bool(getattr(config, "norm_topk_prob", False)) \
            and config.num_experts_per_tok > 1
        return GroupedTopKRouting(
            config.num_experts_per_tok, getattr(config, "scoring_func", None) or "softmax",
            getattr(config, "topk_method", None) or "greedy",
            getattr(config, "n_group", None) or 1, getattr(config, "topk_group", None) or 1,
            renormalize, 1.0 if renormalize else float(config.routed_scaling_factor))

    @classmethod
    def adapt_config_to_checkpoint(cls, config: Any, tensor_names: Iterable[str]) -> None:
        """Record which decoder layers the checkpoint holds as MoE (``mlp.experts`` /
        ``mlp.gate`` tensors) and which as dense MLPs (``mlp.gate_proj`` ...) in
        ``config.kvflow_moe_layers`` ({layer index: is MoE}), for :func:`is_moe_layer`.

        DeepSeek's own code makes a layer MoE from ``first_k_dense_replace`` on only every
        ``moe_layer_freq``-th layer; transformers ignores ``moe_layer_freq`` (every layer from
        ``first_k_dense_replace`` on is MoE), so with ``moe_layer_freq != 1`` the two save
        different layouts from one config. Following the checkpoint loads either, and computes
        what the code that wrote it computes."""
        layout: dict[int, bool] = {}
        for name in tensor_names:
            parts = name.split(".")
            if parts[:2] != ["model", "layers"] or len(parts) < 5 or parts[3] != "mlp":
                continue
            moe = parts[4] in ("experts", "gate", "shared_experts")
            if moe or parts[4] in ("gate_proj", "up_proj", "down_proj"):
                layout[int(parts[2])] = layout.get(int(parts[2]), False) or moe
        config.kvflow_moe_layers = layout

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HF-named tensors, skipping multi-token-prediction layers (indices at or past
        ``num_hidden_layers``) and, with ``n_shared_experts`` 0, the empty shared-expert
        tensors transformers and DeepSeek's code save for a shared MLP of width 0 (it adds
        nothing; kvflow builds none). Returns the names of loaded parameters.

        Raises:
            ValueError: for a checkpoint tensor that matches no parameter.
        """
        num_layers = self.config.num_hidden_layers
        no_shared = not (getattr(self.config, "n_shared_experts", None) or 0)

        def decoder_weights() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                parts = name.split(".")
                if parts[:2] == ["model", "layers"] and int(parts[2]) >= num_layers:
                    continue
                if no_shared and ".mlp.shared_experts." in name and tensor.numel() == 0:
                    continue
                yield name, tensor

        return super().load_weights(decoder_weights())


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """DeepSeek-V3 / R1 (and Kimi-K2-style configs): V2's MLA with sigmoid "noaux_tc"
    routing (per-expert correction bias), weights renormalized when ``norm_topk_prob`` and
    always scaled by ``routed_scaling_factor``; ``rope_interleave`` chooses the RoPE layout."""

    @classmethod
    def routing_for(cls, config: Any) -> GroupedTopKRouting:
        return GroupedTopKRouting(
            config.num_experts_per_tok, getattr(config, "scoring_func", None) or "sigmoid",
            getattr(config, "topk_method", None) or "noaux_tc",
            getattr(config, "n_group", None) or 1, getattr(config, "topk_group", None) or 1,
            bool(getattr(config, "norm_topk_prob", True)),
            float(config.routed_scaling_factor))
