"""The KV-cache half of :class:`kvflow.worker.model_runner.ModelRunner` (its base class): the
layers' cache specs, the memory left for the cache (a profiling run), the tensors bound to the
model's attention layers (and the draft model's), graph capture and the draft's timing."""

from __future__ import annotations

import threading

import numpy as np
import torch

from kvflow.config import parse_bytes
from kvflow.distributed.kv_transfer import make_kv_connector_worker
from kvflow.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, KVCacheSpec
from kvflow.platforms.cpu_memory import stop_prefault
from kvflow.runtime.malloc_env import keep_freed_memory
from kvflow.sampling_params import SamplingParams
from kvflow.spec_decode.draft_timing import time_draft_passes
from kvflow.worker.forward_pass import split_aux_hidden
from kvflow.worker.input_batch import InputBatch
from kvflow.worker.kv_cache_setup import (
    allocate_kv_caches,
    check_kv_cache_config,
    kv_cache_spec,
    local_kv_tensors,
    profile_kv_budget,
    release_kv_cache,
)
from kvflow.worker.kv_swap import HostKVCache, swapped_tensors
from kvflow.worker.model_inputs import build_model_inputs
from kvflow.worker.pipeline_stages import recv_from_previous_stage, send_to_next_stage
from kvflow.worker.request_state import RequestState
from kvflow.worker.step_graphs import make_graph_runner


