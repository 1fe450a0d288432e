"""Engine configuration: the single source of truth for every knob.

CLI flags are generated from these dataclasses' fields (``add_cli_args`` / ``from_cli_args``),
and ``EngineConfig.from_kwargs`` routes ``LLM(**kwargs)`` to the right sub-config, so a knob is
declared once, with its help text, here.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import re
from dataclasses import dataclass, field, fields
from typing import Any


def _opt(default: Any, help: str, **extra: Any) -> Any:
    return field(default=default, metadata={"help": help, **extra})


_BYTE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(value: str | int) -> int:
    """Parse a memory size such as ``2GiB``, ``512MB`` or ``1073741824`` into bytes.

    Raises:
        ValueError: if the string is not a positive number with an optional unit.
    """
    if isinstance(value, int):
        size = value
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
        unit = m.group(2).lower() if m else None
        if not m or unit not in _BYTE_UNITS:
            raise ValueError(f"cannot parse memory size {value!r}: expected e.g. 2GiB, 512MB")
        size = int(float(m.group(1)) * _BYTE_UNITS[unit])
    if size <= 0:
        raise ValueError(f"memory size {value!r} must be positive")
    return size


def _has_type(value: Any, type_name: str) -> bool:
    """Whether ``value`` fits one name of a field's annotation ("int", "float", ...); names
    this check does not know pass."""
    if type_name == "None":
        return value is None
    if type_name in ("int", "float") and isinstance(value, bool):
        return False
    known = {"int": int, "float": (int, float), "str": str, "bool": bool}
    return type_name not in known or isinstance(value, known[type_name])


def _check_choices(config: Any) -> None:
    """Raise ValueError for a field value of the wrong type (by the field's annotation, e.g.
    ``max_num_seqs=1.5``) or outside the field's declared ``choices``."""
    for f in fields(config):
        choices = f.metadata.get("choices")
        value = getattr(config, f.name)
        type_names = [t.strip() for t in str(f.type).split("|")]
        if not any(_has_type(value, t) for t in type_names):
            raise ValueError(f"{f.name}={value!r} is invalid; it must be "
                             f"{' or '.join(type_names)}")
        if choices is not None and value not in choices:
            raise ValueError(f"{f.name}={value!r} is invalid; choose one of {choices}")


@dataclass
class ModelConfig:
    model: str = _opt("SmolLM2-135M-Instruct",
                      "packaged model name, HF folder, path to a .gguf file, or Hugging Face "
                      "Hub repo id org/name[@revision]")
    download_dir: str | None = _opt(None, "huggingface_hub cache folder for Hub models "
                                    "(default: $HF_HUB_CACHE, else $HF_HOME/hub)")
    tokenizer: str | None = _opt(None, "tokenizer folder (default: the model's own)")
    task: str = _opt("auto", "what the model serves: generate (text), embed (one vector per "
                     "prompt: /v1/embeddings, LLM.embed), or auto (embed for encoder and "
                     "LM-head-less architectures and sentence-transformers folders)",
                     choices=["auto", "generate", "embed"])
    dtype: str = _opt("auto", "compute dtype", choices=["auto", "float32", "bfloat16", "float16"])
    max_model_len: int | None = _opt(None, "context length in tokens (default: the model's)")
    seed: int = _opt(0, "seed for unseeded random sampling and dummy weights")
    load_format: str = _opt("auto", "weights: auto (from files) or dummy (random init)",
                            choices=["auto", "dummy"])
    skip_tokenizer_init: bool = _opt(False, "do not load a tokenizer (token-id prompts only)")
    generation_config: str = _opt("auto", "sampling defaults: auto (temperature, top_p, top_k, "
                                  "min_p, repetition_penalty, max_new_tokens from the model "
                                  "folder's generation_config.json; a request's own values "
                                  "win) or none", choices=["auto", "none"])
    quantization: str | None = _opt(
        None, "weight quantization: none, int8 (weight-only, per channel), int4 (weight-only, "
        "group-wise), fp8 (W8A8: FP8 weights with per-tensor scales, activations per token), "
        "gguf (keep a .gguf file's quantized blocks, dequantized per tile in the GEMM), "
        "compressed-tensors (a pre-quantized FP8/INT8 checkpoint; read from its config.json) "
        "(default: the checkpoint's quantization_config, else none; a .gguf file is "
        "dequantized at load)",
        choices=[None, "none", "int8", "int4", "fp8", "gguf", "compressed-tensors"])
    quantization_group_size: int = _opt(32, "input columns per scale for int4",
                                        choices=[32, 64, 128, 256])

    def __post_init__(self) -> None:
        _check_choices(self)
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len={self.max_model_len} must be >= 1 (or unset for "
                             "the model's own)")


