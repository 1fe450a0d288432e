"""How one model is spread over processes and devices (``ParallelConfig``)."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any

from kvflow.config.options import check_choices, opt

DEFAULT_HEARTBEAT_TIMEOUT = 30.0  # seconds
DEFAULT_ENGINE_HEARTBEAT_TIMEOUT = 30.0  # seconds


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
            or expert parallelism, ``context_parallel_prefill`` other than ``ring`` without
            context parallelism, an ``engine_heartbeat_timeout`` <= 0, a
            ``worker_heartbeat_timeout`` <= 0 (or other than the
            default without ``mp`` or ``ray`` workers), an unknown executor
            backend, ``ray`` without Ray installed,
            ``uni`` with more than one rank, or a data-parallel rank outside the replicas.
    """

    tensor_parallel_size: int = opt(1, "tensor-parallel ranks: each layer's heads and MLP "
                                     "columns are split over them (one all-reduce after "
                                     "attention and after the MLP)")
    pipeline_parallel_size: int = opt(1, "pipeline stages: contiguous layer ranges, hidden "
                                       "states sent from stage to stage")
    data_parallel_size: int = opt(1, "data-parallel engine replicas behind one server or "
                                   "LLM: each a whole engine (with its own tensor/pipeline "
                                   "ranks) in its own process; requests go to the replica "
                                   "holding their prefix unless it is much busier, else to "
                                   "the least loaded")
    context_parallel_size: int = opt(1, "context-parallel ranks: every sequence's KV cache "
                                      "is split over them by token (position p on rank p mod "
                                      "N) and each rank attends to its part, merged by "
                                      "log-sum-exp; block_size must be a multiple of N")
    context_parallel_prefill: str = opt(
        "ring", "context parallelism's prefill chunks: ring (each CP rank runs the dense "
        "layers on its 1/N of the chunk's tokens and K/V pass around the ring: Ring "
        "Attention) or replicated (every rank runs every token)", choices=["ring", "replicated"])
    enable_expert_parallel: bool = opt(False, "MoE layers: place whole experts on the "
                                        "tensor-parallel ranks instead of splitting every "
                                        "expert")
    distributed_executor_backend: str | None = opt(
        None, "how ranks run: uni (in-process, one rank), mp (one process per rank on this "
        "machine), ray (one Ray actor per rank, several machines) (default: uni for one rank, "
        "else mp)", choices=[None, "uni", "mp", "ray"])
    worker_heartbeat_timeout: float = opt(
        DEFAULT_HEARTBEAT_TIMEOUT, "seconds a worker process (distributed_executor_backend mp, "
        "or a Ray actor with ray) may go without a "
        "heartbeat (each sends one every second from a thread of its own, also during a "
        "long step) before the engine fails naming its rank: a stopped (SIGSTOP) or frozen "
        "worker is reported within this time instead of hanging the other ranks' "
        "collectives until torch.distributed's 600 s timeout")
    engine_heartbeat_timeout: float = opt(
        DEFAULT_ENGINE_HEARTBEAT_TIMEOUT, "seconds an engine-core process (kvflow serve, "
        "AsyncLLM, or each replica of LLM(data_parallel_size > 1)) may go without a heartbeat "
        "(each core sends one every second from a thread of its own, also during a long "
        "step) and without using CPU time (a step holding the GIL runs) before the API "
        "process takes it for dead: its open requests end with an error, "
        "it is killed and taken out of routing (the other data-parallel replicas serve on; "
        "with none left /health answers 503): a stopped (SIGSTOP) or frozen core is reported "
        "within this time instead of hanging its callers for ever")
    data_parallel_rank: int = opt(0, "this engine's replica index (set by the server for "
                                   "each replica)", cli=False)

    def __post_init__(self) -> None:
        check_choices(self)
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size",
                     "context_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if not self.worker_heartbeat_timeout > 0:  # also refuses NaN
            raise ValueError(f"worker_heartbeat_timeout={self.worker_heartbeat_timeout} "
                             "must be > 0 (seconds)")
        if not self.engine_heartbeat_timeout > 0:  # also refuses NaN
            raise ValueError(f"engine_heartbeat_timeout={self.engine_heartbeat_timeout} "
                             "must be > 0 (seconds)")
        if not 0 <= self.data_parallel_rank < self.data_parallel_size:
            raise ValueError(f"data_parallel_rank={self.data_parallel_rank} is outside the "
                             f"{self.data_parallel_size} data-parallel replicas")
        cp = self.context_parallel_size
        if cp == 1 and self.context_parallel_prefill != "ring":  # it would be ignored
            raise ValueError(f"context_parallel_prefill={self.context_parallel_prefill!r} "
                             "applies to context_parallel_size > 1 only (this engine has no "
                             "context parallelism); drop it or set context_parallel_size")
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
        if self.worker_heartbeat_timeout != DEFAULT_HEARTBEAT_TIMEOUT \
                and self.executor_backend not in ("mp", "ray"):  # no worker sends heartbeats
            raise ValueError(f"worker_heartbeat_timeout={self.worker_heartbeat_timeout:g} "
                             "applies to worker processes (distributed_executor_backend mp "
                             f"or ray); this engine's executor is {self.executor_backend}")

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
                MLP width, experts), a pipeline longer than the model's layers, or
                ``enable_expert_parallel`` for a model without experts (it would be ignored).
        """
        tp, pp = self.tensor_parallel_size, self.pipeline_parallel_size
        if self.enable_expert_parallel and not num_experts(hf_config):
            raise ValueError("enable_expert_parallel=True, but the model has no experts (no "
                             "MoE layers): there is nothing to place; drop the flag")
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


def num_experts(hf_config: Any) -> int:
    """Routed experts per MoE layer (Mixtral's ``num_local_experts``, Qwen-MoE's
    ``num_experts``, DeepSeek's ``n_routed_experts``; a multimodal model's ``text_config``
    too); 0 for a dense model."""
    for cfg in (hf_config, getattr(hf_config, "text_config", None)):
        for name in ("num_local_experts", "num_experts", "n_routed_experts"):
            value = getattr(cfg, name, None)
            if isinstance(value, int) and value > 0:
                return value
    return 0


def _tp_divisions(hf_config: Any, tp: int, expert_parallel: bool
                  ) -> list[tuple[str, Any, str]]:
    """(config field, value, note) of every size that ``tp`` ranks split evenly. KV heads
    split when there are at least ``tp`` of them (fewer are replicated); with expert
    parallelism experts are placed whole, so their count must divide, not their width (but
    DeepSeek's shared experts, one dense MLP, are still split)."""
    def get(name: str) -> Any:
        return getattr(hf_config, name, None)

    out = [("num_attention_heads", get("num_attention_heads"), "")]
    kv_heads = get("num_key_value_heads")
    if kv_heads and kv_heads >= tp:
        out.append(("num_key_value_heads", kv_heads, ""))
    all_experts_mlp = get("num_local_experts") is not None  # Mixtral: every MLP is experts
    if not (all_experts_mlp and expert_parallel):
        out.append(("intermediate_size", get("intermediate_size"), ""))
    experts = get("num_local_experts") or get("num_experts") or get("n_routed_experts")
    if experts and expert_parallel:
        out.append(("number of experts", experts, " (expert parallel places whole experts)"))
        shared, width = get("n_shared_experts"), get("moe_intermediate_size")
        if shared and width:  # DeepSeek's shared experts: one dense MLP split over the ranks
            out.append(("n_shared_experts x moe_intermediate_size", shared * width,
                        " (the shared experts' MLP is split over the ranks)"))
    elif experts:
        out.append(("moe_intermediate_size", get("moe_intermediate_size"), ""))
    out.append(("shared_expert_intermediate_size", get("shared_expert_intermediate_size"), ""))
    return out