class RunnerKVCache:
    """KV-cache set-up of the runner; ``ModelRunner`` sets ``model``, ``config``, ``device``,
    ``kv_caches``, ``drafter``, ... which these use."""

    kv_prefault: threading.Thread | None = None  # the KV tensors' prefault thread (CPU)

    # ---- KV cache ----------------------------------------------------------------------------
    def get_kv_cache_spec(self) -> dict[str, KVCacheSpec]:
        """Each attention layer's KV-cache spec (layer name -> spec), in model order, with
        ``--kv-cache-dtype``'s element type (and scales for a quantized cache)."""
        return kv_cache_spec(self.attn_layers, self.drafter, self.block_size,
                             self.config.cache_config.kv_cache_dtype, self.dtype)

    def determine_available_memory(self, kv_cache_groups: tuple[KVCacheGroupSpec, ...]) -> int:
        """Bytes for the KV cache: --kv-cache-memory, else the platform's budget (CPU: 2 GiB;
        GPU: what a profiling forward pass leaves of gpu_memory_utilization; it runs with a
        cache of ``kv_cache_groups`` just big enough for one step)."""
        cc = self.config.cache_config
        if cc.kv_cache_memory is not None:
            return parse_bytes(cc.kv_cache_memory)
        if self.platform.default_kv_cache_bytes is not None:
            return self.platform.default_kv_cache_bytes
        return profile_kv_budget(self.platform, cc.gpu_memory_fraction,
                                 lambda: self.profile_run(kv_cache_groups),
                                 self.config.scheduler_config.max_num_batched_tokens)

    def profile_run(self, kv_cache_groups: tuple[KVCacheGroupSpec, ...]) -> None:
        """One forward pass over max_num_batched_tokens dummy tokens (one request), with a KV
        cache of ``kv_cache_groups`` just big enough for it; measures peak activation memory.
        """
        num_tokens = self.config.scheduler_config.max_num_batched_tokens
        num_blocks = -(-num_tokens // self.block_size)
        self.initialize_kv_cache(KVCacheConfig(num_blocks + 1, kv_cache_groups))
        batch = InputBatch(1, [g.kv_cache_spec for g in kv_cache_groups])
        state = RequestState("profile", [0] * num_tokens, SamplingParams(), None)
        block_ids = list(range(1, num_blocks + 1))
        batch.add_request(state, [], tuple(block_ids for _ in kv_cache_groups), 0)
        inputs = build_model_inputs(batch, np.array([num_tokens]), self.block_size,
                                    self.stager, long_prompt_rope=self.long_prompt_rope)
        with torch.inference_mode():
            hidden, _ = split_aux_hidden(self._forward(
                inputs, recv_from_previous_stage(self.parallel.pp), batch))
            if send_to_next_stage(self.parallel.pp, hidden) and self.pooling is None:
                self.model.compute_logits(hidden[-self.config.scheduler_config.max_num_seqs:])
        self.platform.synchronize()
        self.release_kv_tensors()

    def local_kv_tensors(self, kv_cache_config: KVCacheConfig) -> list[list[tuple[int, str]]]:
        """For each KV tensor ``j`` this rank allocates: the (group, layer name) pairs of its
        own layers that use it. A pipeline stage skips tensors whose layers all live on other
        stages; without pipeline parallelism every tensor is local."""
        return local_kv_tensors(kv_cache_config, self.attn_layers)

    def initialize_kv_cache(self, kv_cache_config: KVCacheConfig) -> None:
        """Allocate one zeroed tensor per layer of a KV-cache group (of this rank's layers),
        shaped as its spec says (``KVCacheSpec.kv_cache_shape``: [2, num_blocks, block_size,
        kv_heads, head_dim] with ``kv_heads`` per TP rank, or MLA's [num_blocks, block_size,
        latent + rope]; a quantized cache adds its float32 scales, ``kv_scales_shape``) and
        bind it: layer ``j`` of every group uses tensor ``j`` (a block id belongs to one group
        at a time, so the groups never write the same slots).

        A draft model's layers (``kv_cache_config.draft_group``) get tensors of their own,
        indexed by group 0's block ids.

        Raises:
            ValueError: if a cache sized by --num-kv-blocks or --kv-cache-memory would not fit
                in the device's free memory, or for a draft model beside several KV-cache
                groups (it reads group 0's block table).
        """
        tensors = self.local_kv_tensors(kv_cache_config)
        check_kv_cache_config(kv_cache_config, self.config.cache_config, self.platform,
                              len(tensors), self.parallel.cp.world_size)
        self.kv_cache_config = kv_cache_config
        max_num_seqs = self.config.scheduler_config.max_num_seqs
        try:  # its rows are mapped zero pages, taken only as requests fill them
            self.input_batch = InputBatch(max_num_seqs, [g.kv_cache_spec for g in
                                                         kv_cache_config.kv_cache_groups])
        except MemoryError:  # numpy's _ArrayMemoryError: a max_num_seqs of 1e9
            raise ValueError(f"max_num_seqs={max_num_seqs}: the runner's rows for that many "
                             "requests do not fit in this machine's memory; lower it") from None
        self.requests = {}
        self.allocate_kv_tensors(kv_cache_config)
        kt, cc = self.config.kv_transfer_config, self.config.cache_config
        if kt is not None:  # --kv-transfer-config: blocks loaded / saved around the forward
            self.kv_connector = make_kv_connector_worker(
                kt, cc.block_size, cc.kv_cache_dtype, self.connector_kv_tensors,
                self.parallel.tp.rank, self.parallel.tp.world_size)
        if self.device.type == "cpu":  # after the weights and the cache: only activations
            keep_freed_memory()        # (each step's) stay in the heap

    def connector_kv_tensors(self) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
        """The KV connector's view of the cache: layer name -> (its K/V tensor [2, blocks,
        block_size, kv_heads, head_dim], its scales [2, blocks, block_size, kv_heads] or
        None), as bound now."""
        return {name: (layer.kv_cache, layer.kv_scales)
                for name, layer in self.attn_layers.items()}

    def allocate_kv_tensors(self, kv_cache_config: KVCacheConfig) -> None:
        """Allocate and bind this rank's KV tensors (the draft model's and the swap pool's
        too) for ``kv_cache_config``: ``initialize_kv_cache``'s allocation, also run when a
        sleeping KV cache wakes up (``worker/sleep_mode.py``)."""
        spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
        draft = kv_cache_config.draft_group
        self.kv_caches, self.kv_prefault = allocate_kv_caches(
            self.local_kv_tensors(kv_cache_config), spec, kv_cache_config.num_blocks,
            self.attn_layers, self.device, self.parallel.cp.world_size, self.step_gate)
        if draft is not None and self.drafter is not None:
            self.kv_caches.extend(self.drafter.bind_kv_cache(draft, kv_cache_config.num_blocks))
        self.host_kv = None
        if kv_cache_config.num_host_blocks:  # swap preemption: K/V, scales, the draft's too
            tensors = swapped_tensors(self.attn_layers.values(), spec)
            if draft is not None and self.drafter is not None:
                tensors += swapped_tensors(self.drafter.attn_layers.values(),
                                           draft.kv_cache_spec)
            self.host_kv = HostKVCache(tensors, kv_cache_config.num_host_blocks,
                                       pin_memory=self.device.type == "cuda")

    def release_kv_tensors(self) -> None:
        """Unbind this rank's KV tensors (the draft model's too) and drop them, once their
        prefault thread has stopped (``cpu_memory.stop_prefault``: it may hold one), so that
        their memory is unmapped now (sleep mode, the profiling run)."""
        stop_prefault(self.kv_prefault)
        self.kv_prefault = None
        release_kv_cache(self.attn_layers, self.drafter)
        self.kv_caches = []

    def capture_graphs(self, max_model_len: int) -> None:
        """Set up the decode-step graph runner (``worker/step_graphs.py``: CUDA graphs
        captured now, or CPU step graphs recorded as decode steps run; none with
        ``enforce_eager``). Call after ``initialize_kv_cache``."""
        self.graph_runner = make_graph_runner(self, max_model_len)

    def time_draft_passes(self) -> list[tuple[int, float]]:
        """The draft model's passes timed over 1, 2, 4, ... dummy requests, about a second in
        all (``spec_decode/draft_timing.py``): ``[(requests, seconds), ...]``, empty without a
        draft model. Call after ``initialize_kv_cache``, before any step (it writes the
        draft's K/V into free blocks)."""
        if self.drafter is None or self.kv_cache_config is None:
            return []
        return time_draft_passes(self.drafter, self.kv_cache_config, self.block_size,
                                 self.stager, self.config.scheduler_config.max_num_seqs,
                                 self.platform.synchronize)
