"""Rotary position embedding (RoFormer, Su et al. 2021) with Llama-3, linear and LongRoPE
(Phi-3 ``longrope`` / ``su``) scaling."""

from __future__ import annotations

import math
from typing import Any

import torch

from kvflow.kernels.cpu_native import native_kernels_for
from kvflow.layers.custom_op import CustomOp


def get_rope_parameters(config: Any) -> tuple[float, dict | None]:
    """Read (rope_theta, rope_scaling) from an HF config of any transformers version.

    transformers 5 stores ``rope_parameters = {"rope_type", "rope_theta", ...}``; older versions
    use a top-level ``rope_theta`` and an optional ``rope_scaling`` dict. Returns scaling None
    for plain RoPE.
    """
    params = getattr(config, "rope_parameters", None) or {}
    if isinstance(params, dict) and "rope_theta" not in params and params:
        # Per-layer-type dict (Gemma 3): take the full-attention entry.
        params = params.get("full_attention", next(iter(params.values())))
    theta = params.get("rope_theta", getattr(config, "rope_theta", None) or 10000.0)
    scaling = dict(params) if params else dict(getattr(config, "rope_scaling", None) or {})
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return float(theta), None
    scaling["rope_type"] = rope_type
    if rope_type in ("longrope", "su"):  # older Phi-3 configs keep the length at top level
        scaling.setdefault("original_max_position_embeddings",
                           getattr(config, "original_max_position_embeddings", None))
    return float(theta), scaling


def get_rotary_dim(config: Any, head_dim: int) -> int:
    """Rotated dimensions per head: ``head_dim x partial_rotary_factor`` (transformers 5 keeps
    the factor in ``rope_parameters``, older versions at top level; default 1)."""
    params = getattr(config, "rope_parameters", None) or {}
    factor = params.get("partial_rotary_factor") if isinstance(params, dict) else None
    factor = factor or getattr(config, "partial_rotary_factor", None) or 1.0
    return int(head_dim * factor)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1's frequency-dependent scaling: long wavelengths are divided by ``factor``,
    short ones kept, and the band between interpolated smoothly (Meta's reference code)."""
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_len = scaling.get("original_max_position_embeddings", 8192)
    wavelen = 2 * math.pi / inv_freq
    smooth = ((old_len / wavelen - low) / (high - low)).clamp(0.0, 1.0)
    scaled = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    return torch.where(wavelen < old_len / high, inv_freq,
                       torch.where(wavelen > old_len / low, inv_freq / factor, scaled))


def compute_inv_freq(rotary_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies [rotary_dim // 2] float32, after scaling.

    Raises:
        ValueError: for an unsupported ``rope_type``.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    if scaling is None:
        return inv_freq.float()
    rope_type = scaling["rope_type"]
    if rope_type == "linear":
        return (inv_freq / scaling["factor"]).float()
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling).float()
    if rope_type in ("longrope", "su"):
        return _longrope_inv_freq(rotary_dim, theta, scaling["short_factor"]).float()
    raise ValueError(f"unsupported rope_type {rope_type!r}: kvflow supports default, linear, "
                     "llama3, longrope")


def _longrope_inv_freq(rotary_dim: int, theta: float, ext_factors: list[float]) -> torch.Tensor:
    """LongRoPE (Ding et al. 2024; Phi-3 technical report, Abdin et al. 2024): each frequency
    pair ``i`` is stretched by its own searched factor, ``1 / (factor_i * theta^(2i/d))``
    [rotary_dim // 2] float32 (computed in float32 like the reference implementation)."""
    exponent = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    return 1.0 / (torch.tensor(ext_factors, dtype=torch.float32) * theta ** exponent)


def longrope_attention_factor(scaling: dict, max_position: int) -> float:
    """LongRoPE's magnitude correction of cos/sin: ``attention_factor`` if given, else
    ``sqrt(1 + ln(s) / ln(L_orig))`` with ``s = max_position / L_orig`` (1 when ``s <= 1``)."""
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    orig = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or max_position / orig
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))


