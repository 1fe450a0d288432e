"""One rank of an engine: its device, its process groups and its ModelRunner.

Every executor runs the same ``Worker``: in the engine's process (``uni``), one per worker
process (``mp``) or one per Ray actor (``ray``). The executor calls the methods below on every
rank in the same order (they may run collectives); only the driver rank's return value of
``execute_model`` is used.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from kvflow.config import EngineConfig
from kvflow.distributed.parallel_state import (
    ParallelState,
    destroy_parallel_state,
    init_parallel_state,
)
from kvflow.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, KVCacheSpec
from kvflow.lora.request import LoRARequest
from kvflow.models.model_resolver import ModelSource
from kvflow.platforms import get_platform
from kvflow.runtime.gc_heap import freeze_startup_heap
from kvflow.sched_output import DraftGrammar, GrammarBitmask, SchedulerOutput
from kvflow.worker.model_runner import ModelRunner
from kvflow.worker.profiler import RankProfiler
from kvflow.worker.sleep_mode import RunnerSleep, check_wake_tags, kv_tensor_bytes

logger = logging.getLogger(__name__)


# Worker methods the engine calls in its own order, with state of its own kept beside them
# (sleep tags, LoRA registry, scheduled steps, the KV cache it schedules on): collective_rpc
# refuses them, saying what to call instead.
ENGINE_DRIVEN: dict[str, str] = {
    "sleep": "call LLM.sleep(level) (POST /sleep?level=N)",
    "wake_up": "call LLM.wake_up(tags) (POST /wake_up)",
    "add_lora": "pass a lora_request (POST /v1/load_lora_adapter under "
                "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1)",
    "remove_lora": "unload it (POST /v1/unload_lora_adapter)",
    **dict.fromkeys(("execute_model", "launch_forward", "launch_sampling", "collect_output",
                     "discard_output"), "the engine runs its steps itself"),
    **dict.fromkeys(("initialize_kv_cache", "capture_graphs"),
                    "the engine sets its KV cache and graphs up at start-up"),
    # start-up only: the draft timing writes dummy K/V into free blocks (prefix-cached ones,
    # once requests ran; freed ones while asleep), the heap freeze is once per process
    **dict.fromkeys(("time_draft_passes", "freeze_startup_heap"),
                    "the engine calls it once, at start-up"),
    "shutdown": "call LLM.shutdown() (or stop the server)",
    "run_method": "name the method itself",
}


@dataclass
class RpcRefusal:
    """A named ``run_method`` call that raised (bad arguments, a failed load): its message."""

    message: str


class Worker:
    """Sets up one rank (device, process groups, model) and serves the executor's calls.

    Args:
        config: the engine config.
        rank: global rank in ``[0, world_size)``.
        local_rank: index of this rank's device on its machine.
        distributed_init_method: torch.distributed rendezvous (unused for one rank).
        source / hf_config / dtype: the resolved model, its HF config and compute dtype.

    Raises:
        ValueError: from the constructor for a bad model or configuration (on this rank).
    """

    def __init__(self, config: EngineConfig, rank: int, local_rank: int,
                 distributed_init_method: str, source: ModelSource, hf_config: Any,
                 dtype: torch.dtype) -> None:
        self.config, self.rank = config, rank
        self.platform = get_platform(config.device_config.device)
        self._init_device(local_rank)
        self.parallel: ParallelState | None = init_parallel_state(
            config.parallel_config, rank, distributed_init_method, self.platform.dist_backend,
            self.platform.device)
        self.runner = ModelRunner(config, self.platform, source, hf_config, dtype,
                                  self.parallel)
        self.num_steps, self.step_time_s = 0, 0.0
        self.sleep_state = RunnerSleep()
        self.profiler = RankProfiler()

    def _init_device(self, local_rank: int) -> None:
        """Bind the device :func:`device_index` names (on CPU the ModelRunner gives this
        rank its share of the cores: ``kvflow.kernels.cpu_threads``)."""
        pc = self.config.parallel_config
        if pc.world_size > 1 or pc.data_parallel_size > 1:
            self.platform.set_device(device_index(pc, local_rank))

    @property
    def is_driver(self) -> bool:
        """Whether this rank's ``execute_model`` result is the engine's."""
        return self.parallel.is_driver

    def weight_bytes(self) -> int:
        """Bytes this rank's weights occupy (as stored)."""
        return self.runner.weight_bytes

    def freeze_startup_heap(self) -> int:
        """Freeze this worker process's heap (:func:`kvflow.runtime.gc_heap.freeze_startup_heap`);
        called by multi-process executors once the engine is set up. Returns the number of
        frozen objects."""
        return freeze_startup_heap(f"rank {self.rank}")

    def time_draft_passes(self) -> list[tuple[int, float]]:
        """This rank's draft model's passes timed at start-up, ``[(requests, seconds), ...]``
        (see :meth:`ModelRunner.time_draft_passes`); empty without a draft model."""
        return self.runner.time_draft_passes()

    def get_kv_cache_spec(self) -> dict[str, KVCacheSpec]:
        """This rank's attention layers' KV-cache specs (KV heads per TP rank)."""
        return self.runner.get_kv_cache_spec()

    def determine_available_memory(self, kv_cache_groups: tuple[KVCacheGroupSpec, ...]) -> int:
        """KV-cache bytes to size the pool by, counted as if this rank held every layer.

        A pipeline stage holds only its layers' KV tensors, so its budget goes
        ``all tensors / its tensors`` times as far; a context-parallel rank holds
        ``1 / context_parallel_size`` of every block, so its budget goes that many times
        further. The engine divides the returned bytes by a whole block's bytes (all layers)
        and takes the smallest over the ranks.
        """
        budget = self.runner.determine_available_memory(kv_cache_groups)
        probe = KVCacheConfig(2, kv_cache_groups)
        local = len(self.runner.local_kv_tensors(probe))
        cp = self.config.parallel_config.context_parallel_size  # a rank holds 1/cp of a block
        return budget * probe.num_tensors * cp // max(local, 1)

    def kv_cache_shapes(self) -> list[list[int]]:
        """The shape of each KV tensor this rank allocated (for checks and tools)."""
        return [list(cache.shape) for cache in self.runner.kv_caches]

    def initialize_kv_cache(self, kv_cache_config: KVCacheConfig) -> None:
        """Allocate this rank's KV tensors (see :meth:`ModelRunner.initialize_kv_cache`)."""
        self.runner.initialize_kv_cache(kv_cache_config)

    def capture_graphs(self, max_model_len: int) -> None:
        self.runner.capture_graphs(max_model_len)
        self.sleep_state.graphs_len = max_model_len  # to make them again after a sleep

    # ---- sleep mode (worker/sleep_mode.py) -------------------------------------------------
    def sleep(self, level: int = 1) -> int:
        """Free this rank's KV tensors and offload (level 1) or drop (level 2) its weights;
        a no-op if it sleeps already. Returns the KV tensors' bytes still held (0).

        Raises:
            ValueError: for a level other than 1 and 2.
        """
        self.sleep_state.sleep(self.runner, level)
        return kv_tensor_bytes(self.runner)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Wake ``tags`` ("weights", "kv_cache"; None: both) where they sleep.

        Raises:
            ValueError: for an unknown tag.
        """
        self.sleep_state.wake_up(self.runner, check_wake_tags(tags))

    def reload_weights(self) -> None:
        """Load the model's weights again from its checkpoint (after ``sleep(level=2)``
        dropped them, or to read changed files).

        Raises:
            ValueError: while the weights sleep, or for a checkpoint that cannot be loaded.
        """
        self.sleep_state.reload_weights(self.runner)

    def kv_cache_bytes(self) -> int:
        """Bytes of the KV tensors this rank holds now (each storage once)."""
        return kv_tensor_bytes(self.runner)

    # ---- torch profiler (worker/profiler.py) -------------------------------------------------
    def start_profile(self) -> None:
        """Start this rank's torch profiler (``KVFLOW_TORCH_PROFILER_DIR`` set).

        Raises:
            ValueError: with profiling off or a profile already running.
        """
        self.profiler.start(self.rank)

    def stop_profile(self) -> str:
        """Stop this rank's profiler; returns the path of the trace it wrote.

        Raises:
            ValueError: when no profile is running.
        """
        return self.profiler.stop()

    @classmethod
    def check_method(cls, method: Any) -> None:
        """Raises ValueError unless ``method`` names a public method of Worker that
        ``collective_rpc`` may call: not one the engine drives itself (``ENGINE_DRIVEN``),
        whose call behind the engine's back would leave its state stale (``sleep`` frees
        the KV cache of an engine that still schedules on it: the next step fails)."""
        if isinstance(method, str) and method in ENGINE_DRIVEN:
            raise ValueError(f"collective_rpc method={method!r} is driven by the engine "
                             f"itself and cannot be called through collective_rpc: "
                             f"{ENGINE_DRIVEN[method]}")
        if not isinstance(method, str) or method.startswith("_") or \
                not callable(getattr(cls, method, None)):
            public = sorted(n for n in dir(cls) if not n.startswith("_")
                            and n not in ENGINE_DRIVEN and callable(getattr(cls, n)))
            raise ValueError(f"collective_rpc method={method!r} is not a Worker method; "
                             f"valid: {public}")

    def run_method(self, method: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        """``collective_rpc``'s call on this rank: the public Worker method named ``method``
        (or, in the engine's own process, a callable run as ``method(worker, ...)``).

        An exception the named method raises (bad arguments: a ValueError or TypeError, or
        an AttributeError where ``args`` are not the objects it reads, as JSON arguments of
        ``POST /collective_rpc`` cannot be) is returned as an :class:`RpcRefusal`, so the
        worker, and the engine, live on (the engine core raises it as a ValueError, the
        server answers a 400).

        Raises:
            ValueError: for a name that is not a public method of Worker.
        """
        if callable(method):
            return method(self, *args, **(kwargs or {}))
        self.check_method(method)
        try:
            return getattr(self, method)(*args, **(kwargs or {}))
        except Exception as e:  # noqa: BLE001 - the caller's call failed, not this worker
            return RpcRefusal(f"{method}: {type(e).__name__}: {e}")

    def add_lora(self, lora_request: LoRARequest,
                 finished_ids: frozenset[str] = frozenset()) -> RpcRefusal | None:
        """Load a LoRA adapter, this rank's part of it (see :meth:`ModelRunner.add_lora`;
        ``finished_ids``: requests the scheduler has finished since the last step).

        Returns:
            None once loaded; the ValueError's message as an :class:`RpcRefusal` for an
            adapter this model cannot apply or without enable_lora (answered, not raised: a
            worker process that raises ends, and a refused adapter must leave every rank
            running; every rank checks the same folder, so all refuse alike).
        """
        if self.sleep_state.weights_dropped:  # no model to check it against, no manager
            return RpcRefusal(f"LoRA adapter {lora_request.lora_name!r}: the weights were "
                              "dropped (sleep(level=2)): reload them with "
                              "collective_rpc('reload_weights') before loading an adapter")
        try:
            self.runner.add_lora(lora_request, finished_ids)
        except ValueError as e:
            return RpcRefusal(str(e))
        return None

    def list_loras(self) -> set[int]:
        """The ids of the LoRA adapters this rank holds in host memory (vLLM's worker
        ``list_loras``: at most ``max_cpu_loras`` unless more are held by its requests;
        a dropped one is not among them)."""
        manager = self.runner.lora_manager
        return set() if manager is None else set(manager.adapters)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget a LoRA adapter (one a level-2 sleep keeps aside for ``reload_weights``
        too); False if it was not loaded."""
        kept = self.sleep_state.adapters.pop(lora_int_id, None) is not None
        kept = self.sleep_state.evicted.pop(lora_int_id, None) is not None or kept
        return self.runner.remove_lora(lora_int_id) or kept

    # ---- one step: whole (execute_model) or split (launch_forward ... collect_output) -----
    def execute_model(self, sched: SchedulerOutput,
                      grammar_bitmask: GrammarBitmask | None = None) -> Any:
        """One step on this rank; the result is the runner's (empty before the last stage)."""
        self.launch_forward(sched)
        self.launch_sampling(grammar_bitmask)
        return self.collect_output()

    def launch_forward(self, sched: SchedulerOutput,
                       first_grammar: GrammarBitmask | None = None,
                       draft_grammar: DraftGrammar | None = None) -> None:
        """A split step's first part (:meth:`ModelRunner.launch_forward`: the draft model's
        proposal, then the target's forward pass); counts as one step in ``step_stats``."""
        with self._timed():
            self.runner.launch_forward(sched, first_grammar, draft_grammar)
        self.num_steps += 1

    def proposed_drafts(self) -> dict[str, list[int]]:
        """The draft model's tokens for the launched step (:meth:`ModelRunner.
        proposed_drafts`): request id -> draft tokens."""
        return self.runner.proposed_drafts()

    def launch_sampling(self, grammar_bitmask: GrammarBitmask | None = None) -> None:
        """Sample the launched step (:meth:`ModelRunner.launch_sampling`).

        Raises:
            RuntimeError: if the previous step's tokens were not collected yet.
        """
        with self._timed():
            self.runner.launch_sampling(grammar_bitmask)

    def collect_output(self) -> Any:
        """The last sampled step's tokens (:meth:`ModelRunner.collect_output`; waits)."""
        with self._timed():
            return self.runner.collect_output()

    def discard_output(self) -> None:
        """Drop a launched or sampled step whose requests were aborted."""
        self.runner.discard_output()

    @contextlib.contextmanager
    def _timed(self) -> Iterator[None]:
        """Add the block's wall time to ``step_time_s`` (raised or not); the KV cache's
        prefault thread keeps off the CPU meanwhile (``runner.step_gate``)."""
        start = time.perf_counter()
        try:
            with self.runner.step_gate.running():
                yield
        finally:
            self.step_time_s += time.perf_counter() - start

    def step_stats(self) -> dict[str, float]:
        """Steps run (whole or split: one per ``launch_forward``), seconds inside the step
        calls, seconds of those inside TP / PP / CP collectives (including waiting for the
        other ranks), tokens this rank ran through the model and seconds inside the model's
        forward, since start-up; with context parallelism also the seconds inside attention
        (the ring and the all-gathers included)."""
        p = self.parallel
        stats = {"steps": self.num_steps, "step_s": self.step_time_s,
                 "tp_comm_s": p.tp.comm_time_s, "pp_comm_s": p.pp.comm_time_s,
                 "cp_comm_s": p.cp.comm_time_s,
                 "dense_tokens": self.runner.counters.dense_tokens,
                 "forward_s": self.runner.counters.forward_s}
        if p.cp.world_size > 1:
            stats["attention_s"] = self.runner.attn_ctx.backend.attention_s
        return stats

    def shutdown(self) -> None:
        """Leave the process groups (idempotent)."""
        destroy_parallel_state(self.parallel)


def device_index(parallel_config: Any, local_rank: int) -> int:
    """The index, among the devices this process sees, of a rank's device: data-parallel
    replica ``d`` of engines with ``W`` ranks each uses the machine's devices ``d * W`` to
    ``d * W + W - 1`` (``local_rank`` is the rank within its engine); a Ray actor sees only
    the device Ray gave it (``CUDA_VISIBLE_DEVICES``; ``local_rank`` 0), which it binds as
    it is. (Was: a Ray actor of replica ``d > 0`` bound device ``d * W``, which it cannot see:
    CUDA's invalid device ordinal, so ``--distributed-executor-backend ray`` with
    ``--data-parallel-size`` 2 failed to start on GPUs.)"""
    if parallel_config.executor_backend == "ray":
        return local_rank
    return parallel_config.data_parallel_rank * parallel_config.world_size + local_rank
