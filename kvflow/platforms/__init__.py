"""Platforms: where the model runs. Code outside this package never asks torch.cuda itself.

Built in: ``cpu`` and ``cuda``. Other platforms come from installed packages: each registers a
:class:`Platform` subclass (or a function returning one, or None when its device is absent)
under the entry point group ``kvflow.platform_plugins``, e.g. in its ``pyproject.toml``::

    [project.entry-points."kvflow.platform_plugins"]
    npu = "kvflow_npu.platform:NpuPlatform"

``--device npu`` then selects the class whose ``name`` is ``npu``.
"""

from __future__ import annotations

import functools
import importlib.metadata
import logging

from kvflow.platforms.base import Platform
from kvflow.platforms.cpu import CpuPlatform
from kvflow.platforms.cuda import CudaPlatform

logger = logging.getLogger(__name__)

PLUGIN_GROUP = "kvflow.platform_plugins"

# The built-in platforms whose tensors kvflow's ops know, in lookup order; plugins come after
# them (a plugin's own device type, e.g. "xpu", is owned by the plugin). A platform whose
# tensors share a torch device type with another (ROCm's are "cuda") goes first and claims
# them only when it is the one in use.
_KNOWN_PLATFORMS: tuple[type[Platform], ...] = (CpuPlatform, CudaPlatform)


@functools.lru_cache(maxsize=1)
def plugin_platforms() -> tuple[type[Platform], ...]:
    """The platform classes installed packages register under ``kvflow.platform_plugins``
    (looked up once per process; ``plugin_platforms.cache_clear()`` looks again). An entry
    point that fails to load, or gives something else than a Platform subclass, is logged
    and skipped; one whose function returns None (device absent) is skipped silently."""
    found: list[type[Platform]] = []
    for entry in importlib.metadata.entry_points(group=PLUGIN_GROUP):
        try:
            obj = entry.load()
            cls = obj if isinstance(obj, type) else obj()
        except Exception:  # a broken plugin must not take the built-in platforms down
            logger.exception("platform plugin %r (%s) failed to load", entry.name, entry.value)
            continue
        if cls is None:
            continue
        if not (isinstance(cls, type) and issubclass(cls, Platform)):
            logger.warning("platform plugin %r gave %r, not a Platform subclass; skipped",
                           entry.name, cls)
            continue
        found.append(cls)
    return tuple(found)


def available_devices() -> list[str]:
    """Names ``--device`` accepts: auto, the built-in platforms and the installed plugins."""
    return ["auto", *(p.name for p in _KNOWN_PLATFORMS + plugin_platforms())]


def get_platform(device: str = "auto") -> Platform:
    """Return the platform for ``device``: "auto" (CUDA when a device is visible, else CPU;
    plugins are only used when named), "cpu", "cuda" or a plugin platform's name.

    Raises:
        ValueError: for an unknown device, or one whose platform reports no device present.
    """
    if device == "auto":
        return CudaPlatform() if CudaPlatform.is_available() else CpuPlatform()
    for cls in _KNOWN_PLATFORMS + plugin_platforms():
        if cls.name == device:
            if not cls.is_available():
                raise ValueError(f"--device {device} was asked for but no {device} device is "
                                 "visible")
            return cls()
    raise ValueError(f"unknown device {device!r}; choose one of {available_devices()} "
                     f"(plugin platforms register under the {PLUGIN_GROUP!r} entry points)")


def op_dispatch_key(device_type: str) -> str:
    """Which implementation a custom op runs for tensors of a torch device type.

    Returns the name of the platform that owns ``device_type`` ("cpu" -> "cpu", "cuda" ->
    "cuda", a plugin's own type -> the plugin's name); :class:`kvflow.layers.custom_op.CustomOp`
    then calls ``forward_<name>``. A device type no platform owns ("mps", "meta") is returned
    as is, so every op without a ``forward_<device_type>`` runs its ``forward_native``.
    """
    for platform in _KNOWN_PLATFORMS + plugin_platforms():
        if platform.device_type == device_type:
            return platform.name
    return device_type


__all__ = ["PLUGIN_GROUP", "Platform", "available_devices", "get_platform", "op_dispatch_key",
           "plugin_platforms"]
