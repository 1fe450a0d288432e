"""Multimodal rotary position embedding (M-RoPE) of Qwen2-VL / Qwen2.5-VL.

M-RoPE (Qwen2-VL technical report, Wang et al. 2024, arXiv:2409.12191, sec. 2.1) gives every
token three position ids, (temporal, height, width), instead of one. Text tokens use the same
id on all three axes, so on text M-RoPE equals plain RoPE; an image's tokens share the
temporal id and count rows and columns of its patch grid on the other two. The rotary
frequency pairs are split into ``mrope_section`` runs (e.g. [16, 24, 24] of 64 pairs): run
``i`` rotates by the id of axis ``i % 3``. Positions are therefore ``[3, num_tokens]`` for
these models; a token's rotation still depends on its own ids only, so the paged KV cache,
chunked prefill and prefix caching work unchanged.
"""

from __future__ import annotations

import torch

from kvflow.layers.rotary import RotaryEmbedding


class MRotaryEmbedding(RotaryEmbedding):
    """RoPE whose frequency runs follow three position axes (neox layout).

    Args:
        head_dim: rotated head size (all of it: M-RoPE models rotate whole heads).
        max_position: rows of the cos/sin table (every id on every axis is below it).
        theta: RoPE base.
        mrope_section: frequency pairs per run; they sum to ``head_dim // 2``.
        scaling: a rope_scaling dict, or None (plain RoPE; what Qwen2-VL uses).

    Raises:
        ValueError: if ``mrope_section`` does not add up to ``head_dim // 2``.
    """

    def __init__(self, head_dim: int, max_position: int, theta: float,
                 mrope_section: list[int], scaling: dict | None = None) -> None:
        super().__init__(head_dim, max_position, theta, scaling)
        if sum(mrope_section) != head_dim // 2:
            raise ValueError(f"mrope_section {mrope_section} must add up to head_dim // 2 = "
                             f"{head_dim // 2}")
        axis = torch.repeat_interleave(torch.arange(len(mrope_section)) % 3,
                                       torch.tensor(mrope_section))
        # column c of the [cos | sin] table row reads the table at axis column_axis[c]'s id
        self.register_buffer("column_axis", torch.cat([axis, axis]), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """positions int64 [3, T] (or [T]: text only, plain RoPE); q [T, Hq, D],
        k [T, Hkv, D] -> rotated (q, k), same dtypes."""
        if positions.dim() == 1:
            return super().forward(positions, q, k)
        return self.forward_mrope(positions, q, k)

    def forward_mrope(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """Plain torch in float32; fresh outputs, inputs untouched."""
        num_tokens = positions.shape[1]
        table = self.cos_sin_cache[positions]  # [3, T, rotary_dim]: each axis' rows
        index = self.column_axis.view(1, 1, -1).expand(1, num_tokens, -1)
        cos_sin = table.gather(0, index).squeeze(0)  # [T, rotary_dim]
        cos, sin = cos_sin.unsqueeze(1).chunk(2, dim=-1)
        dtype = q.dtype
        return (self._rotate(q.float(), cos, sin).to(dtype),
                self._rotate(k.float(), cos, sin).to(dtype))
