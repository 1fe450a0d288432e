"""Platforms: where the model runs. Code outside this package never asks torch.cuda itself."""

from __future__ import annotations

from kvflow.platforms.base import Platform
from kvflow.platforms.cpu import CpuPlatform
from kvflow.platforms.cuda import CudaPlatform

# The platforms whose tensors kvflow's ops know, in lookup order. A plugin platform (another
# vendor's device) adds its class here; a platform whose tensors share a torch device type with
# another (ROCm's are "cuda") goes first and claims them only when it is the one in use.
_KNOWN_PLATFORMS: tuple[type[Platform], ...] = (CpuPlatform, CudaPlatform)


def get_platform(device: str = "auto") -> Platform:
    """Return the platform for ``device`` ("auto", "cpu" or "cuda").

    Raises:
        ValueError: for an unknown device, or "cuda" when no CUDA device is visible.
    """
    if device == "auto":
        return CudaPlatform() if CudaPlatform.is_available() else CpuPlatform()
    if device == "cpu":
        return CpuPlatform()
    if device == "cuda":
        if not CudaPlatform.is_available():
            raise ValueError("--device cuda was asked for but no CUDA device is visible")
        return CudaPlatform()
    raise ValueError(f"unknown device {device!r}; choose auto, cpu or cuda")


def op_dispatch_key(device_type: str) -> str:
    """Which implementation a custom op runs for tensors of a torch device type.

    Returns the name of the platform that owns ``device_type`` ("cpu" -> "cpu", "cuda" ->
    "cuda"); :class:`kvflow.layers.custom_op.CustomOp` then calls ``forward_<name>``. A device
    type no known platform owns ("mps", "meta", a plugin's "xpu") is returned as is, so a
    plugin's ops only need a ``forward_<device_type>``, and every op without one runs its
    ``forward_native``.
    """
    for platform in _KNOWN_PLATFORMS:
        if platform.device_type == device_type:
            return platform.name
    return device_type


__all__ = ["Platform", "get_platform", "op_dispatch_key"]