@dataclass
class CacheConfig:
    block_size: int = _opt(16, "tokens per KV-cache block")
    kv_cache_memory: str | int | None = _opt(None, "KV-cache size in bytes, e.g. 2GiB")
    num_kv_blocks: int | None = _opt(None, "KV-cache size in blocks (overrides memory)")
    enable_prefix_caching: bool = _opt(True, "reuse KV blocks of identical prompt prefixes")
    gpu_memory_utilization: float = _opt(0.9, "fraction of GPU memory kvflow may use")
    swap_space: str | int = _opt("4GiB", "host memory per worker for the KV blocks of "
                                 "swapped-out requests (--preemption-mode swap), e.g. 4GiB")
    kv_cache_dtype: str = _opt("auto", "KV-cache element type: auto (the model dtype), int8 or "
                               "fp8_e4m3 (quantized per token and KV head with float32 scales "
                               "beside the blocks: about twice the blocks of a 16-bit cache "
                               "for the same --kv-cache-memory)",
                               choices=["auto", "int8", "fp8_e4m3"])

    def __post_init__(self) -> None:
        _check_choices(self)
        if self.block_size < 1:
            raise ValueError(f"block_size={self.block_size} must be >= 1")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ValueError(f"num_kv_blocks={self.num_kv_blocks} must be >= 2")
        if self.kv_cache_memory is not None:
            parse_bytes(self.kv_cache_memory)
        parse_bytes(self.swap_space)
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization={self.gpu_memory_utilization} "
                             "must be in (0, 1]")


@dataclass
class SchedulerConfig:
    max_num_batched_tokens: int | None = _opt(None, "token budget of one engine step "
                                              "(default: the platform's, 2048 CPU / 4096 CUDA)")
    max_num_seqs: int = _opt(256, "maximum number of running requests")
    policy: str = _opt("fcfs", "waiting-queue order: fcfs, priority (lower first), or fair "
                       "(deficit round robin of tokens over clients, the OpenAI 'user' field or "
                       "API key; priority classes weighted, none starved)",
                       choices=["fcfs", "priority", "fair"])
    target_ttft_ms: float | None = _opt(None, "time-to-first-token target of every request "
                                        "(ms; a request's target_ttft_ms overrides it): "
                                        "admissions skip requests that already missed it "
                                        "while others can still meet theirs (default: none)")
    target_tpot_ms: float | None = _opt(None, "time-per-output-token target of every request "
                                        "(ms; a request's target_tpot_ms overrides it): each "
                                        "step's prefill tokens and admissions are sized from a "
                                        "step-time model fitted online so running requests "
                                        "stay under it (default: none, the fixed budget)")
    admission_control: bool = _opt(False, "kvflow serve: refuse at arrival (503 + Retry-After) "
                                   "a request whose predicted time to first token exceeds "
                                   "its TTFT target (requests without one are admitted)")
    preemption_mode: str = _opt("recompute", "what a preempted request's KV becomes: "
                                "recompute (freed, recomputed on readmission) or swap (copied "
                                "to a host pool of --swap-space and back, when the context is "
                                "long enough for the copies to cost less than recomputing it)",
                                choices=["recompute", "swap"])
    async_scheduling: bool | None = _opt(
        None, "schedule and prepare step N+1 on the host while step N runs on the device, and "
        "fold step N's tokens in after launching N+1 (same outputs); one-rank engines only "
        "(default: the platform's: off on CPU, where the forward pass runs on the calling "
        "thread, and off on CUDA until measured)")

    def __post_init__(self) -> None:
        _check_choices(self)
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens={self.max_num_batched_tokens} must be >= 1")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs={self.max_num_seqs} must be >= 1")
        for name in ("target_ttft_ms", "target_tpot_ms"):
            value = getattr(self, name)
            if value is not None and not 0 < value < float("inf"):
                raise ValueError(f"{name}={value} must be a number of milliseconds > 0")


