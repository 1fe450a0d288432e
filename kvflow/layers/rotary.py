"""Rotary position embedding (RoFormer, Su et al. 2021) with Llama-3, linear, LongRoPE
(Phi-3 ``longrope`` / ``su``), YaRN (``yarn``) and dynamic NTK (``dynamic``) scaling.

Every scaling ends in one ``cos_sin_cache`` [max_position, rotary_dim] float32 table indexed by
position, computed once at start-up (:func:`compute_cos_sin_cache`): a token's rotation depends
on its position only (LongRoPE: and on whether its request's prompt is longer than the original
context, :class:`LongPromptRope`), never on its batch, its chunk or later tokens, which a paged
KV cache with prefix caching and chunked prefill needs (a cached key is never rotated again).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvflow.kernels.cpu_native import native_kernels_for
from kvflow.layers.custom_op import CustomOp
from kvflow.layers.rope_parameters import (
    ROPE_TYPES,
    get_rope_parameters,
    longrope_attention_factor,
    rope_max_positions,
)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1's frequency-dependent scaling: long wavelengths are divided by ``factor``,
    short ones kept, and the band between interpolated smoothly (Meta's reference code; in
    ``inv_freq``'s dtype, float32 there and in transformers)."""
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_len = scaling.get("original_max_position_embeddings", 8192)
    wavelen = 2 * math.pi / inv_freq
    smooth = ((old_len / wavelen - low) / (high - low)).clamp(0.0, 1.0)
    scaled = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    return torch.where(wavelen < old_len / high, inv_freq,
                       torch.where(wavelen > old_len / low, inv_freq / factor, scaled))