class RotaryEmbedding(CustomOp):
    """Applies RoPE to q and k at given positions (neox layout: rotate the two halves).

    Holds ``cos_sin_cache`` [max_position, rotary_dim] float32 (cos half, then sin half).
    """

    def __init__(self, head_dim: int, max_position: int, theta: float,
                 scaling: dict | None = None, rotary_dim: int | None = None,
                 is_neox_style: bool = True) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim or head_dim
        self.is_neox_style = is_neox_style
        rope_type = (scaling or {}).get("rope_type")
        if rope_type in ("longrope", "su"):
            cache = self._longrope_cache(max_position, theta, scaling)
        else:
            inv_freq = compute_inv_freq(self.rotary_dim, theta, scaling)
            freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
            cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def _longrope_cache(self, max_position: int, theta: float, scaling: dict) -> torch.Tensor:
        """LongRoPE table: positions below ``original_max_position_embeddings`` use the short
        factors, positions at or beyond it the long factors (a per-position rule, so a token's
        rotation never depends on its batch or on later tokens), both times the attention
        factor. transformers instead switches the whole sequence to the long factors once it
        grows past the original length; the two agree on every sequence that stays within it.
        """
        orig = scaling["original_max_position_embeddings"]
        mscale = longrope_attention_factor(scaling, max_position)
        positions = torch.arange(max_position, dtype=torch.float32)
        short = _longrope_inv_freq(self.rotary_dim, theta, scaling["short_factor"])
        long = _longrope_inv_freq(self.rotary_dim, theta, scaling["long_factor"])
        inv_freq = torch.where((positions < orig).unsqueeze(1), short, long)
        freqs = positions.unsqueeze(1) * inv_freq
        return torch.cat([freqs.cos(), freqs.sin()], dim=-1) * mscale

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rot, rest = x[..., :self.rotary_dim], x[..., self.rotary_dim:]
        if self.is_neox_style:
            x1, x2 = rot.chunk(2, dim=-1)
        else:
            x1, x2 = rot[..., ::2], rot[..., 1::2]
        o1, o2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
        out = torch.cat([o1, o2], -1) if self.is_neox_style else torch.stack([o1, o2], -1).flatten(-2)
        return torch.cat([out, rest], dim=-1) if rest.numel() else out

    def _heads_contiguous(self, q: torch.Tensor, k: torch.Tensor) -> bool:
        """Whether the native CPU kernel takes q/k: [T, heads, head_dim] of one dtype with
        contiguous heads, and a float32 cos/sin table."""
        return self.cos_sin_cache.dtype == torch.float32 and q.dtype == k.dtype and all(
            t.dim() == 3 and t.stride(2) == 1 and t.stride(1) == t.shape[2] for t in (q, k))

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """positions [T] int64; q [T, Hq, D], k [T, Hkv, D] -> rotated (q, k), same dtypes.
        Runs the implementation for q's device (:class:`~kvflow.layers.custom_op.CustomOp`)."""
        return self.implementation_for(q.device)(positions, q, k)

    def forward_native(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """Plain torch in float32; fresh outputs, inputs untouched."""
        cos, sin = self.cos_sin_cache.index_select(0, positions).unsqueeze(1).chunk(2, dim=-1)
        dtype = q.dtype
        q = self._rotate(q.float(), cos, sin).to(dtype)
        k = self._rotate(k.float(), cos, sin).to(dtype)
        return q, k

    def forward_cpu(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """One native C kernel rotates q and k in place when it takes them
        (:meth:`_heads_contiguous`); returns (q, k)."""
        native = native_kernels_for(q)
        if native is None or not self._heads_contiguous(q, k):
            return self.forward_native(positions, q, k)
        return native.rotary(positions, q, k, self.cos_sin_cache, self.is_neox_style)

    def forward_cuda(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """One Triton kernel rotates q and k in place; returns (q, k)."""
        from kvflow.kernels.rotary import rotary_embedding

        return rotary_embedding(positions, q, k, self.cos_sin_cache, self.is_neox_style)
