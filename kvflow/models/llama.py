"""The Llama family: Llama 2/3 (and SmolLM2, Mistral-style configs), Qwen2 (q/k/v bias) and
Qwen3 (per-head q/k RMSNorm), written once as tensor- and pipeline-parallel modules.

Weights load through each parameter's ``weight_loader``; ``packed_modules_mapping`` says which
checkpoint tensors are fused into one matmul here (q/k/v -> qkv_proj, gate/up -> gate_up_proj).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from itertools import islice
from typing import Any, ClassVar

import torch
from torch import nn

from kvflow.attention.layer import Attention, AttentionContext
from kvflow.distributed.comm import IntermediateTensors
from kvflow.distributed.parallel_state import ParallelState
from kvflow.layers.activation import gated_activation
from kvflow.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from kvflow.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from kvflow.layers.norm import RMSNorm
from kvflow.layers.rope_parameters import get_rope_parameters, get_rotary_dim, rope_max_positions
from kvflow.layers.rotary import RotaryEmbedding
from kvflow.models.fused_shards import note_loaded_shard
from kvflow.models.hf_config_checks import WINDOWLESS_MODEL_TYPES
from kvflow.models.parallel_utils import PPMissingLayer, is_pp_missing, make_layers


def get_head_dim(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def layer_sliding_window(config: Any, layer_idx: int) -> int | None:
    """The attention window of one layer in tokens, or None for full attention.

    transformers' ``layer_types`` (e.g. Qwen2's ``max_window_layers``) decides per layer when
    present; otherwise a configured ``sliding_window`` applies to every layer unless
    ``use_sliding_window`` is false (Mistral sets the window, Qwen2 the flag). A Llama config
    (``model_type`` ``llama``; also Granite, OLMo 2, GLM: ``WINDOWLESS_MODEL_TYPES``) has no
    window whatever it sets: transformers' Llama attention never reads ``sliding_window``
    (its Mistral does), and kvflow matches its output
    (``kvflow.models.hf_config_checks.unread_field_warnings`` logs the unread field).
    """
    window = getattr(config, "sliding_window", None)
    if not window or getattr(config, "model_type", None) in WINDOWLESS_MODEL_TYPES:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return window if layer_types[layer_idx] == "sliding_attention" else None
    return window if getattr(config, "use_sliding_window", True) else None


def make_rotary_embedding(config: Any, is_neox_style: bool = True) -> RotaryEmbedding:
    """One RoPE table per model (shared by all layers: [max_position, rotary_dim] float32);
    ``is_neox_style`` False rotates adjacent pairs (GPT-J / GLM) instead of the two halves."""
    theta, scaling = get_rope_parameters(config)
    head_dim = get_head_dim(config)
    return RotaryEmbedding(head_dim, rope_max_positions(config), theta, scaling,
                           rotary_dim=get_rotary_dim(config, head_dim),
                           is_neox_style=is_neox_style)


@dataclass(frozen=True)
class AttentionBias:
    """Which attention projections carry a bias. HF's ``attention_bias`` sets all four in
    Llama, Mistral, Qwen3 and Mixtral; Qwen2 and Qwen2-MoE always bias q/k/v and never o_proj."""

    qkv: bool
    o: bool


class LlamaAttention(nn.Module):
    """q/k/v projection (optionally per-head q/k RMSNorm), RoPE, paged attention, o_proj:
    hidden [T, hidden_size] -> [T, hidden_size]. A variant changes the softmax scale through
    :meth:`softmax_scale` (Granite) or replaces ``q_norm`` / ``k_norm`` after construction
    (OLMo 2: one norm over the whole projection); both take q [T, Hq, D], k [T, Hkv, D]."""

    def __init__(self, config: Any, layer_idx: int, ctx: AttentionContext,
                 rotary_emb: RotaryEmbedding, bias: AttentionBias, qk_norm: bool,
                 parallel: ParallelState) -> None:
        super().__init__()
        tp = parallel.tp
        self.head_dim = get_head_dim(config)
        num_kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim,
                                          config.num_attention_heads, num_kv_heads, bias.qkv,
                                          tp.rank, tp.world_size)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim,
                                        config.hidden_size, bias.o, tp.rank, tp.world_size,
                                        tp_group=tp)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.rotary_emb = rotary_emb
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim,
                              self.softmax_scale(config, self.head_dim), ctx,
                              sliding_window=layer_sliding_window(config, layer_idx))

    @staticmethod
    def softmax_scale(config: Any, head_dim: int) -> float:
        """The factor on q.k before the softmax: ``head_dim ** -0.5`` (Vaswani et al. 2017)."""
        return head_dim ** -0.5

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        # split_with_sizes: Tensor.split's Python wrapper costs ~2 us more per call
        q, k, v = qkv.split_with_sizes([q_size, kv_size, kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        out = self.attn.forward_rotary(positions, q, k, v, self.rotary_emb)
        return self.o_proj(out.reshape(num_tokens, q_size))


class LlamaMLP(nn.Module):
    """Gated MLP ``down(act(gate(x)) * up(x))``: [T, hidden] -> [T, hidden]; ``act`` is the
    config's ``hidden_act`` (SiLU, or GELU; see :func:`~kvflow.layers.activation.gated_activation`).

    Raises:
        ValueError: from the constructor for an activation kvflow does not run.
    """

    def __init__(self, config: Any, parallel: ParallelState) -> None:
        super().__init__()
        tp = parallel.tp
        bias = getattr(config, "mlp_bias", False)
        inter = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [inter, inter], bias,
                                                       tp.rank, tp.world_size)
        self.down_proj = RowParallelLinear(inter, config.hidden_size, bias, tp.rank,
                                           tp.world_size, tp_group=tp)
        self.act_fn = gated_activation(getattr(config, "hidden_act", None))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm layer with the residual add fused into the norms: ``forward(positions,
    hidden, residual) -> (hidden, residual)``, [T, hidden_size] each, where the layer's input
    is ``hidden + residual`` (``hidden`` alone when ``residual`` is None, the first layer) and
    so is its output. Variants subclass it with another ``attention_cls``, what the attention
    and the MLP add (``attention_output``, ``mlp_output``) or ``forward``."""

    attention_cls: ClassVar[type[LlamaAttention]] = LlamaAttention

    def __init__(self, config: Any, layer_idx: int, ctx: AttentionContext,
                 rotary_emb: RotaryEmbedding, bias: AttentionBias, qk_norm: bool,
                 parallel: ParallelState) -> None:
        super().__init__()
        self.self_attn = self.attention_cls(config, layer_idx, ctx, rotary_emb, bias, qk_norm,
                                            parallel)
        self.mlp = LlamaMLP(config, parallel)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.attention_output(positions, hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp_output(hidden), residual

    def attention_output(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """What the attention adds to the residual: [T, hidden_size] -> [T, hidden_size]
        (variants scale or normalize it here)."""
        return self.self_attn(positions, hidden)

    def mlp_output(self, hidden: torch.Tensor) -> torch.Tensor:
        """What the MLP adds to the residual: [T, hidden_size] -> [T, hidden_size]."""
        return self.mlp(hidden)


class LlamaModel(nn.Module):
    """The decoder stack of one pipeline stage: the embedding on the first stage, layers
    ``[start_layer, end_layer)`` (``layer_cls``, constructed as :class:`LlamaDecoderLayer`),
    the final norm on the last stage. ``embed_scale`` (None: none) multiplies the embeddings,
    prompt embeddings included (Granite's ``embedding_multiplier``).

    ``aux_hidden_state_layers`` (vLLM's name; empty by default, then ``forward`` runs its plain
    loop): layer ids whose input residual stream ``hidden + residual`` (transformers'
    ``output_hidden_states[i]``) ``forward`` also returns, for an EAGLE-3 head
    (``spec_decode/layer_taps.py``). Returned by the forward, not read by hooks, so a replayed
    CUDA graph or CPU step graph produces them too (``worker/step_graphs.py``)."""

    embed_scale: float | None = None
    aux_hidden_state_layers: tuple[int, ...] = ()

    def __init__(self, config: Any, ctx: AttentionContext, bias: AttentionBias, qk_norm: bool,
                 parallel: ParallelState, rotary_emb: RotaryEmbedding | None = None,
                 layer_cls: type[LlamaDecoderLayer] = LlamaDecoderLayer) -> None:
        super().__init__()
        rotary_emb = rotary_emb or make_rotary_embedding(config)
        self._init_stage(config, parallel, lambda i: layer_cls(
            config, i, ctx, rotary_emb, bias, qk_norm, parallel))

    def _init_stage(self, config: Any, parallel: ParallelState, build_layer) -> None:
        """Embedding (first stage), this stage's layers, final norm (last stage)."""
        tp, pp = parallel.tp, parallel.pp
        self.is_first_stage, self.is_last_stage = pp.is_first_rank, pp.is_last_rank
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, tp.rank, tp.world_size,
            tp_group=tp) \
            if self.is_first_stage else PPMissingLayer()
        self.start_layer, self.end_layer, self.layers = make_layers(
            config.num_hidden_layers, pp, build_layer)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps) \
            if self.is_last_stage else PPMissingLayer()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate_tensors: IntermediateTensors | None = None,
                inputs_embeds: torch.Tensor | None = None
                ) -> torch.Tensor | IntermediateTensors:
        """input_ids / positions [T] int64 -> final hidden [T, hidden] (last stage), else
        ``{"hidden_states", "residual"}`` [T, hidden] each for the next stage; a stage after
        the first reads those from ``intermediate_tensors`` instead of embedding
        ``input_ids``. ``inputs_embeds`` [T, hidden], when given, replaces the embedding of
        ``input_ids`` (vision-language models: image embeddings merged at the placeholders);
        positions are [3, T] for M-RoPE models. With ``aux_hidden_state_layers`` set the last
        stage returns ``(hidden, [T, hidden] per tapped layer)`` instead."""
        if self.is_first_stage:
            hidden = inputs_embeds if inputs_embeds is not None else \
                self.embed_tokens(input_ids)
            if self.embed_scale is not None:
                hidden = hidden * self.embed_scale
            residual = None
        else:
            hidden = intermediate_tensors["hidden_states"]
            residual = intermediate_tensors["residual"]
        if self.aux_hidden_state_layers and self.is_last_stage:
            return self._forward_tapped(positions, hidden, residual)
        for layer in islice(self.layers, self.start_layer, self.end_layer):
            hidden, residual = layer(positions, hidden, residual)
        if not self.is_last_stage:
            return {"hidden_states": hidden, "residual": residual}
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def _forward_tapped(self, positions: torch.Tensor, hidden: torch.Tensor,
                        residual: torch.Tensor | None
                        ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The layer loop of the last stage keeping the residual stream entering each layer of
        ``aux_hidden_state_layers``: (final hidden [T, H], [T, H] per listed layer id, in
        that order; a layer listed twice gives the same tensor)."""
        wanted, taps = set(self.aux_hidden_state_layers), {}
        for i in range(self.start_layer, self.end_layer):
            if i in wanted:
                taps[i] = self._residual_stream(hidden, residual)
            hidden, residual = self.layers[i](positions, hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden, [taps[i] for i in self.aux_hidden_state_layers]

    def _residual_stream(self, hidden: torch.Tensor, residual: torch.Tensor | None
                         ) -> torch.Tensor:
        """``hidden + residual`` [T, H] (``hidden`` when ``residual`` is None) as a tensor no
        later layer writes: on CPU the native fused add-norm's sum (one C call a CPU step
        graph records; its norm output is dropped), elsewhere a torch add, or a copy of the
        first layer's input (the CUDA fused add-norm updates its residual in place)."""
        if hidden.device.type != "cpu":
            return hidden.clone() if residual is None else hidden + residual
        fused = getattr(self.norm, "forward_cpu", None)
        if residual is None or fused is None:
            return hidden if residual is None else hidden + residual
        return fused(hidden, residual)[1]


