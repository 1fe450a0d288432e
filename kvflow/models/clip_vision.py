"""CLIP's and SigLIP's vision transformers as LLaVA-style models use them (plain torch).

CLIP ViT (Radford et al. 2021, arXiv:2103.00020): the image is cut into ``patch_size``
squares, each embedded linearly (a convolution without bias, stride = kernel = patch); a
learned class embedding is prepended, learned absolute position embeddings are added, a
LayerNorm (``pre_layrnorm``, the checkpoint's spelling) runs before the stack of pre-norm
transformer layers (multi-head self-attention over all tokens, no mask; an MLP with
``quick_gelu``). SigLIP (Zhai et al. 2023, arXiv:2303.15343) is the same stack without the
class token and the pre-LayerNorm, its patch embedding with a bias.

A vision-language model reads the hidden states after some layer (``vision_feature_layer``:
``k >= 0`` counts layers, the embeddings being 0; negative counts from the end, ``-1`` the
last layer's output), or after each of a list of layers, concatenated along the hidden size
in the list's order (transformers' ``LlavaModel.get_image_features``), so only the layers up
to the last one read are built, and the final LayerNorm is never applied. The modules keep transformers' names (``embeddings.*``, ``pre_layrnorm.*``,
``encoder.layers.N.self_attn.q_proj.*``, ...; older checkpoints put them under
``vision_model.``, which the model's loader strips); checkpoint tensors of
the layers past the feature layer, of ``post_layernorm`` and of SigLIP's pooling ``head``
are not needed (:meth:`VisionTower.needs`).

Input: each image already cut into patches by the API side, one row per patch in row-major
patch order, each row the patch's pixels in (channel, row, column) order, the layout of the
convolution's weight, so the patch embedding is one matrix product.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvflow.models.qwen2_vl_vision import VisionMLP

# vision config ``model_type`` -> whether it has a class token + pre-LayerNorm (CLIP) or not
VISION_MODEL_TYPES = {"clip_vision_model": True, "siglip_vision_model": False}


def _field(config: Any, name: str, default: Any = None) -> Any:
    if isinstance(config, dict):
        return config.get(name, default)
    return getattr(config, name, default)


def vision_layers_needed(num_layers: int, feature_layer: int) -> int:
    """Layers to run so that hidden state ``feature_layer`` exists (transformers'
    ``hidden_states[feature_layer]`` of a ``num_layers``-layer encoder, whose entry 0 is the
    embeddings).

    Raises:
        ValueError: for an index outside ``[-(num_layers + 1), num_layers]``.
    """
    if not -(num_layers + 1) <= feature_layer <= num_layers:
        raise ValueError(f"vision_feature_layer {feature_layer} is outside the vision "
                         f"encoder's {num_layers} layers (-{num_layers + 1} .. {num_layers})")
    return feature_layer if feature_layer >= 0 else num_layers + 1 + feature_layer


class VisionEmbeddings(nn.Module):
    def __init__(self, config: Any, class_token: bool) -> None:
        super().__init__()
        dim, patch = config.hidden_size, config.patch_size
        channels = _field(config, "num_channels", 3)
        self.patch_embedding = nn.Conv2d(channels, dim, patch, patch, bias=not class_token)
        self.class_embedding = nn.Parameter(torch.zeros(dim)) if class_token else None
        positions = (config.image_size // patch) ** 2 + int(class_token)
        self.position_embedding = nn.Embedding(positions, dim)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        """patches [B, N, channels * patch^2] -> [B, N (+1 class), dim]."""
        w = self.patch_embedding.weight
        x = F.linear(patches.to(w.dtype), w.flatten(1), self.patch_embedding.bias)
        if self.class_embedding is not None:
            cls = self.class_embedding.to(x.dtype).expand(x.shape[0], 1, -1)
            x = torch.cat([cls, x], dim=1)
        return x + self.position_embedding.weight.to(x.dtype)


class VisionSelfAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim)
        self.v_proj = nn.Linear(dim, dim)
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, L, dim] -> [B, L, dim]; every token sees every token of its image."""
        b, n, _ = x.shape
        q, k, v = (p(x).view(b, n, self.num_heads, self.head_dim).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        out = F.scaled_dot_product_attention(q, k, v)  # scale 1/sqrt(head_dim), as CLIP's
        return self.out_proj(out.transpose(1, 2).reshape(b, n, -1))


class VisionEncoderLayer(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        dim, eps = config.hidden_size, config.layer_norm_eps
        self.layer_norm1 = nn.LayerNorm(dim, eps=eps)
        self.self_attn = VisionSelfAttention(dim, config.num_attention_heads)
        self.layer_norm2 = nn.LayerNorm(dim, eps=eps)
        self.mlp = VisionMLP(dim, config.intermediate_size, config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class VisionEncoder(nn.Module):
    def __init__(self, config: Any, num_layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(VisionEncoderLayer(config) for _ in range(num_layers))


class VisionTower(nn.Module):
    """A CLIP or SigLIP vision encoder cut after its feature layer.

    Args:
        config: the ``vision_config`` (``model_type`` ``clip_vision_model`` or
            ``siglip_vision_model``; hidden_size, intermediate_size, num_hidden_layers,
            num_attention_heads, patch_size, image_size, hidden_act, layer_norm_eps).
        feature_layer: the hidden state read (see :func:`vision_layers_needed`), or a list
            of them, concatenated (``num_features`` of them: the output has
            ``num_features * hidden_size`` columns).

    Raises:
        ValueError: for another vision model type, an unsupported activation or a feature
            layer outside the encoder.
    """

    def __init__(self, config: Any, feature_layer: int) -> None:
        super().__init__()
        model_type = _field(config, "model_type")
        if model_type not in VISION_MODEL_TYPES:
            raise ValueError(f"vision_config.model_type {model_type!r} is not supported for "
                             f"LLaVA; kvflow runs {sorted(VISION_MODEL_TYPES)}")
        self.class_token = VISION_MODEL_TYPES[model_type]
        layers = [feature_layer] if isinstance(feature_layer, int) else list(feature_layer)
        # the hidden-state indices read, 0 the embeddings (after CLIP's pre-LayerNorm)
        self.feature_indices = [vision_layers_needed(config.num_hidden_layers, layer)
                                for layer in layers]
        self.num_features = len(self.feature_indices)
        self.num_layers = max(self.feature_indices)
        self.patch_size = config.patch_size
        self.embeddings = VisionEmbeddings(config, self.class_token)
        self.pre_layrnorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps) \
            if self.class_token else None
        self.encoder = VisionEncoder(config, self.num_layers)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        """patches float [B, N, channels * patch^2] (N = (image_size / patch)^2) -> the
        feature layers' hidden states [B, N (+1: CLIP's class token first), num_features *
        hidden], the layers' in ``feature_layer``'s order."""
        x = self.embeddings(patches)
        if self.pre_layrnorm is not None:
            x = self.pre_layrnorm(x)
        states = [x]  # states[i]: the hidden states after i layers
        for layer in self.encoder.layers:
            states.append(layer(states[-1]))
        return torch.cat([states[i] for i in self.feature_indices], dim=-1)

    def needs(self, name: str) -> bool:
        """Whether a checkpoint tensor name (relative to the tower: ``embeddings.*``,
        ``encoder.layers.N.*``, ...) is a parameter here; False for layers past the feature
        layer, ``post_layernorm``, SigLIP's pooling ``head`` and the ``position_ids`` buffer
        older checkpoints hold."""
        parts = name.split(".")
        if parts[:2] == ["encoder", "layers"]:
            return int(parts[2]) < self.num_layers
        return parts[0] not in ("post_layernorm", "head") and \
            not name.endswith("position_ids")
