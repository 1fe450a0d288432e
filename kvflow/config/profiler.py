"""The torch profiler's settings, read from the environment as vLLM reads its own
(``VLLM_TORCH_PROFILER_DIR`` and friends): ``KVFLOW_TORCH_PROFILER_DIR`` turns profiling on
(``LLM.start_profile`` / ``stop_profile``, the server's ``/start_profile`` and
``/stop_profile``) and names the folder the traces go to."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

PROFILER_DIR_VARIABLE = "KVFLOW_TORCH_PROFILER_DIR"


@dataclass(frozen=True)
class ProfilerOptions:
    """Where traces go and what they record.

    Attributes:
        trace_dir: absolute folder for the traces (created at the first start).
        record_shapes: record each op's input shapes (``KVFLOW_TORCH_PROFILER_RECORD_SHAPES``).
        with_stack: record the Python stack of each op (``KVFLOW_TORCH_PROFILER_WITH_STACK``;
            larger traces, slower steps while profiling).
    """

    trace_dir: str
    record_shapes: bool = False
    with_stack: bool = False


def profiler_options(env: Mapping[str, str] | None = None) -> ProfilerOptions | None:
    """The profiler's settings from ``env`` (default: the process environment); None when
    ``KVFLOW_TORCH_PROFILER_DIR`` is unset or empty (profiling off).

    Raises:
        ValueError: for a ``KVFLOW_TORCH_PROFILER_RECORD_SHAPES`` / ``..._WITH_STACK`` other
            than 0 or 1, naming it.
    """
    env = os.environ if env is None else env
    trace_dir = env.get(PROFILER_DIR_VARIABLE, "").strip()
    flags = {}
    for name in ("record_shapes", "with_stack"):
        variable = f"KVFLOW_TORCH_PROFILER_{name.upper()}"
        value = env.get(variable, "0").strip()
        if value not in ("0", "1"):
            raise ValueError(f"{variable}={value!r} is invalid; choose 0 or 1")
        flags[name] = value == "1"
    if not trace_dir:
        return None
    return ProfilerOptions(os.path.abspath(os.path.expanduser(trace_dir)), **flags)


def required_profiler_options() -> ProfilerOptions:
    """:func:`profiler_options` of the process environment, which must turn profiling on.

    Raises:
        ValueError: when ``KVFLOW_TORCH_PROFILER_DIR`` is unset (naming it), or as
            :func:`profiler_options`.
    """
    options = profiler_options()
    if options is None:
        raise ValueError(f"profiling is off: set {PROFILER_DIR_VARIABLE} to the folder for the "
                         "traces before starting the engine")
    return options