@dataclass
class MultiModalConfig:
    """Image inputs of vision-language models: where images may come from, how big they may
    be, and how much vision-encoder work one engine step takes on.

    Raises:
        ValueError: from the constructor for a limit below 1 or a malformed domain list.
    """

    allowed_media_domains: str | None = _opt(
        None, "comma-separated host names image URLs may be fetched from over http(s), e.g. "
        "images.example.com,127.0.0.1 (default: none; only data: URLs and in-process images)")
    max_image_bytes: int = _opt(20 * 2**20, "largest encoded image (data URL payload or "
                                "download) in bytes")
    max_image_pixels: int = _opt(4096 * 4096, "largest image in pixels (width x height), "
                                 "checked before the image is decoded")
    max_images_per_prompt: int = _opt(16, "most images one prompt or conversation may carry")
    media_fetch_timeout: float = _opt(10.0, "seconds allowed for fetching one image URL")
    max_num_encoder_input_tokens: int | None = _opt(
        None, "vision-encoder output tokens computed per engine step (an image that does not "
        "fit waits for the next step; one image always runs alone) (default: "
        "max_num_batched_tokens)")
    encoder_cache_size: int = _opt(16384, "image embeddings (in tokens) kept for reuse after "
                                   "the requests that needed them moved on (the encoder runs "
                                   "once per distinct image while it stays cached)")

    def __post_init__(self) -> None:
        _check_choices(self)
        for name in ("max_image_bytes", "max_image_pixels", "max_images_per_prompt",
                     "encoder_cache_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.max_num_encoder_input_tokens is not None and self.max_num_encoder_input_tokens < 1:
            raise ValueError(f"max_num_encoder_input_tokens={self.max_num_encoder_input_tokens} "
                             "must be >= 1")
        if self.media_fetch_timeout <= 0:
            raise ValueError(f"media_fetch_timeout={self.media_fetch_timeout} must be > 0")
        self.media_domains()  # a malformed list fails at start-up

    def media_domains(self) -> frozenset[str]:
        """The allowed host names, lower-cased (empty: no remote fetching).

        Raises:
            ValueError: for an entry that is not a plain host name (with a scheme, path or
                port).
        """
        hosts = [h.strip().lower() for h in (self.allowed_media_domains or "").split(",")]
        for host in hosts:
            if host and not re.fullmatch(r"[a-z0-9.-]+", host):
                raise ValueError(f"allowed_media_domains entry {host!r} is not a host name "
                                 "(no scheme, port or path)")
        return frozenset(h for h in hosts if h)


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


CPU_GEMM_CHOICES = ("auto", "native", "onednn")


def cpu_gemm_choice(value: str | None = None) -> str:
    """The CPU GEMM kernels asked for: ``value`` (``--cpu-gemm``) if given, else
    ``$KVFLOW_CPU_GEMM``, else ``auto`` (timed per shape class at start); ``native`` is kvflow's
    C GEMM, ``onednn`` oneDNN's packed GEMM.

    Raises:
        ValueError: on another value (naming the flag or variable it came from).
    """
    name, choice = ("cpu_gemm", value) if value is not None else \
        ("KVFLOW_CPU_GEMM", os.environ.get("KVFLOW_CPU_GEMM", "auto"))
    if choice not in CPU_GEMM_CHOICES:
        raise ValueError(f"{name}={choice!r} is invalid; choose one of {list(CPU_GEMM_CHOICES)}")
    return choice


def parse_cpu_list(spec: str) -> list[int]:
    """``"0-3,6,8-9"`` -> [0, 1, 2, 3, 6, 8, 9] (the Linux cpulist format, order kept).

    Raises:
        ValueError: on anything else (empty, negative, a reversed range, a repeated CPU).
    """
    cpus: list[int] = []
    for part in spec.split(","):
        lo, sep, hi = part.strip().partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"cpu list {spec!r} is invalid: expected e.g. 0-3,6")
        first, last = int(lo), int(hi) if sep else int(lo)
        if last < first:
            raise ValueError(f"cpu list {spec!r} has a reversed range {part.strip()!r}")
        cpus.extend(range(first, last + 1))
    if len(set(cpus)) != len(cpus):
        raise ValueError(f"cpu list {spec!r} names a CPU twice")
    return cpus


