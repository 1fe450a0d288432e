"""Kernel-choice readers: each ``--flag`` / ``KVFLOW_*`` environment variable that picks a
kernel, checked against its choices, and the on-disk cache folder."""

from __future__ import annotations

import os
from collections import Counter


def cache_dir() -> str:
    """Where kvflow keeps joined model files, GGUF tokenizers and
    compiled kernels: ``$KVFLOW_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/kvflow``, else
    ``~/.cache/kvflow``."""
    explicit = os.environ.get("KVFLOW_CACHE_DIR")
    if explicit:
        return explicit
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "kvflow")


def flag_or_env_choice(value: str | None, flag: str, env: str, default: str,
                        choices: tuple[str, ...]) -> str:
    """``value`` (from the flag ``flag``) if given, else ``$env``, else ``default``; checked
    against ``choices``.

    Raises:
        ValueError: on another value, naming the flag or the variable it came from.
    """
    name, choice = (flag, value) if value is not None else (env, os.environ.get(env, default))
    if choice not in choices:
        raise ValueError(f"{name}={choice!r} is invalid; choose one of {list(choices)}")
    return choice


def env_choice(env: str, default: str, choices: tuple[str, ...]) -> str:
    """``$env``, else ``default``, checked against ``choices``.

    Raises:
        ValueError: on another value, naming the variable.
    """
    return flag_or_env_choice(None, env, env, default, choices)


CPU_GEMM_CHOICES = ("auto", "native", "onednn")


def cpu_gemm_choice(value: str | None = None) -> str:
    """The CPU GEMM kernels asked for: ``value`` (``--cpu-gemm``) if given, else
    ``$KVFLOW_CPU_GEMM``, else ``auto`` (timed per shape class at start); ``native`` is kvflow's
    C GEMM, ``onednn`` oneDNN's packed GEMM.

    Raises:
        ValueError: on another value (naming the flag or variable it came from).
    """
    return flag_or_env_choice(value, "cpu_gemm", "KVFLOW_CPU_GEMM", "auto", CPU_GEMM_CHOICES)


CPU_ATTENTION_CHOICES = ("auto", "native", "sdpa")


def cpu_attention_choice(value: str | None = None) -> str:
    """The CPU attention of a batch of whole prompts asked for: ``value`` (``--cpu-attention``)
    if given, else ``$KVFLOW_CPU_ATTENTION``, else ``auto`` (kvflow's prefill tiles or torch's
    SDPA, whichever was timed faster on this CPU per dtype, head shape and prompt-length class;
    :mod:`kvflow.attention.prefill_select`); ``native`` / ``sdpa`` force one.

    Raises:
        ValueError: on another value (naming the flag or variable it came from).
    """
    return flag_or_env_choice(value, "cpu_attention", "KVFLOW_CPU_ATTENTION", "auto",
                               CPU_ATTENTION_CHOICES)


def cpu_adaptive_threads_choice(value: bool | None = None) -> bool:
    """Whether the CPU thread count adapts to other processes' load: ``value``
    (``--cpu-adaptive-threads``) if given, else ``$KVFLOW_CPU_ADAPTIVE_THREADS`` (``0`` or
    ``1``), else off: on a nearly quiet machine the governor was seen at one thread while two
    fixed threads ran 1.9x faster (docs/benchmarks.md), so it is opt-in until its signal is
    checked on a quiet machine. (The test suite sets the variable to 0: with plain torch
    kernels a fp32 result can differ in the last bits between thread counts.)

    Raises:
        ValueError: when the variable is neither 0 nor 1.
    """
    return _bool_choice(value, "KVFLOW_CPU_ADAPTIVE_THREADS", "0")


def cpu_gemm_pool_choice(value: bool | None = None) -> bool:
    """Whether kvflow's C GEMM and paged attention share their work through kvflow's
    straggler-tolerant pool
    (:mod:`kvflow.kernels.cpu_pool`) instead of OpenMP threads: ``value``
    (``--cpu-gemm-pool``) if given, else ``$KVFLOW_CPU_GEMM_POOL`` (``0`` or ``1``), else off:
    on a loaded 2-core EPYC its GEMMs ran 4-9% slower than OpenMP's on a quiet machine and the
    engine kept no more throughput beside a busy process (docs/benchmarks.md), so it is opt-in.

    Raises:
        ValueError: when the variable is neither 0 nor 1.
    """
    return _bool_choice(value, "KVFLOW_CPU_GEMM_POOL", "0")


def _bool_choice(value: bool | None, variable: str, default: str) -> bool:
    if value is not None:
        return value
    env = os.environ.get(variable, default)
    if env not in ("0", "1"):
        raise ValueError(f"{variable}={env!r} is invalid; choose 0 or 1")
    return env == "1"


