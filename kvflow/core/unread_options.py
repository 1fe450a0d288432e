"""Options an engine would accept and never read in some setup, refused at start-up instead
(kvflow's rule: a setting is honoured or refused with a ValueError naming it, never ignored).
Environment variables, which may be set machine-wide, are warned about instead
(:func:`unread_setting_warnings`), once per engine.

Each check runs as soon as the engine core knows what decides it (the platform, the model's
architecture), before any worker loads weights.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from kvflow.config import (
    EngineConfig,
    cpu_adaptive_threads_choice,
    cpu_only_environment,
    cuda_only_environment,
)
from kvflow.models.gguf_moe import MOE_ARCHITECTURES
from kvflow.models.registry import get_model_class, is_multimodal
from kvflow.platforms import Platform
from kvflow.worker.deterministic import unread_environment

logger = logging.getLogger(__name__)


def check_cpu_only_options(config: EngineConfig, platform: Platform) -> None:
    """On a device other than the CPU, refuse the CPU-only options given (threads, CPU kernels,
    a draft model's ``draft_cpu_threads``): only a CPU runner reads them.

    Raises:
        ValueError: naming each such option and the platform.
    """
    if platform.device_type == "cpu":
        return
    given = config.device_config.cpu_only_options()
    spec = config.speculative_config
    if spec is not None and spec.draft_cpu_threads is not None:
        given.append(f"speculative_config draft_cpu_threads={spec.draft_cpu_threads}")
    if given:
        them = "them" if len(given) > 1 else "it"
        raise ValueError(f"{', '.join(given)}: CPU-only option{'s' if len(given) > 1 else ''}, "
                         f"which an engine on {platform.name} does not read; leave {them} out "
                         "(or run with --device cpu)")


def unread_setting_warnings(config: EngineConfig, platform: Platform) -> list[str]:
    """One line per kind of setting this engine will not read, to warn about rather than
    refuse: on a device other than the CPU, the CPU-only kernel variables set
    (:func:`kvflow.config.cpu_only_environment`), the CUDA kernel variables this engine does
    not read (:func:`kvflow.config.cuda_only_environment`); under ``--deterministic``, the CPU kernel
    variables it does not read (``worker/deterministic.py: unread_environment``) and
    ``--cpu-adaptive-threads`` (or ``KVFLOW_CPU_ADAPTIVE_THREADS=1``), which it turns off."""
    warnings = []
    cpu_vars = cpu_only_environment() if platform.device_type != "cpu" else []
    if cpu_vars:
        warnings.append(f"{', '.join(cpu_vars)}: CPU-only setting{'s' * (len(cpu_vars) > 1)}, "
                        f"which an engine on {platform.name} does not read; unset "
                        f"{'them' if len(cpu_vars) > 1 else 'it'} (or run with --device cpu)")
    backend = config.device_config.attention_backend or platform.default_attention_backend
    cuda_vars = cuda_only_environment(platform.device_type, backend)
    if cuda_vars:
        warnings.append(f"{', '.join(cuda_vars)}: CUDA kernel setting{'s' * (len(cuda_vars) > 1)}"
                        f", which this engine ({platform.name}, attention backend {backend}) "
                        f"does not read; unset {'them' if len(cuda_vars) > 1 else 'it'}")
    dc = config.device_config
    if dc.deterministic:
        warnings += unread_environment(config, platform.device_type)
        if platform.device_type == "cpu" and cpu_adaptive_threads_choice(dc.cpu_adaptive_threads):
            warnings.append("--cpu-adaptive-threads is off: not available with --deterministic")
    return warnings


def warn_unread_settings(config: EngineConfig, platform: Platform) -> None:
    """Log :func:`unread_setting_warnings` once per engine: by the engine core (not by each
    worker rank: pipeline or tensor parallelism starts several) of data-parallel replica 0
    only (every replica runs an engine core with the same configuration and environment)."""
    if config.parallel_config.data_parallel_rank == 0:
        for warning in unread_setting_warnings(config, platform):
            logger.warning(warning)


def unread_model_setting_warnings(config: EngineConfig, hf_config: Any) -> list[str]:
    """Like :func:`unread_setting_warnings`, the variables this engine will not read once its
    model's config is known: ``KVFLOW_GGUF_MOE`` set to anything but its default
    ``quantized`` (:func:`kvflow.config.gguf_moe_experts_choice`, read only when
    ``--quantization gguf`` loads an MoE GGUF file) for any other model or quantization."""
    value = os.environ.get("KVFLOW_GGUF_MOE", "quantized")
    arch = (getattr(hf_config, "architectures", None) or ["this model"])[0]
    gguf = config.model_config.quantization == "gguf"
    if value == "quantized" or (gguf and arch in MOE_ARCHITECTURES):
        return []
    why = f"{arch} is not a mixture-of-experts GGUF model" if gguf else \
        "the model is not loaded with --quantization gguf"
    return [(f"KVFLOW_GGUF_MOE={value!r} has no effect: it chooses how --quantization gguf "
             f"holds an MoE GGUF file's experts, and {why}; unset it")]


def warn_unread_model_settings(config: EngineConfig, hf_config: Any) -> None:
    """Log :func:`unread_model_setting_warnings` once per engine (data-parallel replica 0's
    engine core, as :func:`warn_unread_settings`)."""
    if config.parallel_config.data_parallel_rank == 0:
        for warning in unread_model_setting_warnings(config, hf_config):
            logger.warning(warning)


def check_no_kv_cache_settings(config: EngineConfig, hf_config: Any) -> None:
    """For an encoder-only model, which keeps no KV cache (its stand-in pool is sized from the
    step budget: ``encoder_kv_cache_config``), refuse the settings that size or shape one.

    Raises:
        ValueError: naming each such setting given (``num_kv_blocks``, ``kv_cache_memory``,
            ``gpu_memory_utilization``, a ``kv_cache_dtype`` other than auto,
            ``enable_prefix_caching=True``; False asks for what an encoder does;
            a ``prefix_caching_hash_algo`` other than blake2b;
            ``enable_chunked_prefill=True`` and a ``long_prefill_token_threshold``: an
            encoder runs each prompt whole) and the architecture.
    """
    cc = config.cache_config
    given = [f"{name}={getattr(cc, name)!r}" for name in
             ("num_kv_blocks", "kv_cache_memory", "gpu_memory_utilization")
             if getattr(cc, name) is not None]
    given += [f"kv_cache_dtype={cc.kv_cache_dtype!r}"] if cc.kv_cache_dtype != "auto" else []
    given += ["enable_prefix_caching=True"] if cc.enable_prefix_caching else []
    given += [f"prefix_caching_hash_algo={cc.prefix_caching_hash_algo!r}"] \
        if cc.prefix_caching_hash_algo != "blake2b" else []  # no block is ever hashed
    sc = config.scheduler_config
    given += ["enable_chunked_prefill=True"] if sc.enable_chunked_prefill else []
    given += [f"long_prefill_token_threshold={sc.long_prefill_token_threshold}"] \
        if sc.long_prefill_token_threshold else []  # it runs prompts whole
    _refuse_unread(given, hf_config, "an encoder-only model, which keeps no KV cache")


def check_prefix_caching_pooling(config: EngineConfig, pooling_type: str | None) -> None:
    """For a decoder embedding model whose pooling needs every prompt token's hidden state
    (``pooling_type`` other than "last", "all" for a token classifier; None: a generating
    engine), refuse ``enable_prefix_caching=True`` and vLLM's hash algorithms: its engine
    keeps prefix caching off, since a cached prefix's tokens would not be run again and their
    hidden states would be missing.

    Raises:
        ValueError: naming ``enable_prefix_caching=True`` (or a ``prefix_caching_hash_algo``
            other than blake2b: no block is hashed) and the pooling.
    """
    if config.cache_config.enable_prefix_caching and pooling_type == "all":
        raise ValueError("enable_prefix_caching=True: this engine classifies every prompt "
                         "token (task='token_classify'), which needs every token's hidden "
                         "state, so a cached prefix would never be reused and prefix caching "
                         "stays off; leave it out")
    algo = config.cache_config.prefix_caching_hash_algo
    if algo != "blake2b" and pooling_type not in (None, "last"):
        raise ValueError(f"prefix_caching_hash_algo={algo!r}: this engine embeds with "
                         f"{pooling_type} pooling, which keeps prefix caching off, so no "
                         "block is hashed; leave it out")
    if config.cache_config.enable_prefix_caching and pooling_type not in (None, "last"):
        raise ValueError(f"enable_prefix_caching=True: this engine embeds with {pooling_type} "
                         "pooling, which needs every prompt token's hidden state, so a cached "
                         "prefix would never be reused and prefix caching stays off (on only "
                         "with last-token pooling); leave it out")


def check_no_image_settings(config: EngineConfig, hf_config: Any) -> None:
    """For a text-only model (no vision encoder), refuse the image settings given: only an
    engine whose model takes images reads them (the API side builds no image processor for a
    text-only model, ``kvflow.multimodal.mm_processor_of_source``, so no URL is fetched and
    no image is decoded or counted).

    Raises:
        ValueError: naming each such setting given (``allowed_media_domains``, the image
            and video limits ``max_image_bytes``, ``max_image_pixels``,
            ``max_images_per_prompt``, ``media_fetch_timeout`` and ``max_videos_per_prompt``
            (or ``limit_mm_per_prompt`` setting them; a video count of 0 is no setting),
            ``media_io_kwargs``, ``max_num_encoder_input_tokens``, ``encoder_cache_size``)
            and the architecture.
    """
    if is_multimodal(hf_config):
        return
    given = config.multimodal_config.image_options()
    _refuse_unread(given, hf_config, "a text-only model, which takes no images")


def check_prompt_embeds_model(config: EngineConfig, task: str, hf_config: Any) -> None:
    """``enable_prompt_embeds`` where nothing would read a prompt's embedding rows: a pooling
    engine (``task`` other than "generate"), or an architecture whose forward takes no
    ``inputs_embeds`` (no ``supports_prompt_embeds``: Gemma 3, DeepSeek) or that takes
    images (its placeholders need token ids).

    Raises:
        ValueError: naming ``enable_prompt_embeds=True`` and the task or architecture.
    """
    if not config.model_config.enable_prompt_embeds:
        return
    if task != "generate":
        raise ValueError(f"enable_prompt_embeds=True is for text generation; this engine runs "
                         f"task={task!r}; leave it out")
    model_cls = get_model_class(getattr(hf_config, "architectures", None))
    if not getattr(model_cls, "supports_prompt_embeds", False) or is_multimodal(hf_config):
        _refuse_unread(["enable_prompt_embeds=True"], hf_config,
                       "a model that takes no prompt embeddings (the Llama-family causal "
                       "LMs do)")


def _refuse_unread(given: list[str], hf_config: Any, kind: str) -> None:
    """Raise the ValueError for settings ``given`` (``name=value``) that a model of ``kind``
    (its architecture named from ``hf_config``) never reads; nothing when none is given."""
    if not given:
        return
    arch = (getattr(hf_config, "architectures", None) or ["this model"])[0]
    them = "them" if len(given) > 1 else "it"
    raise ValueError(f"{', '.join(given)}: {arch} is {kind}, so nothing reads {them}; "
                     f"leave {them} out")
