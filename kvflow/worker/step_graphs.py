"""Which decode-step graph runner an engine gets: CUDA graphs on a GPU that supports them
(``worker/cuda_graphs.py``), recorded native calls on CPU (``worker/cpu_graphs.py``), or none.

Both replay one KV-cache group's block table for batches of single-token queries (the CPU
runner also for speculative decoding's verification steps, every request 1 + k tokens), so
both are off with ``--enforce-eager``, several KV-cache groups, a multimodal model, a pipeline
split or an embedding (pooling) model: it never decodes, an encoder's attention reads
``query_start_loc`` on the host (a sync that breaks CUDA stream capture), and a pooling model
keeps hidden states across steps while a replayed step's live in a static buffer (CUDA) or an
arena (CPU). CUDA graphs are also off for quantized MoE experts (``--quantization int8|fp8|gguf``
on an MoE model): their grouped loop reads each expert's token count on the host, and with
LoRA (its grouped matmul is sized on the host). The CPU runner replays LoRA steps with the
native LoRA kernel (``KVFLOW_CPU_LORA=native``, or ``auto``, the default, where it was timed
faster on this CPU, ``kvflow/lora/cpu_kernel_choice.py``; ``torch`` runs them eagerly), and
also needs the native CPU attention backend with its
work-sharing pool closed, an unquantized KV cache, one tensor-parallel rank and no draft model
other than an EAGLE / EAGLE-3 / MTP head (whose passes run eagerly between the target's steps).
An EAGLE-3 head's taps on the target's layers are returned by the target's forward
(``spec_decode/layer_taps.py``), so both runners replay them into fixed outputs.
"""

from __future__ import annotations

import logging

import torch

from kvflow.config import cpu_gemm_pool_choice, cpu_lora_choice
from kvflow.spec_decode.eagle import EagleDrafter
from kvflow.worker.cpu_graphs import CpuGraphRunner
from kvflow.worker.cuda_graphs import CudaGraphRunner

logger = logging.getLogger(__name__)


def _common_ok(runner) -> bool:
    return not runner.config.device_config.enforce_eager \
        and len(runner.kv_cache_config.kv_cache_groups) == 1 and runner.mm_runner is None \
        and runner.parallel.pp.world_size == 1 and runner.pooling is None


def _cpu_ok(runner) -> bool:
    kernels = getattr(runner.attn_ctx.backend, "_kernels", None)
    return runner.device.type == "cpu" and runner.attn_ctx.backend.name == "cpu" \
        and kernels is not None and (kernels.pool is None or not kernels.pool.is_open) \
        and runner.parallel.tp.world_size == 1 \
        and (runner.drafter is None or isinstance(runner.drafter, EagleDrafter)) \
        and all(cache.dtype == runner.dtype for cache in runner.kv_caches) \
        and (runner.lora_manager is None or runner.lora_manager.cpu_kernel() == "native")


def _host_synced_moe(model: torch.nn.Module) -> str | None:
    """The name of the first quantized MoE experts' method in ``model`` (its loop,
    ``kernels.moe_ref.grouped_experts``, reads the per-expert counts on the host), or None."""
    from kvflow.quant.moe import FusedMoEMethod

    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if isinstance(method, FusedMoEMethod):
            return method.name
    return None


def cpu_step_graphs_expected(config) -> bool:
    """Whether a CPU engine of ``config`` (an EngineConfig) will replay its decode steps as CPU
    step graphs, as far as the config tells before the model loads (what
    ``--cpu-gemm auto`` weighs, ``kernels/gemm_select.py: graph_weighted``): no
    ``--enforce-eager``, LoRA with ``KVFLOW_CPU_LORA=torch`` (``auto`` is counted as
    ``native``: it picks ``torch`` only where the native kernel is timed more than 1.18x slower,
    ``kvflow/lora/cpu_kernel_choice.py``), draft model (an EAGLE / EAGLE-3 / MTP head is fine), pipeline
    or tensor split, quantized KV cache or ``--cpu-gemm-pool``. (A multimodal or pooling
    model, known only once loaded, runs without graphs all the same.)"""
    pc = config.parallel_config
    return not config.device_config.enforce_eager \
        and (not config.lora_config.enable_lora or cpu_lora_choice() != "torch") \
        and (config.speculative_config is None
             or config.speculative_config.method in ("eagle", "eagle3", "deepseek_mtp")) \
        and pc.pipeline_parallel_size == 1 \
        and pc.tensor_parallel_size == 1 and config.cache_config.kv_cache_dtype == "auto" \
        and not cpu_gemm_pool_choice(config.device_config.cpu_gemm_pool)


def make_graph_runner(runner, max_model_len: int) -> CudaGraphRunner | CpuGraphRunner | None:
    """The decode-step graph runner for ``runner`` (a ModelRunner after
    ``initialize_kv_cache``), CUDA graphs already captured; None where none applies or where
    the capture ran out of memory (logged; the steps then run eagerly)."""
    if not _common_ok(runner):
        return None
    max_num_seqs = runner.config.scheduler_config.max_num_seqs
    max_blocks = -(-max_model_len // runner.block_size)
    if runner.platform.supports_graphs and runner.attn_ctx.backend.supports_cuda_graphs:
        if runner.lora_manager is not None:
            return None
        moe = _host_synced_moe(runner.model)
        if moe is not None:
            logger.info("no CUDA graphs: %s MoE experts count their tokens on the host (a "
                        "sync stream capture cannot hold); decode steps run eagerly", moe)
            return None
        graphs = CudaGraphRunner(runner.model, runner.attn_ctx, max_num_seqs, max_blocks,
                                 max_model_len, runner.block_size,
                                 runner.model.config.hidden_size, runner.device, runner.dtype)
        try:
            graphs.capture()
        except torch.OutOfMemoryError as exc:  # the KV cache took the memory budget first
            logger.warning("CUDA graph capture ran out of memory (%s); decode steps run "
                           "eagerly: lower --gpu-memory-utilization to leave room for the "
                           "graphs", exc)
            return None
        logger.info("captured CUDA graphs for decode batch sizes %s", graphs.sizes)
        return graphs
    if _cpu_ok(runner):
        logger.info("CPU step graphs on: decode steps replay their recorded native calls")
        spec = runner.config.speculative_config  # verification steps: 1 + k tokens a row
        return CpuGraphRunner(runner.model, runner.attn_ctx, runner.attn_ctx.backend._kernels,
                              runner.kv_caches, max_num_seqs, max_blocks, runner.block_size,
                              max_query_len=1 + (spec.num_speculative_tokens if spec else 0),
                              lora_ctx=None if runner.lora_manager is None
                              else runner.lora_manager.ctx)
    return None


__all__ = ["cpu_step_graphs_expected", "make_graph_runner"]
