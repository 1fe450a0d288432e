"""Where the model runs and which kernels it uses (``DeviceConfig``); the kernel-choice
readers it checks live in ``kernel_choices.py``."""

from __future__ import annotations

from dataclasses import dataclass

from kvflow.config.cpu_isa import forced_isa_level
from kvflow.config.kernel_choices import (
    CPU_ATTENTION_CHOICES,
    CPU_GEMM_CHOICES,
    cpu_adaptive_threads_choice,
    cpu_attention_choice,
    cpu_gemm_choice,
    cpu_gemm_pool_choice,
    cpu_gguf_choice,
    cpu_lora_choice,
    cpu_quant_choice,
    fused_kernels_enabled,
    lora_kernel_choice,
    native_cpu_choice,
    parse_cpu_list,
)
from kvflow.config.options import check_choices, opt


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
        cpu_lora_choice()
        forced_isa_level()  # a bad KVFLOW_CPU_ISA fails here too
        fused_kernels_enabled()  # the CUDA-only switches too: a CPU engine never reads
        lora_kernel_choice()  # them later, so a typo there went unnoticed
        self._check_native_choices()
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ValueError(f"cpu_threads={self.cpu_threads} must be >= 1")
        for cpus in self.bind_parts():
            if self.cpu_threads is not None and self.cpu_threads != len(cpus):
                raise ValueError(f"cpu_threads={self.cpu_threads} but cpu_threads_bind="
                                 f"{self.cpu_threads_bind!r} names {len(cpus)} "
                                 f"CPU{'s' if len(cpus) != 1 else ''} for a "
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
