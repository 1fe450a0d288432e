"""Where the model runs and which kernels it uses (``DeviceConfig``), plus the kernel-choice
readers for environment variables and the on-disk cache folder."""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass

from kvflow.config.cpu_isa import forced_isa_level
from kvflow.config.options import check_choices, opt


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
    choice = os.environ.get("KVFLOW_CPU_GGUF", "native")
    if choice not in ("native", "torch"):
        raise ValueError(f"KVFLOW_CPU_GGUF={choice!r} is invalid; choose one of "
                         f"['native', 'torch']")
    return choice


def gguf_moe_experts_choice() -> str:
    """How ``--quantization gguf`` holds an MoE GGUF file's experts: ``KVFLOW_GGUF_MOE`` =
    ``quantized`` (the default: each expert's GGML blocks kept as in the file and multiplied
    by the dense GGUF layers' GEMM, ``kvflow/quant/gguf_moe.py``) or ``dequantized``
    (dequantized at load to ``--dtype``, run as float experts: 4-8x the memory). Raises
    ValueError on any other value. Set for any other model or quantization, it is warned
    about at start-up (``kvflow.core.unread_options.unread_model_setting_warnings``)."""
    choice = os.environ.get("KVFLOW_GGUF_MOE", "quantized")
    if choice not in ("quantized", "dequantized"):
        raise ValueError(f"KVFLOW_GGUF_MOE={choice!r} is invalid; choose one of "
                         f"['quantized', 'dequantized']")
    return choice


def cpu_quant_choice() -> str:
    """How weight-only INT8 layers (``--quantization int8``, the INT8 tables of ``int4``)
    multiply on CPU: ``KVFLOW_CPU_QUANT`` = ``native`` (kvflow's C kernel, int8 widened in
    registers; the default) or ``torch`` (torch's ``_weight_int8pack_mm``). Raises ValueError
    on any other value."""
    choice = os.environ.get("KVFLOW_CPU_QUANT", "native")
    if choice not in ("native", "torch"):
        raise ValueError(f"KVFLOW_CPU_QUANT={choice!r} is invalid; choose one of "
                         f"['native', 'torch']")
    return choice


LORA_KERNEL_CHOICES = ("triton", "torch")


def lora_kernel_choice(value: str | None = None) -> str:
    """The grouped LoRA matmul on CUDA: ``value`` if given, else ``$KVFLOW_LORA_KERNEL``, else
    ``triton`` (kvflow's SGMV kernel); ``torch`` keeps the plain-torch path. CPU always runs
    plain torch.

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
                         "KVFLOW_CPU_QUANT", "KVFLOW_CPU_ISA")
_CPU_SWITCH_VARIABLES = ("KVFLOW_CPU_GEMM_POOL", "KVFLOW_CPU_ADAPTIVE_THREADS")


def cpu_only_environment() -> list[str]:
    """The CPU-only kernel variables set (``NAME='value'``) to something only a CPU engine
    acts on: ``KVFLOW_CPU_GEMM``, ``KVFLOW_CPU_ATTENTION``, ``KVFLOW_CPU_GGUF``,
    ``KVFLOW_CPU_QUANT`` and ``KVFLOW_CPU_ISA`` (any non-empty value), ``KVFLOW_CPU_GEMM_POOL``
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


