"""Qwen2-VL's vision encoder: a ViT over dynamic-resolution patch grids (plain torch).

Qwen2-VL technical report (Wang et al. 2024, arXiv:2409.12191, sec. 2.1): an image is cut into
14 x 14 patches (each repeated over ``temporal_patch_size`` frames, so images and videos share
one input form), every patch is embedded linearly, and a stack of pre-norm transformer blocks
runs over all patches of the image at once with *non-causal* attention and a 2-D rotary
embedding (rows on one half of the rotated pairs, columns on the other). A merger then
concatenates each 2 x 2 block of neighbouring patches (``spatial_merge_size``) and projects it
to the language model's width: one output row per image placeholder token.

Several images run in one call: their patches are concatenated and attention is restricted
to each image (each frame of a video) by cumulative lengths, like flash-attention's varlen
interface. The weights keep the checkpoint's names (``visual.blocks.0.attn.qkv.weight``, ...)
and are replicated on every tensor-parallel rank.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def vision_activation(name: str):
    """The MLP activation a vision config names.

    Raises:
        ValueError: for an activation kvflow does not implement.
    """
    acts = {"quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
            "gelu": F.gelu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
            "silu": F.silu}
    if name not in acts:
        raise ValueError(f"vision activation {name!r} is not supported; choose one of "
                         f"{sorted(acts)}")
    return acts[name]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def vision_rope_positions(grid_thw: list[tuple[int, int, int]], merge: int) -> torch.Tensor:
    """(row, column) of every patch, int64 [num_patches, 2], in the processor's patch order:
    ``merge x merge`` blocks in row-major order, row-major inside each block, repeated for
    every temporal slice."""
    out = []
    for t, h, w in grid_thw:
        rows = torch.arange(h).unsqueeze(1).expand(h, w)
        cols = torch.arange(w).unsqueeze(0).expand(h, w)
        block = (h // merge, merge, w // merge, merge)
        pos = torch.stack([rows.reshape(block).transpose(1, 2).flatten(),
                           cols.reshape(block).transpose(1, 2).flatten()], dim=-1)
        out.append(pos.repeat(t, 1))
    return torch.cat(out)


def frame_boundaries(grid_thw: list[tuple[int, int, int]]) -> list[int]:
    """Cumulative patch counts: attention runs within ``[b[i], b[i + 1])`` (one frame)."""
    bounds = [0]
    for t, h, w in grid_thw:
        for _ in range(t):
            bounds.append(bounds[-1] + h * w)
    return bounds


class VisionAttention(nn.Module):
    """Non-causal multi-head self-attention over the patches of each frame."""

    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, bounds: list[int], cos: torch.Tensor,
                sin: torch.Tensor) -> torch.Tensor:
        """x [N, dim]; cos / sin float32 [N, head_dim] -> [N, dim]."""
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, self.head_dim).unbind(1)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q = (q.float() * cos + rotate_half(q.float()) * sin).to(v.dtype)
        k = (k.float() * cos + rotate_half(k.float()) * sin).to(v.dtype)
        out = torch.empty_like(q)
        for start, end in itertools.pairwise(bounds):
            # [1, heads, L, head_dim] per frame (4-D: torch's fused CPU kernel instead of the
            # math path, ~3x faster at L = 1024); no mask: every patch sees every patch
            qf, kf, vf = (t[start:end].transpose(0, 1).unsqueeze(0) for t in (q, k, v))
            out[start:end] = F.scaled_dot_product_attention(qf, kf, vf)[0].transpose(0, 1)
        return self.proj(out.reshape(n, -1))


class VisionMLP(nn.Module):
    """fc1, activation ``act``, fc2: the vision MLP of Qwen2-VL, CLIP and SigLIP (x [..., dim]
    -> [..., dim])."""

    def __init__(self, dim: int, hidden: int, act: str) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)
        self.act = vision_activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionBlock(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        dim = config.embed_dim
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = VisionAttention(dim, config.num_heads)
        self.mlp = VisionMLP(dim, int(dim * config.mlp_ratio), config.hidden_act)

    def forward(self, x: torch.Tensor, bounds: list[int], cos: torch.Tensor,
                sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), bounds, cos, sin)
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nn.Module):
    """A Conv3d whose kernel equals its stride over one patch: a linear map of the flattened
    patch (channels, frames, rows, columns), computed as such."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        kernel = (config.temporal_patch_size, config.patch_size, config.patch_size)
        self.proj = nn.Conv3d(config.in_channels, config.embed_dim, kernel, kernel, bias=False)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        weight = self.proj.weight
        return F.linear(pixel_values.to(weight.dtype), weight.view(weight.shape[0], -1))


class PatchMerger(nn.Module):
    """LayerNorm, then each ``merge x merge`` block of patches concatenated and projected to
    the language model's hidden size by a two-layer GELU MLP."""

    def __init__(self, dim: int, context_dim: int, merge: int) -> None:
        super().__init__()
        self.hidden_size = context_dim * merge ** 2
        self.ln_q = nn.LayerNorm(context_dim, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(self.hidden_size, self.hidden_size), nn.GELU(),
                                 nn.Linear(self.hidden_size, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.hidden_size))


class Qwen2VisionTransformer(nn.Module):
    """``forward(pixel_values [N, C*T*P*P], grid_thw) -> [N / merge^2, hidden_size]``.

    Args:
        config: the model's ``vision_config`` (embed_dim, depth, num_heads, mlp_ratio,
            patch_size, temporal_patch_size, spatial_merge_size, hidden_size, hidden_act).
    """

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.merge = config.spatial_merge_size
        self.patch_embed = PatchEmbed(config)
        self.blocks = nn.ModuleList([VisionBlock(config) for _ in range(config.depth)])
        self.merger = PatchMerger(config.hidden_size, config.embed_dim, self.merge)
        head_dim = config.embed_dim // config.num_heads
        theta = (getattr(config, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
        # 2-D RoPE: head_dim / 4 frequencies, used for rows and again for columns
        self.register_buffer("inv_freq", 1.0 / theta ** (
            torch.arange(0, head_dim // 2, 2, dtype=torch.float32) / (head_dim // 2)),
            persistent=False)

    def rotary_cos_sin(self, grid_thw: list[tuple[int, int, int]]
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin float32 [num_patches, head_dim]: frequencies times (row, column),
        concatenated, then repeated for the two halves that ``rotate_half`` pairs."""
        pos = vision_rope_positions(grid_thw, self.merge).to(self.inv_freq.device)
        freqs = (pos.unsqueeze(-1).float() * self.inv_freq).flatten(1)  # [N, head_dim / 2]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos(), emb.sin()

    def forward(self, pixel_values: torch.Tensor,
                grid_thw: list[tuple[int, int, int]]) -> torch.Tensor:
        x = self.patch_embed(pixel_values)
        cos, sin = self.rotary_cos_sin(grid_thw)
        bounds = frame_boundaries(grid_thw)
        for block in self.blocks:
            x = block(x, bounds, cos, sin)
        return self.merger(x)
