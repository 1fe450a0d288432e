"""Llama 3.1-style RoPE scaling of a GGUF file, read back from its ``rope_freqs`` tensor.

llama.cpp's ``convert_hf_to_gguf.py`` (``LlamaModel.generate_extra_tensors``) does not write a
Llama 3.1 / 3.2 / 3.3 checkpoint's ``rope_scaling = {"rope_type": "llama3", ...}`` as metadata:
it writes one divisor per rotary frequency pair, ``rope_freqs.weight`` float32 [rotary_dim / 2]
(1 for short wavelengths, ``factor`` for long ones, ``1 / ((1 - smooth) / factor + smooth)``
between), and llama.cpp rotates with ``inv_freq / rope_freqs``. That is exactly transformers'
``llama3`` frequencies, whose divisors depend on ``(factor, low_freq_factor, high_freq_factor,
original_max_position_embeddings)`` only through ``factor`` and a line in ``1 / wavelength``;
:func:`llama3_rope_scaling` finds parameters on that line and keeps them only when kvflow's own
``llama3`` frequencies from them equal the file's to float32 rounding.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from kvflow.models.gguf_reader import GGUFMetadata, GGUFTensorInfo

ROPE_FREQS = "rope_freqs.weight"
# relative difference allowed between inv_freq / rope_freqs and kvflow's llama3 frequencies
# (the file's divisors are float32; transformers computes its frequencies in float32 too)
_RTOL = 1e-5
# Meta's values for every Llama 3.1 / 3.2 / 3.3 checkpoint (tried first, so such a file gets
# its config.json's exact numbers)
_META_LOW, _META_HIGH, _META_ORIGINAL = 1.0, 4.0, 8192


def read_rope_freqs(meta: GGUFMetadata, info: GGUFTensorInfo) -> np.ndarray:
    """The ``rope_freqs`` divisors as float64 [n] (a 1-D F32, F16 or BF16 tensor).

    Raises:
        ValueError: naming the file and the tensor, for another shape or type, or a divisor
            that is not a finite number >= 1 (llama.cpp's converter writes 1 <= d <= factor).
    """
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize

    def bad(problem: str) -> ValueError:
        return ValueError(f"{meta.path!r}: GGUF tensor {info.name!r} {problem}")

    if len(info.shape) != 1 or info.ggml_type not in (0, 1, 30):
        raise bad(f"has shape {info.shape} and GGML type {info.ggml_type}; llama.cpp writes "
                  "RoPE divisors as one float vector")
    with open(meta.path, "rb") as f:
        f.seek(info.offset)
        raw = np.frombuffer(f.read(info.n_bytes), dtype=np.uint8)
    factors = np.asarray(dequantize(raw, GGMLQuantizationType(info.ggml_type)), np.float64)
    if factors.shape != info.shape or not np.isfinite(factors).all() or (factors < 1).any():
        raise bad(f"holds {factors[:8].tolist()}...: RoPE divisors must be finite and >= 1")
    return factors


def _inv_freq(rotary_dim: int, theta: float) -> np.ndarray:
    """The unscaled inverse frequencies float64 [rotary_dim / 2], computed in float32 as
    :func:`kvflow.layers.rotary.compute_inv_freq` computes them."""
    from kvflow.layers.rotary import compute_inv_freq

    return compute_inv_freq(rotary_dim, theta, None).double().numpy()


def _candidates(factors: np.ndarray, inv_freq: np.ndarray) -> list[dict[str, Any]]:
    """llama3 scalings that may give ``factors``: Meta's (low 1, high 4, original 8192), and
    the line through the band's divisors (``smooth = orig / wavelen - low`` over
    ``high - low``, written with ``low_freq_factor = 1``), its length rounded and not."""
    factor = float(factors.max())
    found: list[dict[str, Any]] = [{"factor": factor, "low_freq_factor": _META_LOW,
                                    "high_freq_factor": _META_HIGH,
                                    "original_max_position_embeddings": _META_ORIGINAL}]
    band = (factors > 1 + _RTOL) & (factors < factor * (1 - _RTOL))
    if band.sum() >= 2:  # smooth = a / wavelen + b, a = orig / (high - low), b = -low / (...)
        smooth = (1 / factors[band] - 1 / factor) / (1 - 1 / factor)
        a, b = np.polyfit(inv_freq[band] / (2 * math.pi), smooth, 1)
        if b < 0 < a:
            high, original = 1 - 1 / b, -a / b
            found.append({"factor": factor, "low_freq_factor": 1.0,
                          "high_freq_factor": round(high, 6),
                          "original_max_position_embeddings": round(original)})
            found.append({"factor": factor, "low_freq_factor": 1.0, "high_freq_factor": high,
                          "original_max_position_embeddings": original})
    elif band.sum() == 1:  # Meta's low / high; the length through the one band divisor
        smooth = (1 / factors[band][0] - 1 / factor) / (1 - 1 / factor)
        wavelen = 2 * math.pi / inv_freq[band][0]
        original = (smooth * (_META_HIGH - _META_LOW) + _META_LOW) * wavelen
        found.append({**found[0], "original_max_position_embeddings": original})
    else:  # no band: any length between the last undivided and the first divided wavelength
        wavelen = 2 * math.pi / inv_freq
        kept, divided = wavelen[factors <= 1 + _RTOL], wavelen[factors > 1 + _RTOL]
        if len(kept) and len(divided):
            found.append({**found[0], "original_max_position_embeddings":
                          math.sqrt(_META_HIGH * kept.max() * divided.min())})
    return found


def llama3_rope_scaling(meta: GGUFMetadata, info: GGUFTensorInfo, rotary_dim: int,
                        theta: float) -> dict[str, Any] | None:
    """transformers' ``rope_scaling`` dict (``rope_type`` ``llama3``) whose frequencies are
    llama.cpp's ``inv_freq / rope_freqs`` for this file; None when every divisor is 1.

    Args:
        meta: the file's header; info: its ``rope_freqs.weight`` entry.
        rotary_dim: the rotated dimensions of a head; theta: ``rope.freq_base``.

    Raises:
        ValueError: naming the file and the tensor, for divisors of another length than
            ``rotary_dim / 2``, or that no llama3 scaling gives (another scaling kvflow does not
            compute).
    """
    from kvflow.layers.rotary import compute_inv_freq

    factors = read_rope_freqs(meta, info)
    if factors.shape != (rotary_dim // 2,):
        raise ValueError(f"{meta.path!r}: GGUF tensor {info.name!r} holds {factors.size} RoPE "
                         f"divisors, not one per frequency pair of {rotary_dim} rotated "
                         "dimensions")
    if (factors == 1).all():
        return None
    inv_freq = _inv_freq(rotary_dim, theta)
    target = inv_freq / factors  # what llama.cpp rotates with
    for candidate in _candidates(factors, inv_freq):
        scaling = {"rope_type": "llama3", **candidate}
        ours = compute_inv_freq(rotary_dim, theta, scaling).double().numpy()
        if np.allclose(ours, target, rtol=_RTOL, atol=0):
            return scaling
    raise ValueError(f"{meta.path!r}: GGUF tensor {info.name!r} holds RoPE divisors "
                     f"{factors.round(4).tolist()[:8]}... that no llama3 scaling (Llama 3.1's "
                     "factor, low/high frequency factors and original context) gives; kvflow "
                     "computes no other per-frequency RoPE scaling")