@dataclass
class DeviceConfig:
    device: str = opt("auto", "where to run: auto, cpu, cuda, or an installed plugin "
                       "platform's name (entry points 'kvflow.platform_plugins')")
    attention_backend: str | None = opt(None, "attention backend: torch | cpu | triton | "
                                         "flashinfer (CUDA only, unmeasured; default: the "
                                         "platform's)")
    enforce_eager: bool = opt(False, "disable CUDA graphs and CPU step graphs")
    cpu_gemm: str | None = opt(None, "CPU GEMM kernels: auto (each shape class timed at start, "
                                "cached per CPU), native (kvflow's C GEMM) or onednn "
                                "(default: $KVFLOW_CPU_GEMM, else auto)",
                                choices=[None, *CPU_GEMM_CHOICES])
    cpu_attention: str | None = opt(None, "CPU attention of a batch of whole prompts (the "
                                     "'cpu' backend): auto (kvflow's prefill tiles or torch's "
                                     "SDPA, timed per dtype, head shape and prompt-length "
                                     "class, cached per CPU), native or sdpa (default: "
                                     "$KVFLOW_CPU_ATTENTION, else auto)",
                                     choices=[None, *CPU_ATTENTION_CHOICES])
    deterministic: bool = opt(False, "batch-invariant kernels: a request's temperature-0 "
                              "output (and logits) do not depend on the other requests of "
                              "its batch or on how its prompt was chunked (CPU: kvflow's C "
                              "GEMM for every projection, token-by-token attention; slower; "
                              "so it refuses --cpu-gemm other than native and, without a "
                              "draft model, any --cpu-attention)")
    cpu_threads: int | None = opt(None, "CPU compute threads, at most the CPUs of the "
                                   "affinity mask and the cgroup CPU quota (default: torch's "
                                   "count, capped by those CPUs; the length of "
                                   "--cpu-threads-bind when that is a list)")
    cpu_threads_bind: str | None = opt(None, "pin CPU thread i to the i-th CPU of this list, "
                                        "CPUs of the affinity mask "
                                        "(e.g. 0-3 or 0,2,4,6; one part per worker process "
                                        "with parallelism: 0-3|4-7; 'auto': each worker's "
                                        "share of the affinity mask; 'none': no thread "
                                        "pinned; default: when the threads fill the CPUs, "
                                        "pinned as with 'auto', the engine's own thread only "
                                        "while it runs a step; none with "
                                        "--cpu-adaptive-threads)")
    cpu_gemm_pool: bool | None = opt(None, "share the work of kvflow's C GEMM and paged "
                                     "attention through kvflow's "
                                     "own thread pool, where the calling thread never waits "
                                     "for a worker descheduled by another process (instead of "
                                     "OpenMP threads; same results; default: "
                                     "$KVFLOW_CPU_GEMM_POOL, else off)")
    cpu_adaptive_threads: bool | None = opt(None, "lower the CPU thread count while other "
                                            "processes take the CPUs (measured from the "
                                            "kernel's runqueue wait) and probe back later; "
                                            "off with pinned threads, several worker "
                                            "processes or --deterministic (default: "
                                            "$KVFLOW_CPU_ADAPTIVE_THREADS, else off)")

    def __post_init__(self) -> None:
        check_choices(self)
        cpu_gemm_choice(self.cpu_gemm)  # a bad KVFLOW_CPU_GEMM fails here, before loading
        cpu_attention_choice(self.cpu_attention)  # likewise a bad KVFLOW_CPU_ATTENTION
        cpu_adaptive_threads_choice(self.cpu_adaptive_threads)
        cpu_gemm_pool_choice(self.cpu_gemm_pool)
        cpu_gguf_choice()
        cpu_quant_choice()
        forced_isa_level()  # a bad KVFLOW_CPU_ISA fails here too
        fused_kernels_enabled()  # the CUDA-only switches too: a CPU engine never reads
        lora_kernel_choice()  # them later, so a typo there went unnoticed
        self._check_native_choices()
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ValueError(f"cpu_threads={self.cpu_threads} must be >= 1")
        for cpus in self.bind_parts():
            if self.cpu_threads is not None and self.cpu_threads != len(cpus):
                raise ValueError(f"cpu_threads={self.cpu_threads} but cpu_threads_bind="
                                 f"{self.cpu_threads_bind!r} names {len(cpus)} CPUs for a "
                                 "worker; give one CPU per thread")

    def bind_parts(self) -> list[list[int]]:
        """The CPU ids of each ``|`` part of ``cpu_threads_bind`` (one per worker process), in
        order; [] when it is unset, ``auto`` or ``none``.

        Raises:
            ValueError: naming ``cpu_threads_bind`` for a part that is not a CPU list.
        """
        if self.cpu_threads_bind in (None, "auto", "none"):
            return []
        parts = []
        for part in self.cpu_threads_bind.split("|"):
            try:
                parts.append(parse_cpu_list(part))
            except ValueError as e:
                raise ValueError(f"cpu_threads_bind={self.cpu_threads_bind!r}: {e} "
                                 "(it also takes 'auto' or 'none')") from None
        return parts

    def bind_cpus(self) -> list[int]:
        """Every CPU id ``cpu_threads_bind`` names, its parts together, in order
        (:meth:`bind_parts`)."""
        return [cpu for cpus in self.bind_parts() for cpu in cpus]

    def cpu_only_options(self) -> list[str]:
        """The CPU-only options given here (``name=value``), set to something a CPU engine
        would do: ``cpu_gemm``, ``cpu_attention``, ``cpu_threads``, ``cpu_threads_bind``
        (any value), ``cpu_gemm_pool`` and ``cpu_adaptive_threads`` (True; False is what
        another device does anyway). An engine on another device refuses them, since nothing
        there reads them (``kvflow.core.unread_options``)."""
        given = [f"{name}={getattr(self, name)!r}" for name in
                 ("cpu_gemm", "cpu_attention", "cpu_threads", "cpu_threads_bind")
                 if getattr(self, name) is not None]
        return given + [f"{name}=True" for name in ("cpu_gemm_pool", "cpu_adaptive_threads")
                        if getattr(self, name) is True]

    def native_kernel_flags(self) -> tuple[str, ...]:
        """The options given here that need kvflow's native CPU kernels, as flags
        (``--cpu-gemm native``, ``--cpu-attention native``, ``--cpu-gemm-pool``,
        ``--attention-backend cpu``): named in the warning when the kernels cannot be built
        and torch's run instead (:func:`kvflow.kernels.cpu_native.native_cpu_kernels`).
        Environment settings are not included (that warning reads them itself)."""
        given = (("--cpu-gemm native", self.cpu_gemm == "native"),
                 ("--cpu-attention native", self.cpu_attention == "native"),
                 ("--cpu-gemm-pool", self.cpu_gemm_pool is True),
                 ("--attention-backend cpu", self.attention_backend == "cpu"))
        return tuple(flag for flag, on in given if on)

    def _check_native_choices(self) -> None:
        """A CPU kernel asked for must be one that runs: ``native`` GEMM or attention, the
        GEMM pool and a forced ``KVFLOW_CPU_ISA`` level need the native kernels (not ``KVFLOW_NATIVE_CPU=0``),
        and ``cpu_attention`` chooses within the ``cpu`` attention backend only.

        Raises:
            ValueError: naming the setting that cannot take effect.
        """
        off = "kvflow's native CPU kernels, which KVFLOW_NATIVE_CPU=0 turns off"
        if not native_cpu_choice():
            forced = forced_isa_level()
            if forced is not None:
                raise ValueError(f"KVFLOW_CPU_ISA={forced!r} chooses the build of {off}; "
                                 "unset one of them")
            if cpu_gemm_choice(self.cpu_gemm) == "native":
                raise ValueError(f"cpu_gemm='native' (--cpu-gemm or KVFLOW_CPU_GEMM) needs {off}")
            if cpu_attention_choice(self.cpu_attention) == "native":
                raise ValueError("cpu_attention='native' (--cpu-attention or "
                                 f"KVFLOW_CPU_ATTENTION) needs {off}")
            if cpu_gemm_pool_choice(self.cpu_gemm_pool):
                raise ValueError("cpu_gemm_pool=True (--cpu-gemm-pool or KVFLOW_CPU_GEMM_POOL=1) "
                                 f"shares the work of {off}")
        if self.cpu_attention is not None and self.attention_backend not in (None, "cpu"):
            raise ValueError(f"cpu_attention={self.cpu_attention!r} chooses within the 'cpu' "
                             f"attention backend; attention_backend={self.attention_backend!r} "
                             "does not use it")
