"""The runner's CPU compute setup: its share of the machine's threads and, per GEMM module,
the kernel its weight is packed for (on CUDA: the batch-invariant GEMMs of --deterministic)."""

from __future__ import annotations

import logging
from collections import Counter

import torch

from kvflow.config import (
    EngineConfig,
    cpu_adaptive_threads_choice,
    cpu_gemm_choice,
    cpu_gemm_pool_choice,
)
from kvflow.distributed.parallel_state import ParallelState
from kvflow.kernels.cpu_native import native_cpu_kernels
from kvflow.kernels.cpu_threads import AdaptiveThreads, CallerPin, configure_cpu_threads
from kvflow.kernels.gemm import (
    GemmWorkspace,
    drop_plain_head_weight,
    on_gemm_path,
    pack_logits_head,
    prepack_gemm_weights,
    widen_half_gemms,
)
from kvflow.kernels.gemm_select import (
    SPLIT_MAX_BYTES,
    candidates_for,
    choose,
    model_graph_margins,
)
from kvflow.kernels.gemm_timing import GemmShape, head_row_classes, row_classes
from kvflow.kernels.gemm_timing_cache import gemm_timings
from kvflow.layers.embedding import VocabParallelEmbedding
from kvflow.layers.linear import LinearBase
from kvflow.platforms import Platform
from kvflow.platforms.cpu_memory import HugePageArena, thp_mode
from kvflow.quant.int8 import Int8EmbeddingMethod
from kvflow.quant.unquantized import UnquantizedEmbeddingMethod
from kvflow.worker.deterministic import CHANGES as DETERMINISTIC_CHANGES
from kvflow.worker.deterministic import CHANGES_CUDA as DETERMINISTIC_CHANGES_CUDA
from kvflow.worker.deterministic import check_all_packed, use_batch_invariant_gemms
from kvflow.worker.step_graphs import cpu_step_graphs_expected

logger = logging.getLogger(__name__)


def configure_runner_threads(config: EngineConfig, parallel: ParallelState
                             ) -> tuple[AdaptiveThreads | None, CallerPin]:
    """Set this CPU rank's torch thread count (and pinning): every rank of every data-parallel
    replica on this machine takes its share of the cores (``--cpu-threads``,
    ``--cpu-threads-bind``, ``--cpu-gemm-pool``). Returns the ``--cpu-adaptive-threads``
    controller (None when off; always off under ``--deterministic``), whose ``before_step``
    runs between steps, and the :class:`~kvflow.kernels.cpu_threads.CallerPin` each model step
    runs in. Why the controller is off is logged once per engine, by rank 0 of data-parallel
    replica 0 (``--deterministic``: by the engine core, ``core/unread_options.py``)."""
    dc = config.device_config
    native_cpu_kernels(dc.native_kernel_flags())  # built here first: a failure names them
    pc, world = config.parallel_config, parallel.world.world_size
    adaptive = cpu_adaptive_threads_choice(dc.cpu_adaptive_threads) and not dc.deterministic
    rank = pc.data_parallel_rank * world + parallel.rank
    threads, pinned, caller = configure_cpu_threads(
        dc.cpu_threads, dc.cpu_threads_bind, rank, pc.data_parallel_size * world,
        cpu_gemm_pool_choice(dc.cpu_gemm_pool), pin_by_default=not adaptive)
    return AdaptiveThreads.create(adaptive, threads, pinned is not None, world,
                                  warn=rank == 0), caller


def choose_gemm_path(model: torch.nn.Module, config: EngineConfig, platform: Platform,
                     device: torch.device, dtype: torch.dtype) -> None:
    """CPU GEMM kernels (kvflow/kernels/gemm.py, gemm_select.py): each GEMM module's weight
    of ``model`` (the target or the draft) packed once for the kernel ``--cpu-gemm`` names
    or, under ``auto``, the one timed fastest for its shape class on this CPU (near-ties at
    decode rows kept for kvflow's GEMM where CPU step graphs will replay the decode steps:
    ``gemm_select.graph_weighted``); without
    either kernel, 16-bit weights are widened to fp32 units where the CPU has no 16-bit
    matmul units."""
    deterministic = config.device_config.deterministic
    if device.type != "cpu":
        if deterministic:  # one Triton GEMM configuration for every batch
            use_batch_invariant_gemms(model)
            logger.info("deterministic mode (batch-invariant kernels): %s",
                        "; ".join(DETERMINISTIC_CHANGES_CUDA))
        return
    kernels = native_cpu_kernels()
    if kernels is not None:
        use_native_embeddings(model, kernels)
        keep_fp32_biases(model)
    choice = "native" if deterministic else cpu_gemm_choice(config.device_config.cpu_gemm)
    candidates = candidates_for(dtype, choice, kernels,
                                platform.prepacks_gemm_weights(dtype))
    if not candidates:
        if not platform.has_native_matmul(dtype):
            switched = widen_half_gemms(model, GemmWorkspace())
            logger.info("no native %s matmul: %d GEMM modules run on fp32 units",
                        dtype, switched)
        return
    counts, arena = _pack_cpu_gemms(model, config, kernels, choice, candidates, dtype)
    logger.info("GEMM kernels (--cpu-gemm %s, %s): %s; %.1f MiB of packed weights advised "
                "onto huge pages (THP mode: %s)", choice, dtype, dict(counts),
                arena.advised_bytes / 2**20, thp_mode())
    if not counts and cpu_gemm_choice(config.device_config.cpu_gemm) != "auto":
        logger.warning("--cpu-gemm %s (or KVFLOW_CPU_GEMM) took no layer of this model: "
                       "quantized layers run their method's kernel, and a dtype neither "
                       "kernel packs runs torch's matmul", choice)
    if deterministic:
        check_all_packed(model)
        logger.info("deterministic mode (batch-invariant kernels): %s",
                    "; ".join(DETERMINISTIC_CHANGES))