class LlamaForCausalLM(nn.Module):
    """Causal LM: ``forward(input_ids [T], positions [T]) -> hidden [T, hidden_size]`` and
    ``compute_logits(hidden [N, hidden_size]) -> [N, vocab_size]`` float32 (``head``: another
    LM head's rows instead of ``lm_head``'s, e.g. a draft's head cut to a token subset).

    With pipeline parallelism a stage holds only its layers (the others are
    :class:`~kvflow.models.parallel_utils.PPMissingLayer`), ``forward`` also takes and returns
    :data:`~kvflow.distributed.comm.IntermediateTensors`, and only the last stage has the LM
    head (its own copy of a tied embedding when the embedding lives on the first stage).

    Prompts given as embeddings (``enable_prompt_embeds``): the runner embeds the step's
    tokens with ``embed_input_ids``, writes the prompt rows over them and passes the result
    as ``forward(..., inputs_embeds=[T, hidden])`` (``supports_prompt_embeds``).

    Args:
        config: an HF config (LlamaConfig, Qwen2Config, ...).
        ctx: the engine's attention context (backend + forward context).
        parallel: this rank's process groups (default: one process).
    """

    qk_norm: bool = False
    decoder_layer_cls: ClassVar[type[LlamaDecoderLayer]] = LlamaDecoderLayer
    # linear layers a LoRA adapter may adapt (kvflow/lora; their q/k/v and gate/up parts too)
    supported_lora_modules: ClassVar[tuple[str, ...]] = ("qkv_proj", "o_proj", "gate_up_proj",
                                                         "down_proj")
    packed_modules_mapping: ClassVar[dict[str, tuple[str, Any]]] = {
        "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: Any, ctx: AttentionContext,
                 parallel: ParallelState | None = None) -> None:
        super().__init__()
        self.config = config
        parallel = parallel or ParallelState.single()
        self.model = LlamaModel(config, ctx, self.attention_bias_for(config), self.qk_norm,
                                parallel, self.rotary_embedding_for(config),
                                self.decoder_layer_cls)
        self.lm_head = make_lm_head(config, parallel, self.model.embed_tokens,
                                    getattr(config, "tie_word_embeddings", False))

    @classmethod
    def rotary_embedding_for(cls, config: Any) -> RotaryEmbedding:
        """The model's RoPE (one table shared by all layers)."""
        return make_rotary_embedding(config)

    @classmethod
    def attention_bias_for(cls, config: Any) -> AttentionBias:
        """Llama, Mistral, Qwen3: the config's ``attention_bias`` on all four projections."""
        bias = bool(getattr(config, "attention_bias", False))
        return AttentionBias(qkv=bias, o=bias)

    supports_prompt_embeds = True

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate_tensors: IntermediateTensors | None = None,
                inputs_embeds: torch.Tensor | None = None
                ) -> torch.Tensor | IntermediateTensors:
        return self.model(input_ids, positions, intermediate_tensors, inputs_embeds)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """int64 [T] -> [T, hidden] in the model's dtype: the embedding lookup (first
        pipeline stage only)."""
        return self.model.embed_tokens(input_ids)

    def compute_logits(self, hidden: torch.Tensor,
                       head: ParallelLMHead | None = None) -> torch.Tensor:
        return (head or self.lm_head).compute_logits(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HF-named tensors; returns the names of parameters that were loaded. Tensors of
        modules another pipeline stage owns are skipped.

        Raises:
            ValueError: for a checkpoint tensor that matches no parameter, or whose shape does
                not fit it (naming the tensor); for a tied model whose checkpoint holds an
                ``lm_head.weight`` other than its embedding (see :func:`check_tied_head`).
        """
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        tied = getattr(self.config, "tie_word_embeddings", False)
        tables: dict[str, torch.Tensor] = {}  # a tied model's two checkpoint tables
        for name, tensor in weights:
            if tied and name in ("lm_head.weight", "model.embed_tokens.weight"):
                tables[name] = tensor
            if "rotary_emb.inv_freq" in name or (tied and name.startswith("lm_head.")):
                continue
            if tied and name == "model.embed_tokens.weight" and \
                    isinstance(self.model.embed_tokens, PPMissingLayer):
                name = "lm_head.weight"  # the last stage's own copy of the tied embedding
            target, shard = map_packed(name, self.packed_modules_mapping)
            if target not in params and is_pp_missing(target, self):
                continue
            if target not in params:
                raise ValueError(f"checkpoint tensor {name!r} matches no parameter of "
                                 f"{type(self).__name__}")
            load_tensor(params[target], name, tensor, shard)
            loaded.add(target)
        if tied and "model.embed_tokens.weight" in loaded:
            loaded.add("lm_head.weight")
        check_tied_head(tables)
        return loaded


def check_tied_head(tables: dict[str, torch.Tensor]) -> None:
    """A model whose config ties the LM head to the embedding (``tie_word_embeddings``) may
    still store ``lm_head.weight``: transformers then ties the two only when the tensors are
    equal, and otherwise keeps them apart and computes logits with the stored head. kvflow's
    tied head reads the embedding, so a different stored head is refused rather than ignored.

    Args:
        tables: the checkpoint's ``lm_head.weight`` and ``model.embed_tokens.weight``, those
            present (in the model dtype).

    Raises:
        ValueError: when both are present and differ.
    """
    head, embed = tables.get("lm_head.weight"), tables.get("model.embed_tokens.weight")
    if head is None or embed is None or torch.equal(head, embed):
        return
    raise ValueError("config.json sets tie_word_embeddings=true, but the checkpoint's "
                     "lm_head.weight differs from model.embed_tokens.weight; transformers "
                     "then computes the logits with lm_head.weight, untied. Set "
                     '"tie_word_embeddings": false in config.json to load that head')


def make_lm_head(config: Any, parallel: ParallelState, embed_tokens: nn.Module,
                 tied: bool) -> nn.Module:
    """The LM head of the last pipeline stage (a placeholder elsewhere). A tied head shares
    ``embed_tokens``' weight when the embedding lives on the same stage; on a last stage
    without the embedding it holds its own copy, loaded from the embedding's tensor."""
    if not parallel.pp.is_last_rank:
        return PPMissingLayer()
    tp = parallel.tp
    head = ParallelLMHead(config.vocab_size, config.hidden_size, tp.rank, tp.world_size,
                          tp_group=tp)
    if tied and not isinstance(embed_tokens, PPMissingLayer):
        head.weight = embed_tokens.weight
    return head


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    """Plain copy, for parameters that are never sharded (norms).

    Raises:
        ValueError: when ``loaded`` and ``param`` differ in shape.
    """
    if param.shape != loaded.shape:
        raise ValueError(f"weight shape {tuple(loaded.shape)} does not match parameter shape "
                         f"{tuple(param.shape)}")
    param.data.copy_(loaded)


def load_tensor(param: nn.Parameter, name: str, tensor: torch.Tensor, shard: Any = None) -> None:
    """Load checkpoint tensor ``name`` into ``param`` through the parameter's
    ``weight_loader`` (:func:`default_weight_loader` without one), passing ``shard`` (the
    part of a fused parameter it fills: "q", 0, ...) unless it is None, and records the part as
    loaded (:func:`~kvflow.models.fused_shards.note_loaded_shard`).

    Raises:
        ValueError: naming the tensor, when the loader refuses it (a shape that does not fit).
    """
    loader = getattr(param, "weight_loader", default_weight_loader)
    try:
        loader(param, tensor, *(() if shard is None else (shard,)))
    except ValueError as e:
        raise ValueError(f"checkpoint tensor {name!r}: {e}") from None
    note_loaded_shard(param, shard)


def map_packed(name: str, mapping: dict[str, tuple[str, Any]]) -> tuple[str, Any]:
    """Checkpoint tensor ``name`` renamed onto the fused parameter it is part of, and its shard
    (``mapping``: checkpoint module -> (fused module, shard), as ``packed_modules_mapping``);
    ``(name, None)`` for a tensor of no fused parameter."""
    for src, (dst, shard) in mapping.items():
        if f".{src}." in name:
            return name.replace(f".{src}.", f".{dst}."), shard
    return name, None


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2 / Qwen2.5: Llama with biases on q, k and v (never on o_proj)."""

    @classmethod
    def attention_bias_for(cls, config: Any) -> AttentionBias:
        return AttentionBias(qkv=True, o=False)


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3: Llama with RMSNorm on each head of q and k before RoPE, no q/k/v bias."""

    qk_norm = True
