"""Qwen2.5-VL: Qwen2-VL's decoder and M-RoPE with a windowed vision encoder.

Qwen2.5-VL technical report (Bai et al. 2025, arXiv:2502.13923, sec. 2.1): the ViT keeps
Qwen2-VL's patching, 2-D RoPE and 2 x 2 patch merger, but most blocks attend only within
windows of ``window_size`` pixels (112: 4 x 4 merged tokens = 8 x 8 patches), and only the
blocks in ``fullatt_block_indexes`` attend over the whole image; norms are RMSNorm and the MLP
is gated SiLU, as in the language model. The patches are reordered once so every window is
contiguous (windows row-major in each frame, merged units row-major in each window), the
blocks run on that order, and the merger's rows are put back in the prompt's order at the end.
Image placeholders and M-RoPE positions are those of Qwen2-VL (``qwen2_vl.py``), except a
video's time ids, which step by ``tokens_per_second * second_per_grid_t`` (absolute time).
"""

from __future__ import annotations

from collections.abc import Iterable
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from kvflow.models.llama import Qwen2ForCausalLM, default_weight_loader
from kvflow.models.qwen2_vl import Qwen2VLForConditionalGeneration, _rename
from kvflow.models.qwen2_vl_vision import (
    PatchEmbed,
    PatchMerger,
    VisionAttention,
    frame_boundaries,
    vision_activation,
    vision_rope_positions,
)


class VisionRMSNorm(nn.Module):
    """``weight * x / rms(x)``, the statistics in float32 (transformers' Qwen2_5_VLRMSNorm)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class GatedVisionMLP(nn.Module):
    """``down(act(gate(x)) * up(x))`` with biases."""

    def __init__(self, dim: int, hidden: int, act: str) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden)
        self.up_proj = nn.Linear(dim, hidden)
        self.down_proj = nn.Linear(hidden, dim)
        self.act = vision_activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class Qwen25VisionBlock(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        dim = config.hidden_size
        self.norm1 = VisionRMSNorm(dim)
        self.norm2 = VisionRMSNorm(dim)
        self.attn = VisionAttention(dim, config.num_heads)
        self.mlp = GatedVisionMLP(dim, config.intermediate_size, config.hidden_act)

    def forward(self, x: torch.Tensor, bounds: list[int], cos: torch.Tensor,
                sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), bounds, cos, sin)
        return x + self.mlp(self.norm2(x))


def window_order(grid_thw: list[tuple[int, int, int]], merge: int, window: int
                 ) -> tuple[torch.Tensor, list[int]]:
    """The windowed order of the merged units and the windows' patch boundaries.

    Args:
        grid_thw: per image (temporal, height, width) in patches.
        merge: patches merged per side (a merged unit is ``merge^2`` consecutive patches).
        window: window side in merged units.

    Returns:
        (index int64 [num_units]: the unit placed at each new position, bounds: cumulative
        patch counts of the windows in the new order).
    """
    index, bounds, base = [], [0], 0
    for t, h, w in grid_thw:
        rows, cols = h // merge, w // merge
        units = torch.arange(t * rows * cols).view(t, rows, cols) + base
        for frame in units:
            for r in range(0, rows, window):
                for c in range(0, cols, window):
                    block = frame[r:r + window, c:c + window].reshape(-1)
                    index.append(block)
                    bounds.append(bounds[-1] + block.numel() * merge * merge)
        base += t * rows * cols
    return torch.cat(index), bounds


class Qwen25VisionTransformer(nn.Module):
    """``forward(pixel_values [N, C*T*P*P], grid_thw) -> [N / merge^2, out_hidden_size]``.

    Args:
        config: the model's ``vision_config`` (hidden_size, depth, num_heads,
            intermediate_size, hidden_act, patch_size, temporal_patch_size, in_channels,
            spatial_merge_size, window_size, fullatt_block_indexes, out_hidden_size).
    """

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.merge = config.spatial_merge_size
        self.window = config.window_size // config.spatial_merge_size // config.patch_size
        self.full_blocks = set(config.fullatt_block_indexes)
        self.patch_embed = PatchEmbed(SimpleNamespace(
            temporal_patch_size=config.temporal_patch_size, patch_size=config.patch_size,
            in_channels=config.in_channels, embed_dim=config.hidden_size))
        self.blocks = nn.ModuleList([Qwen25VisionBlock(config) for _ in range(config.depth)])
        self.merger = PatchMerger(config.out_hidden_size, config.hidden_size, self.merge)
        self.merger.ln_q = VisionRMSNorm(config.hidden_size)
        head_dim = config.hidden_size // config.num_heads
        theta = (getattr(config, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
        self.register_buffer("inv_freq", 1.0 / theta ** (
            torch.arange(0, head_dim // 2, 2, dtype=torch.float32) / (head_dim // 2)),
            persistent=False)

    def _to_windows(self, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        unit = self.merge * self.merge
        return x.view(-1, unit, x.shape[-1])[index].reshape(x.shape)

    def forward(self, pixel_values: torch.Tensor,
                grid_thw: list[tuple[int, int, int]]) -> torch.Tensor:
        index, window_bounds = window_order(grid_thw, self.merge, self.window)
        index = index.to(pixel_values.device)
        x = self._to_windows(self.patch_embed(pixel_values), index)
        pos = vision_rope_positions(grid_thw, self.merge).to(self.inv_freq.device)
        freqs = (pos.unsqueeze(-1).float() * self.inv_freq).flatten(1)
        emb = self._to_windows(torch.cat([freqs, freqs], dim=-1), index)
        cos, sin = emb.cos(), emb.sin()
        full_bounds = frame_boundaries(grid_thw)  # windows never cross frames: same order
        for i, block in enumerate(self.blocks):
            x = block(x, full_bounds if i in self.full_blocks else window_bounds, cos, sin)
        return self.merger(x)[torch.argsort(index)]


class Qwen2_5_VLForConditionalGeneration(Qwen2VLForConditionalGeneration):
    """Qwen2.5-VL (see the module docstring); everything but the vision tower is Qwen2-VL's."""

    vision_tower_cls = Qwen25VisionTransformer
    scales_video_time = True

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The vision tower's tensors are copied as they are (its ``gate_proj`` / ``up_proj``
        stay separate, unlike the decoder's fused ``gate_up_proj``); the rest loads as
        Qwen2's. Returns the parameters loaded.

        Raises:
            ValueError: for a checkpoint tensor that matches no parameter.
        """
        visual = dict(self.visual.named_parameters(prefix="visual"))
        loaded: set[str] = set()

        def decoder_weights() -> Iterable[tuple[str, torch.Tensor]]:
            """Copies the vision tensors, yields the rest.

            Raises:
                ValueError: for a ``visual.*`` tensor that matches no parameter.
            """
            for name, tensor in weights:
                name = _rename(name)
                if not name.startswith("visual."):
                    yield name, tensor
                    continue
                if name not in visual:
                    raise ValueError(f"checkpoint tensor {name!r} matches no parameter of "
                                     f"{type(self).__name__}")
                default_weight_loader(visual[name], tensor)
                loaded.add(name)

        return loaded | Qwen2ForCausalLM.load_weights(self, decoder_weights())
