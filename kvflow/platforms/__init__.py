"""Platforms: where the model runs. Code outside this package never asks torch.cuda itself."""

from __future__ import annotations

from kvflow.platforms.base import Platform


def get_platform(device: str = "auto") -> Platform:
    """Return the platform for ``device`` ("auto", "cpu" or "cuda").

    Raises:
        ValueError: for an unknown device, or "cuda" when no CUDA device is visible.
    """
    from kvflow.platforms.cpu import CpuPlatform
    from kvflow.platforms.cuda import CudaPlatform

    if device == "auto":
        return CudaPlatform() if CudaPlatform.is_available() else CpuPlatform()
    if device == "cpu":
        return CpuPlatform()
    if device == "cuda":
        if not CudaPlatform.is_available():
            raise ValueError("--device cuda was asked for but no CUDA device is visible")
        return CudaPlatform()
    raise ValueError(f"unknown device {device!r}; choose auto, cpu or cuda")


__all__ = ["Platform", "get_platform"]