def compute_inv_freq(rotary_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies [rotary_dim // 2] float32, after scaling, computed in float32 as
    transformers and the reference implementations (Meta's Llama, Gemma) do: a frequency one
    float32 step off theirs turns into an angle error that grows with the position (2.4e-4
    in cos/sin by position 4000 when computed in float64).

    Raises:
        ValueError: for an unsupported ``rope_type``.
    """
    exponent = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    inv_freq = 1.0 / (theta ** exponent)
    if scaling is None:
        return inv_freq
    rope_type = scaling["rope_type"]
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    if rope_type in ("longrope", "su"):
        return _longrope_inv_freq(rotary_dim, theta, scaling["short_factor"]).float()
    if rope_type == "yarn":
        return _yarn_inv_freq(rotary_dim, theta, scaling)
    if rope_type == "dynamic":  # the frequencies up to the original length; see _dynamic_cache
        return inv_freq
    raise ValueError(f"unsupported rope_type {rope_type!r}: kvflow supports "
                     f"{', '.join(ROPE_TYPES)}")


def _yarn_correction_range(rotary_dim: int, theta: float, scaling: dict) -> tuple[float, float]:
    """YaRN's ramp bounds in frequency-pair index: the pair that turns ``beta_fast`` times over
    the original context and the one that turns ``beta_slow`` times (paper eq. 17, solved for
    the dimension), floored/ceiled unless ``truncate`` is false, clipped to [0, d - 1]."""
    orig = scaling["original_max_position_embeddings"]

    def dim_of(num_rotations: float) -> float:
        return rotary_dim * math.log(orig / (num_rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(scaling.get("beta_fast") or 32), dim_of(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, rotary_dim - 1)


def _yarn_inv_freq(rotary_dim: int, theta: float, scaling: dict) -> torch.Tensor:
    """YaRN's "NTK-by-parts" frequencies (Peng et al. 2023, arXiv:2309.00071, sec. 3.2 and
    3.4) [rotary_dim // 2] float32: pairs that turn more than ``beta_fast`` times within the
    original context keep their frequency, pairs that turn fewer than ``beta_slow`` times are
    divided by ``factor`` (position interpolation), and a linear ramp blends the pairs between.
    Computed in float32 as transformers does."""
    low, high = _yarn_correction_range(rotary_dim, theta, scaling)
    if low == high:
        high += 0.001  # no zero-width ramp
    pos_freqs = theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim)
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low))
    keep = 1.0 - ramp.clamp(0.0, 1.0)  # 1: extrapolate (keep), 0: interpolate (divide)
    return (1.0 / (scaling["factor"] * pos_freqs)) * (1.0 - keep) + (1.0 / pos_freqs) * keep


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude factor ``0.1 * mscale * ln(scale) + 1`` (1 when ``scale <= 1``);
    DeepSeek-V2/V3 also scale the softmax by ``yarn_mscale(factor, mscale_all_dim) ** 2``."""
    return 1.0 if scale <= 1.0 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_attention_factor(scaling: dict) -> float:
    """YaRN's factor on cos/sin, so on every attention logit ``q.k`` its square (the paper's
    ``sqrt(1/t) = 0.1 ln(s) + 1``, sec. 3.4): ``attention_factor`` if given, else
    ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)`` when both are set
    (DeepSeek-V2/V3), else ``0.1 ln(factor) + 1`` (1 when ``factor <= 1``)."""
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor, mscale, mscale_all_dim = (scaling["factor"], scaling.get("mscale"),
                                      scaling.get("mscale_all_dim"))
    if mscale and mscale_all_dim:
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
    return yarn_mscale(factor)


def _dynamic_cache(max_position: int, rotary_dim: int, theta: float,
                   scaling: dict) -> torch.Tensor:
    """Dynamic NTK table [max_position, rotary_dim] float32 (bloc97 / emozilla, 2023).

    transformers grows the base with the sequence length ``L`` of the forward pass,
    ``base(L) = theta * (factor * L / L_orig - (factor - 1)) ** (d / (d - 2))`` for
    ``L > L_orig = max_position_embeddings`` (plain ``theta`` up to it), and rotates every
    position of that pass with it, so a key's rotation depends on how long its sequence was
    when the key was computed. kvflow writes each key once into the paged cache, so it fixes
    the length per position instead: position ``p`` uses ``base(max(p + 1, L_orig))``. That
    equals transformers' cached ``generate`` exactly for every generated token (it decodes
    position ``p`` with ``L = p + 1``) and for every prompt token of a prompt of at most
    ``L_orig`` tokens (plain RoPE), so whole sequences whose prompt fits the original context
    match, however far generation runs past it. For a longer prompt transformers rotates all
    of it with ``base(prompt length)`` while kvflow keeps the per-position bases: the
    rotations of the last prompt position and of every later one still agree, those of the
    earlier prompt keys do not, so outputs differ. Computed in float64.
    """
    orig, factor = scaling["original_max_position_embeddings"], scaling["factor"]
    positions = torch.arange(max_position, dtype=torch.float64)
    seq_len = (positions + 1).clamp(min=orig)
    base = theta * (factor * seq_len / orig - (factor - 1)) ** (rotary_dim / (rotary_dim - 2))
    exponent = torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim
    freqs = positions.unsqueeze(1) * base.unsqueeze(1) ** -exponent
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).float()


def _longrope_cache(max_position: int, rotary_dim: int, theta: float,
                    scaling: dict) -> torch.Tensor:
    """LongRoPE table [max_position + L0, rotary_dim] (``L0`` the
    ``original_max_position_embeddings``, when below ``max_position``; else no extra rows),
    times the attention factor. Rows ``p < max_position``: the short factors below ``L0``,
    the long ones from it. Rows ``max_position + p`` (``p < L0``): position ``p`` with the long
    factors, for the prompt tokens of a prompt longer than ``L0``.

    transformers picks the factors from the length of each forward pass: long for all of it
    once it passes ``L0``, so in its ``generate`` a longer prompt is rotated with the long
    factors at every position and a shorter one with the short factors. The runner
    reproduces that per request by reading the extra rows for such a prompt's positions
    below ``L0`` (:class:`LongPromptRope`), so a key's rotation depends on its position and
    its request's prompt length only, never on its batch or chunk. When a sequence grows
    past ``L0`` while generating, Phi-3's ``generate`` recomputes its whole cache with the
    long factors; kvflow keeps the keys below ``L0`` it computed with the short factors
    (positions from ``L0`` on take the long ones), so later tokens may differ.
    """
    orig = scaling["original_max_position_embeddings"]
    mscale = longrope_attention_factor(scaling, max_position)
    positions = torch.arange(max_position, dtype=torch.float32)
    short = _longrope_inv_freq(rotary_dim, theta, scaling["short_factor"])
    long = _longrope_inv_freq(rotary_dim, theta, scaling["long_factor"])
    inv_freq = torch.where((positions < orig).unsqueeze(1), short, long)
    if orig < max_position:  # the long-prompt rows
        positions = torch.cat([positions, torch.arange(orig, dtype=torch.float32)])
        inv_freq = torch.cat([inv_freq, long.expand(orig, -1)])
    freqs = positions.unsqueeze(1) * inv_freq
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1) * mscale


@dataclass(frozen=True)
class LongPromptRope:
    """Where a LongRoPE table keeps the long-factor rows of positions below the original
    context, read by the prompt tokens of a prompt longer than it (:func:`_longrope_cache`).

    Attributes:
        original: ``original_max_position_embeddings`` (``L0``): prompts of more tokens are
            rotated with the long factors at every position.
        offset: the row of position 0 with the long factors (the table's per-position length,
            :func:`rope_max_positions`).
    """

    original: int
    offset: int

    def table_rows(self, positions: np.ndarray, prompt_lens: np.ndarray) -> np.ndarray:
        """int64 rows of the RoPE table for tokens at ``positions`` [T] (int64) of requests
        with ``prompt_lens`` [T] prompt tokens: ``position + offset`` for positions below
        ``original`` of prompts longer than it, the position otherwise (a fresh array)."""
        shift = (prompt_lens > self.original) & (positions < self.original)
        return positions + self.offset * shift


def long_prompt_rope(config: Any) -> LongPromptRope | None:
    """The model's :class:`LongPromptRope` when its RoPE is LongRoPE (``longrope`` / ``su``)
    with an original context shorter than the positions it covers; None otherwise (every
    token's table row is then its position). Per-layer-type RoPE (Gemma 3's
    ``rope_parameters``): None (LongRoPE there is refused at load,
    ``models.hf_config_checks.check_rope_parameters``)."""
    params = getattr(config, "rope_parameters", None) or {}
    if isinstance(params, dict) and params and "rope_theta" not in params:
        return None
    _, scaling = get_rope_parameters(config)
    if (scaling or {}).get("rope_type") not in ("longrope", "su"):
        return None
    orig, positions = scaling.get("original_max_position_embeddings"), rope_max_positions(config)
    return LongPromptRope(int(orig), positions) if orig and orig < positions else None


def compute_cos_sin_cache(max_position: int, rotary_dim: int, theta: float,
                          scaling: dict | None) -> torch.Tensor:
    """The RoPE table [max_position, rotary_dim] float32 (LongRoPE: more rows, see
    :func:`_longrope_cache`): row ``p`` is ``cos(p * f)`` for the ``rotary_dim // 2``
    frequencies ``f``, then ``sin(p * f)``, times the scaling's attention factor (YaRN,
    LongRoPE; 1 otherwise).

    Raises:
        ValueError: for an unsupported ``rope_type``.
    """
    rope_type = (scaling or {}).get("rope_type")
    if rope_type in ("longrope", "su"):
        return _longrope_cache(max_position, rotary_dim, theta, scaling)
    if rope_type == "dynamic":
        return _dynamic_cache(max_position, rotary_dim, theta, scaling)
    inv_freq = compute_inv_freq(rotary_dim, theta, scaling)
    freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
    cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
    return cache * yarn_attention_factor(scaling) if rope_type == "yarn" else cache


def _longrope_inv_freq(rotary_dim: int, theta: float, ext_factors: list[float]) -> torch.Tensor:
    """LongRoPE (Ding et al. 2024; Phi-3 technical report, Abdin et al. 2024): each frequency
    pair ``i`` is stretched by its own searched factor, ``1 / (factor_i * theta^(2i/d))``
    [rotary_dim // 2] float32 (computed in float32 like the reference implementation)."""
    exponent = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    return 1.0 / (torch.tensor(ext_factors, dtype=torch.float32) * theta ** exponent)


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
        cache = compute_cos_sin_cache(max_position, self.rotary_dim, theta, scaling)
        self.register_buffer("cos_sin_cache", cache, persistent=False)

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
        return self.cos_sin_cache.dtype == torch.float32 and q.dtype == k.dtype \
            and q.dim() == 3 and q.stride(2) == 1 and q.stride(1) == q.shape[2] \
            and k.dim() == 3 and k.stride(2) == 1 and k.stride(1) == k.shape[2]

    def fusable(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> bool:
        """Whether a fused rotary + KV-store kernel may apply this rotation
        (``kvflow/kernels/rotary_kv_store.py``): 1-D positions (not M-RoPE's [3, T]), a float32
        table on q's device, q/k as [T, heads, head_dim] with unit-stride last dims."""
        return positions.dim() == 1 and self.cos_sin_cache.dtype == torch.float32 \
            and self.cos_sin_cache.device == q.device and q.dim() == 3 and k.dim() == 3 \
            and q.stride(-1) == 1 and k.stride(-1) == 1

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