def _pack_cpu_gemms(model: torch.nn.Module, config: EngineConfig, kernels, choice: str,
                    candidates, dtype: torch.dtype) -> tuple[Counter[str], HugePageArena]:
    """Pack ``model``'s GEMM weights for :func:`choose_gemm_path` (kvflow's copies side by side
    in a :class:`HugePageArena`): a 16-bit LM head for fp32 logits, then every GEMM module's
    weight for the kernel ``choose`` picks (timed under ``auto``), dropping the head's plain
    table where its packed copy serves the lookups. Returns the modules per kernel and the
    arena (for its advised bytes)."""
    # the prefill class timed at the rows of this engine's prefill calls (its step budget)
    rows = row_classes(config.scheduler_config.max_num_batched_tokens)
    timings = gemm_timings(kernels, rows) if choice == "auto" and len(candidates) > 1 else None
    head = getattr(model, "lm_head", None)
    arena = HugePageArena()  # kvflow's packed weights side by side on huge pages
    if dtype != torch.float32:
        # logits in fp32: the 16-bit LM head's accumulation is never rounded to 16 bits
        pack_logits_head(head, config.scheduler_config.max_num_seqs,
                         None if choice == "onednn" else kernels, arena)
    split = timings is not None and _gemm_weight_bytes(model, dtype) <= SPLIT_MAX_BYTES
    # a oneDNN decode GEMM would cost the step graph: near-ties go to kvflow's GEMM
    graphs = timings is not None and cpu_step_graphs_expected(config)
    # an fp32 LM head only gets the sampled rows (<= max_num_seqs): timed at those classes
    head_weight = getattr(head, "weight", None)
    head_rows = head_row_classes(rows, config.scheduler_config.max_num_seqs)
    # the margin oneDNN must beat at decode rows: this CPU's host time against the model's GEMMs
    margins = model_graph_margins(
        [(GemmShape(w.shape[0], w.shape[1], dtype), head_rows if w is head_weight else None)
         for w in _gemm_weights(model, dtype)],
        candidates, timings, torch.get_num_threads()) if graphs else None
    if margins:
        logger.debug("GEMM choice: oneDNN must beat kvflow's GEMM by %s at decode rows "
                     "(CPU step graphs)", {r: round(1 + m, 3) for r, m in margins.items()})
    counts = prepack_gemm_weights(
        model, config.scheduler_config.max_num_seqs, kernels,
        lambda w: choose(GemmShape(w.shape[0], w.shape[1], dtype), candidates, timings, split,
                         graphs, head_rows if w is head_weight else None, margins),
        dtype, arena)
    if timings is not None:
        timings.save()
    freed = drop_plain_head_weight(model, head) if head is not None else 0
    if freed:
        logger.info("LM head: its plain table freed (%.1f MiB); the head and a tied "
                    "embedding read the packed copy", freed / 2**20)
    return counts, arena


def use_native_embeddings(model: torch.nn.Module, kernels) -> None:
    """Embedding lookups of ``model``'s plain (unquantized) and INT8 tables in one C call
    (:meth:`NativeCpuKernels.embedding`, bit for bit ``F.embedding``;
    :meth:`NativeCpuKernels.int8_embedding`, bit for bit the INT8 method's torch lookup): no
    torch operator in a decode step's forward, so CPU step graphs can record it
    (``worker/cpu_graphs.py``)."""
    for module in model.modules():
        if isinstance(module, VocabParallelEmbedding) and isinstance(
                module.quant_method, (UnquantizedEmbeddingMethod, Int8EmbeddingMethod)):
            module.native_kernels = kernels


def keep_fp32_biases(model: torch.nn.Module) -> None:
    """Keep each 16-bit linear bias of ``model`` in fp32 too (``bias_fp32``, widened once,
    exact): the native GEMMs (packed and INT8) add a float32 bias, and widening it at each call
    is a torch operator, which made CPU step graphs refuse every decode step of a 16-bit model
    with biases (Qwen2's q/k/v). Read by the methods that pass it to those kernels."""
    for module in model.modules():
        bias = getattr(module, "bias", None)
        if isinstance(module, LinearBase) and isinstance(bias, torch.Tensor) \
                and bias.dtype in (torch.bfloat16, torch.float16):
            module.bias_fp32 = bias.detach().float()


def _gemm_weight_bytes(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """Bytes of the 2-D ``dtype`` weights of ``model``'s GEMM modules (what a second packing of
    every one would add)."""
    return sum(m.weight.numel() * m.weight.element_size() for m in model.modules()
               if on_gemm_path(m) and isinstance(getattr(m, "weight", None), torch.Tensor)
               and m.weight.dim() == 2 and m.weight.dtype == dtype)


def _gemm_weights(model: torch.nn.Module, dtype: torch.dtype) -> list[torch.Tensor]:
    """The weights ``prepack_gemm_weights`` will pick a kernel for: each GEMM module's 2-D
    ``dtype`` CPU weight not packed yet (a 16-bit LM head packed for fp32 logits is)."""
    return [m.weight for m in model.modules()
            if on_gemm_path(m) and isinstance(getattr(m, "weight", None), torch.Tensor)
            and m.weight.dim() == 2 and m.weight.dtype == dtype
            and m.weight.device.type == "cpu" and m.packed_weight is None]
