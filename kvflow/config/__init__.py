"""Engine configuration: the single source of truth for every knob.

CLI flags are generated from the section dataclasses' fields (``add_cli_args`` /
``from_cli_args``), and ``EngineConfig.from_kwargs`` routes ``LLM(**kwargs)`` to the right
section, so a knob is declared once, with its help text, in the module of its section:
model, cache, scheduler, device, parallel, multimodal, speculative, lora, server, kv_events
(one file each), the field helpers in options.py and the whole engine's config in engine.py.
"""

from kvflow.config.cache import CacheConfig
from kvflow.config.device import DeviceConfig
from kvflow.config.engine import EngineConfig
from kvflow.config.kernel_choices import (
    CPU_ATTENTION_CHOICES,
    CPU_GEMM_CHOICES,
    LORA_KERNEL_CHOICES,
    cache_dir,
    cpu_adaptive_threads_choice,
    cpu_attention_choice,
    cpu_gemm_choice,
    cpu_gemm_pool_choice,
    cpu_gguf_choice,
    cpu_lora_choice,
    cpu_only_environment,
    cpu_quant_choice,
    cuda_only_environment,
    gguf_moe_experts_choice,
    lora_kernel_choice,
    native_cpu_choice,
    parse_cpu_list,
)
from kvflow.config.kv_events import KVEventsConfig
from kvflow.config.kv_transfer import KVTransferConfig
from kvflow.config.lora import LoRAConfig
from kvflow.config.model import ModelConfig
from kvflow.config.multimodal import MultiModalConfig
from kvflow.config.options import parse_bytes
from kvflow.config.parallel import ParallelConfig
from kvflow.config.scheduler import SchedulerConfig
from kvflow.config.server import ServerConfig
from kvflow.config.speculative import SPEC_METHODS, SpeculativeConfig

__all__ = [
    "CPU_ATTENTION_CHOICES",
    "CPU_GEMM_CHOICES",
    "LORA_KERNEL_CHOICES",
    "SPEC_METHODS",
    "CacheConfig",
    "DeviceConfig",
    "EngineConfig",
    "KVEventsConfig",
    "KVTransferConfig",
    "LoRAConfig",
    "ModelConfig",
    "MultiModalConfig",
    "ParallelConfig",
    "SchedulerConfig",
    "ServerConfig",
    "SpeculativeConfig",
    "cache_dir",
    "cpu_adaptive_threads_choice",
    "cpu_attention_choice",
    "cpu_gemm_choice",
    "cpu_gemm_pool_choice",
    "cpu_gguf_choice",
    "cpu_lora_choice",
    "cpu_only_environment",
    "cpu_quant_choice",
    "cuda_only_environment",
    "gguf_moe_experts_choice",
    "lora_kernel_choice",
    "native_cpu_choice",
    "parse_bytes",
    "parse_cpu_list",
]