# CPU numbers a cpu list may name: Linux numbers CPUs below its NR_CPUS build setting (at most
# a few thousand), so a larger number is a typo; bounding it keeps "0-99999999999" an error
# message rather than a list of 10^11 ints (a MemoryError with a traceback).
CPU_NUMBER_LIMIT = 1 << 16


def parse_cpu_list(spec: str) -> list[int]:
    """``"0-3,6,8-9"`` -> [0, 1, 2, 3, 6, 8, 9] (the Linux cpulist format, order kept).

    Raises:
        ValueError: on anything else (empty, negative, not ASCII digits, a reversed range, a
            repeated CPU, a CPU number of ``CPU_NUMBER_LIMIT`` or more).
    """
    cpus: list[int] = []
    for part in spec.split(","):
        lo, sep, hi = part.strip().partition("-")
        if not _is_number(lo) or (sep and not _is_number(hi)):
            raise ValueError(f"cpu list {spec!r} is invalid: expected CPU numbers and ranges "
                             "such as 0-3,6")
        first, last = int(lo), int(hi) if sep else int(lo)
        if last < first:
            raise ValueError(f"cpu list {spec!r} has a reversed range {part.strip()!r}")
        if last >= CPU_NUMBER_LIMIT:
            raise ValueError(f"cpu list {spec!r} names CPU {last}: CPU numbers go below "
                             f"{CPU_NUMBER_LIMIT}")
        cpus.extend(range(first, last + 1))
    counts = Counter(cpus)
    twice = sorted(cpu for cpu, n in counts.items() if n > 1)
    if twice:
        raise ValueError(f"cpu list {spec!r} names CPU(s) {twice} twice: give each thread a "
                         "CPU of its own")
    return cpus


def _is_number(text: str) -> bool:
    """Whether ``text`` is a non-negative whole number in ASCII digits (``str.isdigit`` also
    takes '²' and other Unicode digits, which ``int`` refuses)."""
    return text.isascii() and text.isdigit()


def native_cpu_choice() -> bool:
    """Whether kvflow's native C kernels may run on CPU: ``$KVFLOW_NATIVE_CPU`` = ``1`` (the
    default) or ``0`` (torch's kernels everywhere).

    Raises:
        ValueError: on another value.
    """
    return _bool_choice(None, "KVFLOW_NATIVE_CPU", "1")


def cpu_gguf_choice() -> str:
    """How GGUF weights kept quantized multiply on CPU: ``KVFLOW_CPU_GGUF`` = ``native``
    (kvflow's dequantize-in-the-GEMM C kernel, the default) or ``torch`` (dequantize tiles in
    plain torch, then torch's GEMM). Raises ValueError on any other value."""
    return env_choice("KVFLOW_CPU_GGUF", "native", ("native", "torch"))


def gguf_moe_experts_choice() -> str:
    """How ``--quantization gguf`` holds an MoE GGUF file's experts: ``KVFLOW_GGUF_MOE`` =
    ``quantized`` (the default: each expert's GGML blocks kept as in the file and multiplied
    by the dense GGUF layers' GEMM, ``kvflow/quant/gguf_moe.py``) or ``dequantized``
    (dequantized at load to ``--dtype``, run as float experts: 4-8x the memory). Raises
    ValueError on any other value. Set for any other model or quantization, it is warned
    about at start-up (``kvflow.core.unread_options.unread_model_setting_warnings``)."""
    return env_choice("KVFLOW_GGUF_MOE", "quantized", ("quantized", "dequantized"))


def cpu_quant_choice() -> str:
    """How weight-only INT8 layers (``--quantization int8``, the INT8 tables of ``int4``)
    multiply on CPU: ``KVFLOW_CPU_QUANT`` = ``native`` (kvflow's C kernel, int8 widened in
    registers; the default) or ``torch`` (torch's ``_weight_int8pack_mm``). Raises ValueError
    on any other value."""
    return env_choice("KVFLOW_CPU_QUANT", "native", ("native", "torch"))


CPU_LORA_CHOICES = ("auto", "native", "torch")


def cpu_lora_choice() -> str:
    """How LoRA layers' grouped matmul runs on CPU: ``KVFLOW_CPU_LORA`` = ``auto`` (the
    default: whichever of the two was timed faster on this CPU for the model's LoRA shapes,
    ``torch`` charged for the step graphs it costs; :mod:`kvflow.lora.cpu_kernel_choice`),
    ``native`` (kvflow's C kernel, ``csrc/cpu_lora.c``, one call for every adapter of a step,
    which lets decode steps replay as CPU step graphs) or ``torch`` (one torch matmul pair per
    adapter of the step; the steps then run eagerly). Raises ValueError on any other value,
    naming ``KVFLOW_CPU_LORA``."""
    return env_choice("KVFLOW_CPU_LORA", "auto", CPU_LORA_CHOICES)


