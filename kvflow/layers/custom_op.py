"""One device-dispatch base for layers: ``forward_native`` / ``forward_cpu`` / ``forward_cuda``.

An op writes its math once in plain torch (``forward_native``: the reference, always correct,
runs on any device) and may add faster implementations per platform. The choice, per call:

1. The device type of the op's first argument (``args[0].device.type``) is mapped to a platform
   name by :func:`kvflow.platforms.op_dispatch_key` ("cpu" -> "cpu", "cuda" -> "cuda"; a
   device type no platform owns maps to itself).
2. ``forward_<name>`` runs if the op has one, else ``forward_native``. The base's
   ``forward_cpu`` (kvflow's native C kernels) and ``forward_cuda`` (Triton) default to
   ``forward_native``, so an op overrides only those it has kernels for. Where the triton
   package is not installed, CUDA tensors run ``forward_native``.
3. An implementation whose kernel cannot take the operands (native kernels not built or
   ``KVFLOW_NATIVE_CPU=0``, a layout or dtype the kernel does not handle) returns
   ``self.forward_native(...)``; that check sits in the op's ``forward_cpu`` / ``forward_cuda``,
   beside the kernel call whose limits it states.

The choice is made per call, as the layers always made it (the same module may see CPU and
CUDA tensors, e.g. in tests). The platform is asked once per op and device; after that a call
costs one dictionary look-up (about 0.3 us on a 2-core EPYC). A new platform (another vendor)
is registered in ``kvflow.platforms`` and adds ``forward_<name>`` to the ops it has kernels
for; every other op keeps working through ``forward_native`` unedited.

The idea is vLLM's ``CustomOp`` (``vllm/model_executor/custom_op.py``), which instead binds one
implementation per op at construction from the current platform.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from kvflow.platforms import op_dispatch_key
from kvflow.platforms.cuda import triton_available


class CustomOp(nn.Module):
    """Base of layers with device-specific implementations (see the module docstring).

    Subclasses implement ``forward_native`` and, where they have kernels, ``forward_cpu``,
    ``forward_cuda`` or ``forward_<platform>``, all with ``forward``'s signature.
    """

    def __init__(self) -> None:
        super().__init__()
        # device -> its bound implementation: the lookup runs once per device (keyed by the
        # torch.device itself, whose hash is cheaper than reading ``device.type``)
        self._implementations: dict[torch.device, Callable[..., Any]] = {}

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the implementation for the device of the first argument (a tensor).

        Raises:
            NotImplementedError: when the subclass defines no ``forward_native`` and no
                implementation for the device.
        """
        return self.implementation_for(args[0].device)(*args, **kwargs)

    def implementation_for(self, device: torch.device) -> Callable[..., Any]:
        """The bound ``forward_<platform>`` for tensors on ``device``, else ``forward_native``."""
        impl = self._implementations.get(device)
        if impl is None:
            key = op_dispatch_key(device.type)
            impl = getattr(self, f"forward_{key}", self.forward_native)
            if key == "cuda" and not triton_available():  # forward_cuda is Triton's
                impl = self.forward_native
            self._implementations[device] = impl
        return impl

    def forward_native(self, *args: Any, **kwargs: Any) -> Any:
        """Plain torch: the reference the kernels are tested against, correct on any device.

        Raises:
            NotImplementedError: on an op that does not define it (every op must).
        """
        raise NotImplementedError(f"{type(self).__name__} defines no forward_native")

    def forward_cpu(self, *args: Any, **kwargs: Any) -> Any:
        """CPU tensors: kvflow's native C kernels where the op has them, else forward_native."""
        return self.forward_native(*args, **kwargs)

    def forward_cuda(self, *args: Any, **kwargs: Any) -> Any:
        """CUDA tensors: Triton kernels where the op has them, else forward_native."""
        return self.forward_native(*args, **kwargs)