def cpu_gguf_choice() -> str:
    """How GGUF weights kept quantized multiply on CPU: ``KVFLOW_CPU_GGUF`` = ``native``
    (kvflow's dequantize-in-the-GEMM C kernel, the default) or ``torch`` (dequantize tiles in
    plain torch, then torch's GEMM). Raises ValueError on any other value."""
    choice = os.environ.get("KVFLOW_CPU_GGUF", "native")
    if choice not in ("native", "torch"):
        raise ValueError(f"KVFLOW_CPU_GGUF={choice!r} is invalid; choose one of "
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
    name, choice = ("kernel", value) if value is not None else \
        ("KVFLOW_LORA_KERNEL", os.environ.get("KVFLOW_LORA_KERNEL", "triton"))
    if choice not in LORA_KERNEL_CHOICES:
        raise ValueError(f"{name}={choice!r} is invalid; choose one of "
                         f"{list(LORA_KERNEL_CHOICES)}")
    return choice


@dataclass
class DeviceConfig:
    device: str = _opt("auto", "where to run: auto, cpu, cuda, or an installed plugin "
                       "platform's name (entry points 'kvflow.platform_plugins')")
    attention_backend: str | None = _opt(None, "attention backend: torch | cpu | triton (default: "
                                         "the platform's)")
    enforce_eager: bool = _opt(False, "disable CUDA graphs")
    cpu_gemm: str | None = _opt(None, "CPU GEMM kernels: auto (each shape class timed at start, "
                                "cached per CPU), native (kvflow's C GEMM) or onednn "
                                "(default: $KVFLOW_CPU_GEMM, else auto)",
                                choices=[None, *CPU_GEMM_CHOICES])
    cpu_threads: int | None = _opt(None, "CPU compute threads (default: torch's count, capped by "
                                   "the CPUs of the affinity mask and the cgroup CPU quota; "
                                   "the length of --cpu-threads-bind when that is a list)")
    cpu_threads_bind: str | None = _opt(None, "pin CPU thread i to the i-th CPU of this list "
                                        "(e.g. 0-3 or 0,2,4,6; one part per worker process "
                                        "with parallelism: 0-3|4-7; 'auto': each worker's "
                                        "share of the affinity mask; default: not pinned)")

    def __post_init__(self) -> None:
        _check_choices(self)
        cpu_gemm_choice(self.cpu_gemm)  # a bad KVFLOW_CPU_GEMM fails here, before loading
        cpu_gguf_choice()
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ValueError(f"cpu_threads={self.cpu_threads} must be >= 1")
        if self.cpu_threads_bind not in (None, "auto"):
            for part in self.cpu_threads_bind.split("|"):
                cpus = parse_cpu_list(part)
                if self.cpu_threads is not None and self.cpu_threads != len(cpus):
                    raise ValueError(f"cpu_threads={self.cpu_threads} but cpu_threads_bind="
                                     f"{self.cpu_threads_bind!r} names {len(cpus)} CPUs for a "
                                     "worker; give one CPU per thread")


@dataclass
class ParallelConfig:
    """How one model is spread over processes and devices (vLLM's names and semantics).

    The world of one engine is ``pipeline_parallel_size x context_parallel_size x
    tensor_parallel_size`` worker processes, rank ``= (pp_rank * cp + cp_rank) * tp + tp_rank``
    (TP innermost, so a TP group is a run of neighbouring ranks: one machine's GPUs). Data
    parallelism runs ``data_parallel_size`` such engines side by side (``kvflow serve`` or the
    offline ``LLM``), each with a world of its own; ``data_parallel_rank`` is the replica's
    index, set by kvflow for each replica.

    Raises:
        ValueError: from the constructor for a size < 1, context parallelism with pipeline
            or expert parallelism, an unknown executor backend, ``ray`` without Ray installed,
            ``uni`` with more than one rank, or a data-parallel rank outside the replicas.
    """

    tensor_parallel_size: int = _opt(1, "tensor-parallel ranks: each layer's heads and MLP "
                                     "columns are split over them (one all-reduce after "
                                     "attention and after the MLP)")
    pipeline_parallel_size: int = _opt(1, "pipeline stages: contiguous layer ranges, hidden "
                                       "states sent from stage to stage")
    data_parallel_size: int = _opt(1, "data-parallel engine replicas behind one server or "
                                   "LLM: each a whole engine (with its own tensor/pipeline "
                                   "ranks) in its own process; requests go to the replica "
                                   "holding their prefix unless it is much busier, else to "
                                   "the least loaded")
    context_parallel_size: int = _opt(1, "context-parallel ranks: every sequence's KV cache "
                                      "is split over them by token (position p on rank p mod "
                                      "N) and each rank attends to its part, merged by "
                                      "log-sum-exp; block_size must be a multiple of N")
    enable_expert_parallel: bool = _opt(False, "MoE layers: place whole experts on the "
                                        "tensor-parallel ranks instead of splitting every "
                                        "expert")
    distributed_executor_backend: str | None = _opt(
        None, "how ranks run: uni (in-process, one rank), mp (one process per rank on this "
        "machine), ray (one Ray actor per rank, several machines) (default: uni for one rank, "
        "else mp)", choices=[None, "uni", "mp", "ray"])
    data_parallel_rank: int = _opt(0, "this engine's replica index (set by the server for "
                                   "each replica)", cli=False)

    def __post_init__(self) -> None:
        _check_choices(self)
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size",
                     "context_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if not 0 <= self.data_parallel_rank < self.data_parallel_size:
            raise ValueError(f"data_parallel_rank={self.data_parallel_rank} is outside the "
                             f"{self.data_parallel_size} data-parallel replicas")
        cp = self.context_parallel_size
        if cp > 1 and (self.pipeline_parallel_size > 1 or self.enable_expert_parallel):
            raise ValueError(f"context_parallel_size={cp} combines with tensor parallelism "
                             "only, not with pipeline_parallel_size > 1 or "
                             "enable_expert_parallel (not available)")
        if self.distributed_executor_backend == "ray" and importlib.util.find_spec("ray") is None:
            raise ValueError("distributed_executor_backend='ray' needs Ray, which is not "
                             "installed: pip install 'kvflow[ray]'")
        if self.distributed_executor_backend == "uni" and self.world_size > 1:
            raise ValueError(f"distributed_executor_backend='uni' runs one rank, but "
                             f"the engine has {self.world_size} (tensor x pipeline x context "
                             "parallel); use mp or ray")

    @property
    def world_size(self) -> int:
        """Worker processes of one engine (tensor x pipeline x context parallel; each
        data-parallel replica is an engine of its own)."""
        return self.tensor_parallel_size * self.pipeline_parallel_size * \
            self.context_parallel_size

    @property
    def executor_backend(self) -> str:
        """The backend in use: the configured one, else ``uni`` for one rank, else ``mp``."""
        if self.distributed_executor_backend is not None:
            return self.distributed_executor_backend
        return "uni" if self.world_size == 1 else "mp"

    def verify_with_model(self, hf_config: Any) -> None:
        """Check that the model splits over these sizes (before any worker starts).

        Args:
            hf_config: the model's HF config (attention/KV heads, layers, MLP and expert sizes).

        Raises:
            ValueError: one line naming the first size that does not divide (heads, KV heads,
                MLP width, experts) or a pipeline longer than the model's layers.
        """
        tp, pp = self.tensor_parallel_size, self.pipeline_parallel_size
        layers = getattr(hf_config, "num_hidden_layers", None)
        if layers is not None and pp > layers:
            raise ValueError(f"pipeline_parallel_size={pp} exceeds the model's {layers} layers")
        for name, value, note in _tp_divisions(hf_config, tp, self.enable_expert_parallel):
            if value and value % tp:
                raise ValueError(f"tensor_parallel_size={tp} does not divide the model's "
                                 f"{name}={value}{note}")
        kv_heads = getattr(hf_config, "num_key_value_heads", None)
        if kv_heads and kv_heads < tp and tp % kv_heads:
            raise ValueError(f"tensor_parallel_size={tp} is not a multiple of the model's "
                             f"num_key_value_heads={kv_heads} (a KV head is replicated on a "
                             "whole number of ranks)")


def _tp_divisions(hf_config: Any, tp: int, expert_parallel: bool
                  ) -> list[tuple[str, Any, str]]:
    """(config field, value, note) of every size that ``tp`` ranks split evenly. KV heads
    split when there are at least ``tp`` of them (fewer are replicated); with expert
    parallelism experts are placed whole, so their count must divide, not their width."""
    def get(name: str) -> Any:
        return getattr(hf_config, name, None)

    out = [("num_attention_heads", get("num_attention_heads"), "")]
    kv_heads = get("num_key_value_heads")
    if kv_heads and kv_heads >= tp:
        out.append(("num_key_value_heads", kv_heads, ""))
    all_experts_mlp = get("num_local_experts") is not None  # Mixtral: every MLP is experts
    if not (all_experts_mlp and expert_parallel):
        out.append(("intermediate_size", get("intermediate_size"), ""))
    experts = get("num_local_experts") or get("num_experts")
    if experts and expert_parallel:
        out.append(("number of experts", experts, " (expert parallel places whole experts)"))
    elif experts:
        out.append(("moe_intermediate_size", get("moe_intermediate_size"), ""))
    out.append(("shared_expert_intermediate_size", get("shared_expert_intermediate_size"), ""))
    return out


SPEC_METHODS = ("ngram", "draft_model")


@dataclass
class SpeculativeConfig:
    """Speculative decoding (``--speculative-config`` JSON / ``LLM(speculative_config=...)``,
    vLLM's keys): a proposer guesses up to ``num_speculative_tokens`` next tokens per request,
    the target model checks them all in one step, and rejection sampling keeps exactly the
    tokens the target would have produced (see kvflow/spec_decode/).

    Attributes:
        method: ``ngram`` (prompt lookup: the tokens that followed the latest earlier occurrence
            of the last n tokens; no model) or ``draft_model`` (a smaller model sharing the
            target's tokenizer).
        num_speculative_tokens: most draft tokens per request and step (K).
        model: the draft model (``draft_model``): a packaged name, HF folder, GGUF or Hub id.
        prompt_lookup_max / prompt_lookup_min: n-gram sizes tried, longest first (``ngram``).
        quantization: the draft model's weight quantization (int8, int4; default: none). Only
            the draft's speed changes: verification keeps the target's output exact.
        adaptive: choose each request's K per step from its running acceptance rate and a
            measured step-cost model (speculation off when verification costs more than it
            saves); False: always ``num_speculative_tokens`` when the proposer has them.

    Raises:
        ValueError: from the constructor for an unknown method, a missing draft model, or a
            size out of range.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    model: str | None = None
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    quantization: str | None = None
    adaptive: bool = True

    def __post_init__(self) -> None:
        try:
            _check_choices(self)
        except ValueError as e:
            raise ValueError(f"speculative_config {e}") from None
        if self.method not in SPEC_METHODS:
            raise ValueError(f"speculative_config method={self.method!r} is invalid; choose "
                             f"one of {list(SPEC_METHODS)}")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(f"speculative_config num_speculative_tokens="
                             f"{self.num_speculative_tokens} must be in [1, 16]")
        if self.method == "draft_model" and not self.model:
            raise ValueError("speculative_config method='draft_model' needs 'model' (the "
                             "draft model's name or path)")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(f"speculative_config prompt_lookup_min={self.prompt_lookup_min} "
                             f"and prompt_lookup_max={self.prompt_lookup_max} need "
                             "1 <= min <= max")
        if self.quantization not in (None, "none", "int8", "int4"):
            raise ValueError(f"speculative_config quantization={self.quantization!r} is "
                             "invalid; choose int8, int4 or none")

    @classmethod
    def from_value(cls, value: SpeculativeConfig | dict | str | None
                   ) -> SpeculativeConfig | None:
        """A config from a dict, a JSON object string (the flag's form) or None (off).

        Raises:
            ValueError: for text that is not a JSON object, or an unknown key (named).
        """
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value) if value.strip() else None
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from e
            if value is None:
                return None
        if not isinstance(value, dict):
            raise ValueError(  # noqa: TRY004 (bad input is a ValueError throughout kvflow)
                "speculative_config must be a JSON object such as "
                '{"method": "ngram", "num_speculative_tokens": 4}')
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config has unknown key(s) {unknown}; valid: "
                             f"{sorted(known)}")
        return cls(**value)


@dataclass
class LoRAConfig:
    """Multi-LoRA serving (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language
    Models"): PEFT adapters applied per request on top of the base weights.

    Raises:
        ValueError: from the constructor for a count or rank < 1.
    """

    enable_lora: bool = _opt(False, "serve LoRA adapters (PEFT folders) on top of the model")
    max_loras: int = _opt(1, "distinct LoRA adapters one engine step may use (each holds a "
                          "slot of device memory)")
    max_lora_rank: int = _opt(16, "largest adapter rank accepted (slots are sized for it)")

    def __post_init__(self) -> None:
        _check_choices(self)
        for name in ("max_loras", "max_lora_rank"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")

    def verify_with_parallel(self, parallel: ParallelConfig) -> None:
        """LoRA runs on one rank of one engine only (its layers are not sharded yet; adapters
        are not loaded on data-parallel replicas yet).

        Raises:
            ValueError: with LoRA enabled and more than one tensor- or pipeline-parallel rank,
                or more than one data-parallel replica.
        """
        if self.enable_lora and parallel.data_parallel_size > 1:
            raise ValueError("enable_lora needs data_parallel_size=1: adapters are not loaded "
                             "on data-parallel replicas yet")
        if self.enable_lora and parallel.world_size > 1:
            raise ValueError("enable_lora needs tensor_parallel_size=1 and "
                             "pipeline_parallel_size=1: LoRA layers are not sharded over ranks "
                             "yet")


_SECTIONS = {"model_config": ModelConfig, "cache_config": CacheConfig,
             "scheduler_config": SchedulerConfig, "device_config": DeviceConfig,
             "parallel_config": ParallelConfig, "multimodal_config": MultiModalConfig,
             "lora_config": LoRAConfig}


@dataclass
class EngineConfig:
    """All configuration of one engine instance."""

    model_config: ModelConfig = field(default_factory=ModelConfig)
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    device_config: DeviceConfig = field(default_factory=DeviceConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    multimodal_config: MultiModalConfig = field(default_factory=MultiModalConfig)
    speculative_config: SpeculativeConfig | None = None
    lora_config: LoRAConfig = field(default_factory=LoRAConfig)

    def __post_init__(self) -> None:
        """Checks across sections (``speculative_config`` given as a dict or JSON string
        becomes a SpeculativeConfig).

        Raises:
            ValueError: for context parallelism with a block size it does not divide or a
                quantized KV cache; for speculative decoding with pipeline or context
                parallelism or async scheduling; for LoRA with more than one rank or
                replica.
        """
        self._check_speculative()
        self.lora_config.verify_with_parallel(self.parallel_config)
        cp, cc = self.parallel_config.context_parallel_size, self.cache_config
        if cp > 1 and cc.block_size % cp:
            raise ValueError(f"block_size={cc.block_size} must be a multiple of "
                             f"context_parallel_size={cp} (each rank holds block_size / {cp} "
                             "tokens of every block)")
        if cp > 1 and cc.kv_cache_dtype != "auto":
            raise ValueError(f"kv_cache_dtype={cc.kv_cache_dtype!r} is not available with "
                             f"context_parallel_size={cp}")

    def _check_speculative(self) -> None:
        spec = self.speculative_config = SpeculativeConfig.from_value(self.speculative_config)
        if spec is None:
            return
        pc = self.parallel_config
        for name in ("pipeline_parallel_size", "context_parallel_size"):
            if getattr(pc, name) > 1:
                raise ValueError(f"speculative decoding with {name} > 1 is not available (the "
                                 "draft tokens would have to reach every rank's sampler)")
        if self.scheduler_config.async_scheduling:
            raise ValueError("speculative decoding with async_scheduling is not available (a "
                             "verification step's token counts are known only after it)")
        if spec.method == "draft_model" and pc.tensor_parallel_size > 1:
            raise ValueError("speculative_config method='draft_model' runs the draft in the "
                             "target's process: tensor_parallel_size must be 1")
        if spec.method == "draft_model" and self.scheduler_config.preemption_mode == "swap":
            raise ValueError("speculative_config method='draft_model' with preemption_mode="
                             "'swap' is not available (the host swap pool holds the target's "
                             "KV layout only); use preemption_mode='recompute'")

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """Build from flat keyword arguments (``LLM(model=..., block_size=...)``);
        ``speculative_config`` takes a dict, a JSON string or a SpeculativeConfig.

        Raises:
            ValueError: on an unknown keyword, listing the valid ones, or a bad value.
        """
        speculative = kwargs.pop("speculative_config", None)
        parts: dict[str, dict[str, Any]] = {name: {} for name in _SECTIONS}
        owner = {f.name: sec for sec, c in _SECTIONS.items() for f in fields(c)}
        for key, value in kwargs.items():
            if key not in owner:
                raise ValueError(f"unknown engine option {key!r}; valid: "
                                 f"{sorted([*owner, 'speculative_config'])}")
            parts[owner[key]][key] = value
        return cls(**{sec: _SECTIONS[sec](**vals) for sec, vals in parts.items()},
                   speculative_config=speculative)

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        """Add one ``--flag`` per config field (booleans get ``--no-`` forms), and
        ``--speculative-config`` (a JSON object of SpeculativeConfig's fields)."""
        for sec_cls in _SECTIONS.values():
            group = parser.add_argument_group(sec_cls.__name__)
            for f in fields(sec_cls):
                _add_field_arg(group, f)
        keys = ", ".join(f"{f.name} ({f.default})" for f in fields(SpeculativeConfig))
        parser.add_argument_group("SpeculativeConfig").add_argument(
            "--speculative-config", type=str, default=None,
            help="speculative decoding as a JSON object, e.g. '{\"method\": \"ngram\", "
                 "\"num_speculative_tokens\": 4}' or '{\"method\": \"draft_model\", "
                 "\"model\": \"NAME\", \"num_speculative_tokens\": 4}'; keys (defaults): "
                 f"{keys} (default: off)")

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineConfig:
        names = {f.name for c in _SECTIONS.values() for f in fields(c)}
        names.add("speculative_config")
        return cls.from_kwargs(**{k: v for k, v in vars(args).items() if k in names})

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _add_field_arg(group: argparse._ArgumentGroup, f: dataclasses.Field) -> None:
    if not f.metadata.get("cli", True):  # set by kvflow itself, not a user flag
        return
    flag = "--" + f.name.replace("_", "-")
    meta = f.metadata
    if f.type in ("bool", bool, "bool | None"):
        group.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default,
                           help=meta.get("help"))
        return
    kind = {"int": int, "int | None": int, "float": float, "float | None": float}.get(
        str(f.type), str)
    group.add_argument(flag, type=kind, default=f.default, choices=meta.get("choices"),
                       **({"nargs": meta["nargs"]} if "nargs" in meta else {}),
                       help=meta.get("help") if "default" in str(meta.get("help"))
                       else f"{meta.get('help')} (default: {f.default})")


@dataclass
class ServerConfig:
    """Options of ``kvflow serve`` beyond the engine's (flags are generated from these fields).

    Raises:
        ValueError: from the constructor for an out-of-range value.
    """

    host: str = _opt("127.0.0.1", "address the HTTP server listens on")
    port: int = _opt(8000, "TCP port the HTTP server listens on")
    api_key: str | None = _opt(None, "require 'Authorization: Bearer KEY' on every route but "
                               "/health, /metrics and /version; unset: $KVFLOW_API_KEY, if set")
    served_model_name: str | None = _opt(None, "model name clients send; unset: the model "
                                         "argument")
    max_waiting_requests: int | None = _opt(None, "accepted requests that have not produced a "
                                            "token yet beyond which new requests get 503; "
                                            "unset: unlimited")
    max_n: int = _opt(16, "largest n (samples per prompt) one request may ask for")
    max_logprobs: int = _opt(20, "largest logprobs / top_logprobs one request may ask for")
    uvicorn_log_level: str = _opt("info", "HTTP server log level",
                                  choices=["critical", "error", "warning", "info", "debug"])
    engine_start_timeout: float = _opt(600.0, "seconds to wait for the engine process to load "
                                       "the model")
    timeout_keep_alive: float = _opt(20.0, "seconds an idle HTTP keep-alive connection stays "
                                     "open; longer than clients' own idle expiry (httpx 5 s, "
                                     "aiohttp 15 s) so a client never sends on a connection "
                                     "the server is closing")
    engine_failure: str = _opt("exit", "when the engine-core process dies: open streams end "
                               "with an error event and new requests get 503, then the "
                               "server exits with status 1 ('exit') or starts a new engine "
                               "('restart')", choices=["exit", "restart"])
    tool_call_parser: str = _opt("hermes", "how tool calls are read from the output under "
                                 "tool_choice=auto", choices=["hermes", "llama3_json"])
    reasoning_parser: str | None = _opt(None, "split <think>...</think> reasoning into "
                                        "reasoning_content", choices=[None, "think"])
    lora_modules: tuple[str, ...] | None = _opt(None, "LoRA adapters served from start-up, each "
                                                "NAME=PATH (a PEFT folder); requests pick one "
                                                "by model=NAME (needs --enable-lora)",
                                                nargs="+")

    def __post_init__(self) -> None:
        _check_choices(self)
        if self.lora_modules is not None:
            self.lora_modules = tuple(self.lora_modules)
        checks = [(0 <= self.port <= 65535, "port", "must be in [0, 65535]"),
                  (self.max_n >= 1, "max_n", "must be >= 1"),
                  (self.max_logprobs >= 0, "max_logprobs", "must be >= 0"),
                  (self.max_waiting_requests is None or self.max_waiting_requests >= 0,
                   "max_waiting_requests", "must be >= 0"),
                  (self.engine_start_timeout > 0, "engine_start_timeout", "must be > 0"),
                  (self.timeout_keep_alive > 0, "timeout_keep_alive", "must be > 0"),
                  (all("=" in m and m.index("=") > 0 for m in self.lora_modules or []),
                   "lora_modules", "must be NAME=PATH pairs")]
        for ok, name, why in checks:
            if not ok:
                raise ValueError(f"{name}={getattr(self, name)!r} is invalid: it {why}")

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        group = parser.add_argument_group("ServerConfig")
        for f in fields(ServerConfig):
            _add_field_arg(group, f)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace,
                      env: dict[str, str] | None = None) -> ServerConfig:
        """Build from parsed flags; ``--api-key`` falls back to ``KVFLOW_API_KEY`` in ``env``
        (default: the process environment)."""
        values = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}
        if values.get("api_key") is None:
            values["api_key"] = (os.environ if env is None else env).get("KVFLOW_API_KEY") \
                or None
        return cls(**values)