LORA_KERNEL_CHOICES = ("triton", "torch")


def lora_kernel_choice(value: str | None = None) -> str:
    """The grouped LoRA matmul on CUDA: ``value`` if given, else ``$KVFLOW_LORA_KERNEL``, else
    ``triton`` (kvflow's SGMV kernel); ``torch`` keeps the plain-torch path. CPU reads
    :func:`cpu_lora_choice` instead.

    Raises:
        ValueError: on another value (naming the variable when it came from there).
    """
    return flag_or_env_choice(value, "kernel", "KVFLOW_LORA_KERNEL", "triton",
                               LORA_KERNEL_CHOICES)


# The CPU-only kernel variables documented above, in that order: the string choices (any
# value set asks a CPU engine for something) and the switches (only "1" does: "0" is what an
# engine on another device does anyway). KVFLOW_NATIVE_CPU is neither: its "1" is the default
# and its "0" (no native CPU kernels) what another device does anyway.
_CPU_CHOICE_VARIABLES = ("KVFLOW_CPU_GEMM", "KVFLOW_CPU_ATTENTION", "KVFLOW_CPU_GGUF",
                         "KVFLOW_CPU_QUANT", "KVFLOW_CPU_ISA", "KVFLOW_CPU_LORA")
_CPU_SWITCH_VARIABLES = ("KVFLOW_CPU_GEMM_POOL", "KVFLOW_CPU_ADAPTIVE_THREADS")


def cpu_only_environment() -> list[str]:
    """The CPU-only kernel variables set (``NAME='value'``) to something only a CPU engine
    acts on: ``KVFLOW_CPU_GEMM``, ``KVFLOW_CPU_ATTENTION``, ``KVFLOW_CPU_GGUF``,
    ``KVFLOW_CPU_QUANT``, ``KVFLOW_CPU_ISA`` and ``KVFLOW_CPU_LORA`` (any non-empty value), ``KVFLOW_CPU_GEMM_POOL``
    and ``KVFLOW_CPU_ADAPTIVE_THREADS`` (``1``). An engine on another device warns about them
    at start-up (``kvflow.core.unread_options``): a variable may be set machine-wide, so it is
    not refused as the matching option is."""
    given = [(name, os.environ.get(name)) for name in _CPU_CHOICE_VARIABLES]
    given += [(name, os.environ.get(name)) for name in _CPU_SWITCH_VARIABLES
              if os.environ.get(name) == "1"]
    return [f"{name}={value!r}" for name, value in given if value]


def cuda_only_environment(device_type: str, attention_backend: str) -> list[str]:
    """The CUDA kernel variables set (``NAME='value'``) that an engine on ``device_type``
    with ``attention_backend`` does not read: ``KVFLOW_FUSED_KERNELS=1`` without the
    ``triton`` attention backend (whose fused rotary + store it asks for; on a CPU that
    backend runs in Triton's interpreter and reads it), ``KVFLOW_LORA_KERNEL`` other than
    ``torch`` off CUDA (the grouped LoRA matmul; every other device runs plain torch). The
    mirror of :func:`cpu_only_environment`, warned about at start-up by
    ``kvflow.core.unread_options``."""
    given = [("KVFLOW_FUSED_KERNELS", ("", "0"), attention_backend != "triton"),
             ("KVFLOW_LORA_KERNEL", ("", "torch"), device_type != "cuda")]
    return [f"{name}={os.environ[name]!r}" for name, anyway, unread in given
            if unread and os.environ.get(name, "") not in anyway]


def fused_kernels_enabled() -> bool:
    """Whether the Triton (CUDA) attention backend runs kvflow's fused kernels (rotary
    embedding + KV-cache store in one launch, ``kvflow/kernels/rotary_kv_store.py``):
    ``$KVFLOW_FUSED_KERNELS`` = ``1``; ``0`` or unset keeps the separate kernels (the default
    until an H200 run of benchmarks/gpu_check.sh has measured both). The CPU backends ignore it.

    Raises:
        ValueError: on another value.
    """
    value = os.environ.get("KVFLOW_FUSED_KERNELS", "0")
    if value not in ("0", "1"):
        raise ValueError(f"KVFLOW_FUSED_KERNELS={value!r} is invalid; choose 0 or 1")
    return value == "1"
