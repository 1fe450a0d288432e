"""Runs the model for one scheduled step: inputs -> forward -> logits -> sampled tokens.

Its helpers, one job each: ``attention_backends`` (kvflow's own backends by name),
``cpu_setup`` (threads, GEMM kernels), ``model_setup`` (quantization config, attention backend
choice, weights loaded, draft model),
``kv_cache_setup`` (specs, memory budget, tensors), ``step_inputs`` (the scheduler's changes
applied, LoRA mapping, tokens still on the device), ``forward_pass`` (the model's forward with
the attention metadata bound), ``pipeline_stages`` (hand-off between pipeline stages),
``step_drafts`` (speculative drafts placed, the step's inputs built), ``step_logits`` (the
sampling rows' logits, prompt logprobs, pooling) and ``step_sampling`` (sampling a launched
step, collecting its tokens)."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import nullcontext
from typing import Any

import torch

from kvflow.attention.layer import Attention
from kvflow.config import EngineConfig
from kvflow.distributed.comm import IntermediateTensors
from kvflow.distributed.kv_transfer import KVConnectorWorker
from kvflow.distributed.parallel_state import ParallelState
from kvflow.kernels.cpu_threads import AdaptiveThreads, CallerPin
from kvflow.kv_cache_interface import KVCacheConfig
from kvflow.kv_connector_meta import KVConnectorMetadata
from kvflow.layers.rotary import long_prompt_rope
from kvflow.layers.sampler import Sampler
from kvflow.logits_process import LOGITS_PROCESSORS_FLAG, load_logits_processors
from kvflow.lora.layers import LoRAMapping
from kvflow.lora.manager import LoRAManager
from kvflow.lora.request import LoRARequest
from kvflow.models.model_resolver import ModelSource
from kvflow.models.model_task import model_task
from kvflow.models.parallel_utils import is_pp_missing
from kvflow.platforms import Platform
from kvflow.platforms.cpu_memory import StepGate
from kvflow.quant import weight_bytes
from kvflow.runner_output import ModelRunnerOutput
from kvflow.sched_output import DraftGrammar, GrammarBitmask, SchedulerOutput
from kvflow.spec_decode.eagle import EagleDrafter
from kvflow.worker.cpu_setup import configure_runner_threads
from kvflow.worker.forward_pass import (
    ForwardCounters,
    model_extra_inputs,
    run_model,
    split_aux_hidden,
)
from kvflow.worker.input_batch import InputBatch
from kvflow.worker.kv_swap import HostKVCache
from kvflow.worker.logits_procs import RunnerLogitsProcessors
from kvflow.worker.mm_runner import MultiModalRunner
from kvflow.worker.model_inputs import InputStager, ModelInputs
from kvflow.worker.model_setup import load_runner_model, make_draft_model
from kvflow.worker.pipeline_stages import recv_from_previous_stage, send_to_next_stage
from kvflow.worker.pooling import PoolingState
from kvflow.worker.prompt_embeds_runner import prompt_embed_spans
from kvflow.worker.rank_failures import StepFailures, agree_failures, may_fail_before_forward
from kvflow.worker.request_state import RequestState
from kvflow.worker.runner_kv_cache import RunnerKVCache
from kvflow.worker.sampling_inputs import SamplingInputs
from kvflow.worker.step_drafts import draft_and_build_inputs
from kvflow.worker.step_inputs import hidden_rows, step_lora_mapping, update_states
from kvflow.worker.step_logits import launch_logits
from kvflow.worker.step_sampling import LaunchedStep, PendingOutput, collect_pending, sample_step

logger = logging.getLogger(__name__)


class ModelRunner(RunnerKVCache):
    """Owns the model, its KV cache and the sampler on one device.

    With tensor parallelism it holds this rank's shard of every layer; with pipeline
    parallelism only its stage's layers (and KV tensors), receiving the previous stage's hidden
    states before its forward and sending its own after; only the last stage samples.

    Args:
        config: the engine config.
        platform: the device platform.
        source / hf_config: the resolved model and its HF config.
        dtype: compute dtype.
        parallel: this rank's process groups (default: one process).
    """

    def __init__(self, config: EngineConfig, platform: Platform, source: ModelSource,
                 hf_config: Any, dtype: torch.dtype,
                 parallel: ParallelState | None = None) -> None:
        self.config, self.platform, self.dtype = config, platform, dtype
        self.adaptive_threads: AdaptiveThreads | None = None  # CPU: --cpu-adaptive-threads
        self.caller_pin = CallerPin(None)  # CPU: the model thread's pinning during a step
        self.device = platform.device
        self.parallel = parallel or ParallelState.single(self.device)
        self.block_size = config.cache_config.block_size
        self.stager = InputStager(self.device)
        self.step_gate = StepGate()  # the worker's steps, for the KV cache's prefault thread
        if self.device.type == "cpu":
            self.adaptive_threads, self.caller_pin = configure_runner_threads(config,
                                                                              self.parallel)
        self.source, self.hf_config = source, hf_config
        self.load_model()
        self._init_sampler()
        self.kv_caches: list[torch.Tensor] = []
        self.host_kv: HostKVCache | None = None  # swap preemption's host pool
        self.kv_connector: KVConnectorWorker | None = None  # --kv-transfer-config
        self._kv_load_failures: dict[str, str] = {}  # the launched step's, for its output
        # requests that failed alone (worker/request_failures.py, on several ranks:
        # worker/rank_failures.py): the launched step's, then the sampled step's (async
        # scheduling launches step N+1 before collecting N)
        self._launched_failures = StepFailures()
        self._sampled_failures = StepFailures()
        self.kv_cache_config: KVCacheConfig | None = None
        self.graph_runner = None
        self.counters = ForwardCounters()  # tokens and seconds in the forward (statistics)

    def load_model(self) -> None:
        """Build the model (and the draft model, if any) and load their weights: at start-up,
        and again for ``reload_weights`` (``worker/sleep_mode.py``).

        Raises:
            ValueError: for a model, checkpoint or quantization that cannot be used.
        """
        self._init_model(self.source, self.hf_config)
        self.drafter = make_draft_model(self.config, self.platform, self.source,
                                        self.hf_config, self.dtype, self.device,
                                        self.parallel.tp, self.model)

    def _init_model(self, source: ModelSource, hf_config: Any) -> None:
        mc = self.config.model_config
        self.model, self.attn_ctx, self.quant_config = load_runner_model(
            self.config, self.platform, source, hf_config, self.dtype, self.parallel)
        self.long_prompt_rope = long_prompt_rope(hf_config)  # LongRoPE's long-prompt rows
        _, pooler = model_task(mc.requested_task, hf_config,
                               source.path if source.kind == "hf" else None,
                               overrides=mc.pooler_config)
        self.pooling = None if pooler is None else \
            PoolingState(pooler, getattr(self.model, "score_head", None))  # embed, score, classify
        lc = self.config.lora_config
        # each pipeline stage adapts its own layers (the others' weights are their stages')
        elsewhere = None if self.parallel.pp.world_size == 1 else \
            (lambda name: is_pp_missing(name, self.model))
        self.lora_manager = LoRAManager(self.model, lc, self.dtype, self.device,
                                        getattr(hf_config, "model_type", None), elsewhere,
                                        self._adapters_in_use) \
            if lc.enable_lora else None
        self.weight_bytes = weight_bytes(self.model)
        logger.info("weights: %.1f MiB (quantization: %s)", self.weight_bytes / 2**20,
                    self.quant_config.name if self.quant_config else "none")
        self.attn_layers = {name: m for name, m in self.model.named_modules()
                            if isinstance(m, Attention)}
        self.mm_runner = MultiModalRunner(self.model, self.parallel.pp.is_first_rank) \
            if getattr(self.model, "supports_multimodal", False) else None
        self._init_prompt_embeds()

    def _init_prompt_embeds(self) -> None:
        """``enable_prompt_embeds``: the embedding lookup the prompt rows are written over
        (the first pipeline stage's; None elsewhere and when disabled).

        Raises:
            ValueError: if the model cannot take ``inputs_embeds`` (only the Llama family
                and its subclasses can; vision-language models cannot).
        """
        self.embed_prompts = None
        if not self.config.model_config.enable_prompt_embeds:
            return
        if not getattr(self.model, "supports_prompt_embeds", False) or \
                self.mm_runner is not None:
            raise ValueError(f"enable_prompt_embeds: {type(self.model).__name__} does not "
                             "take prompt embeddings (the Llama-family causal LMs do)")
        if self.parallel.pp.is_first_rank:
            self.embed_prompts = self.model.embed_input_ids

    def _init_sampler(self) -> None:
        """The sampler, its inputs and the custom logits processors (one instance of each
        class per runner, the installed plugins' first; None without any, and for a pooling
        model, which skips the plugins).

        Raises:
            ValueError: for custom logits processors named by the flag with a pooling model
                (it samples nothing).
        """
        gen = torch.Generator(device=self.device)
        gen.manual_seed(self.config.model_config.seed)
        mc = self.config.model_config
        self.sampler = Sampler(gen, mc.logprobs_mode)
        if mc.logits_processors and self.pooling is not None:
            raise ValueError(f"{LOGITS_PROCESSORS_FLAG}: a pooling model (embed, score, "
                             "classify) samples no tokens; custom logits processors need a "
                             "generative model")
        classes = () if self.pooling is not None else \
            load_logits_processors(mc.custom_logits_processors())  # plugins skip pooling
        self.logits_procs = RunnerLogitsProcessors(classes, self.config, self.device) \
            if classes else None
        self.sampling_inputs = SamplingInputs(self.device)
        self.requests: dict[str, RequestState] = {}  # every request this runner computes
        self.input_batch: InputBatch | None = None  # made with the KV cache (needs the groups)
        self._step: LaunchedStep | None = None  # forward launched, not sampled yet
        self._pending: PendingOutput | None = None  # sampled, not collected yet
        self._proposed: dict[str, list[int]] = {}  # the launched step's draft-model tokens

    # ---- LoRA adapters -----------------------------------------------------------------------
    def _adapters_in_use(self, finished_ids: frozenset[str] = frozenset()) -> Iterator[Any]:
        """The LoRA adapters the runner's requests hold, those in ``finished_ids`` left out."""
        return (s.lora for rid, s in self.requests.items() if rid not in finished_ids)

    def add_lora(self, lora_request: LoRARequest,
                 finished_ids: frozenset[str] = frozenset()) -> None:
        """Load (read and check) a LoRA adapter so that requests may use it;
        ``finished_ids``: requests the scheduler has finished since the last step (their
        states go at the next step; they hold their adapters no more).

        Raises:
            ValueError: without ``enable_lora``, or for an adapter this model cannot apply.
        """
        if self.lora_manager is None:
            raise ValueError("LoRA adapters need an engine started with enable_lora "
                             "(--enable-lora)")
        self.lora_manager.add_lora(lora_request, finished_ids)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget a LoRA adapter (running requests keep theirs); False if it was not loaded."""
        return self.lora_manager is not None and self.lora_manager.remove_lora(lora_int_id)

    def _lora_mapping(self, inputs: ModelInputs) -> LoRAMapping | None:
        """The step's tokens -> adapter slots (None: no LoRA in this step)."""
        return step_lora_mapping(self.lora_manager, self.input_batch, self.requests, inputs)

    # ---- one step ----------------------------------------------------------------------------
    def execute_model(self, sched: SchedulerOutput, grammar_bitmask: GrammarBitmask | None = None
                      ) -> ModelRunnerOutput:
        """Run one step and return the sampled token of every request that reached its end.
        ``grammar_bitmask`` masks the rows of structured-output requests (others untouched)."""
        self.launch_forward(sched)
        self.launch_sampling(grammar_bitmask)
        return self.collect_output()

    @torch.inference_mode()
    def launch_forward(self, sched: SchedulerOutput,
                       first_grammar: GrammarBitmask | None = None,
                       draft_grammar: DraftGrammar | None = None) -> None:
        """Apply the step's changes to the input batch, build the inputs and run the forward
        pass up to the logits of the rows that sample (on CUDA: queued, not waited for).
        Tokens sampled by the previous step and not yet collected are read on the device.
        Draft tokens to verify (speculative decoding) are placed after their requests' tokens
        first (``worker/step_drafts.py``); ``first_grammar``: constrained requests' grammar
        rows before their first draft (a draft model chooses draft 1 within them), or None;
        ``draft_grammar``: the engine core's rows for their later drafts, or None.
        """
        if self.host_kv is not None:  # swap preemption: before this step writes any K/V
            self.host_kv.swap_out(sched.blocks_to_swap_out)
            self.host_kv.swap_in(sched.blocks_to_swap_in)
        connector_meta = sched.kv_connector_metadata if self.kv_connector is not None else None
        if connector_meta is not None and connector_meta.loads:  # KV transfer: stored
            # blocks in, then forward; K/V computed over a block not loaded are not stored
            self._kv_load_failures, bad = self._load_kv(connector_meta)
            if bad:
                connector_meta = connector_meta.without_saves_reading(bad)
        self._launched_failures = failures = StepFailures(
            possible=may_fail_before_forward(sched))
        update_states(sched, self.requests, self.input_batch, self.device, self.pooling,
                      self.lora_manager, self.mm_runner, failures.failed)
        if isinstance(self.drafter, EagleDrafter):  # finished / preempted: features freed
            self.drafter.release(self.input_batch)
        self._step, self._proposed = None, {}
        if sched.is_empty:
            return
        if self.adaptive_threads is not None:  # between steps, on the model's thread
            self.adaptive_threads.before_step()
        with self.caller_pin:  # draft and target forward, on the pinned model thread
            inputs, spec_tokens, proposal = draft_and_build_inputs(
                sched, self.input_batch, self.drafter, self.block_size, self.stager,
                self._pending, self.sampler.generator, self.long_prompt_rope, first_grammar,
                draft_grammar)
            if proposal is not None:
                self._proposed = proposal.token_ids
            hidden, aux = split_aux_hidden(self._forward(
                inputs, recv_from_previous_stage(self.parallel.pp, failures.failed),
                lora_mapping=self._lora_mapping(inputs),
                rows=hidden_rows(inputs, self.input_batch, self.pooling, spec_tokens)))
            if connector_meta is not None:  # and the prompt blocks it completed out after it
                self.kv_connector.wait_for_save(connector_meta)
            if not send_to_next_stage(self.parallel.pp, hidden, failures.failed):
                return  # a pipeline stage before the last: no logits here (its failures
                # went with its hidden states)
            if isinstance(self.drafter, EagleDrafter):  # the head reads the target's features
                self.drafter.observe_target(self.input_batch, inputs, hidden, self.block_size,
                                            self.stager, aux)
            self._step = launch_logits(self.model, self.pooling, self.input_batch,
                                       self.requests, sched, inputs, hidden, spec_tokens,
                                       proposal, self.sampler.logprobs_mode.endswith("logits"))

    def proposed_drafts(self) -> dict[str, list[int]]:
        """The draft model's tokens for the step ``launch_forward`` launched: request id ->
        its draft tokens; empty without a draft model or drafts. Valid until the next
        ``launch_forward`` (the engine core fills constrained requests' grammar rows after
        them before ``launch_sampling``)."""
        return self._proposed

    @torch.inference_mode()
    def launch_sampling(self, grammar_bitmask: GrammarBitmask | None = None) -> None:
        """Sample the launched step's rows (queued on CUDA); their tokens count as the rows'
        next tokens at once and reach the host in ``collect_output``.

        Raises:
            RuntimeError: if the previous step's tokens were not collected yet (penalties and
                min_tokens must see them).
        """
        if self._pending is not None:
            raise RuntimeError("collect_output() must run before the next launch_sampling()")
        step, self._step = self._step, None
        self._sampled_failures, self._launched_failures = self._launched_failures, \
            StepFailures()
        if step is not None:
            self._sampled_failures.possible |= self.logits_procs is not None
            self._pending = sample_step(step, self.input_batch, self.sampling_inputs,
                                        self.sampler, grammar_bitmask, self.logits_procs,
                                        self.requests, self._sampled_failures.failed)

    def collect_output(self) -> ModelRunnerOutput:
        """Copy the last sampled tokens to the host (waits for the device) and return them
        (with the KV connector's failed loads of the step, and the requests that failed
        alone in it on any rank: ``ModelRunnerOutput.failed``; the last stage's tensor- and
        context-parallel ranks exchange theirs here, ``worker/rank_failures.py``)."""
        pending, self._pending = self._pending, None
        out = collect_pending(pending, self.input_batch)
        if self._kv_load_failures:
            out.kv_load_failures, self._kv_load_failures = self._kv_load_failures, {}
        failures, self._sampled_failures = self._sampled_failures, StepFailures()
        if self.parallel.pp.is_last_rank:  # an earlier stage sent its failures on
            out.failed = agree_failures((self.parallel.tp, self.parallel.cp), failures,
                                        self.device)
        return out

    def _load_kv(self, meta: KVConnectorMetadata) -> tuple[dict[str, str], set[int]]:
        """The KV connector's loads of the step; returns request id -> the key of its first
        block some tensor-parallel rank could not load (every rank learns every rank's), and
        the ids of the blocks left unfilled (that one and those after it)."""
        first_bad = self.kv_connector.start_load_kv(meta)
        tp = self.parallel.tp
        if tp.world_size > 1:  # the earliest failure over the ranks, per transfer
            mine = torch.tensor(first_bad, dtype=torch.int64, device=self.device)
            every = tp.all_gather(mine, dim=0).view(tp.world_size, -1).cpu()
            first_bad = torch.where(every < 0, torch.iinfo(torch.int64).max, every
                                    ).min(dim=0).values.tolist()
            first_bad = [-1 if i == torch.iinfo(torch.int64).max else i for i in first_bad]
        failed = [(t, i) for t, i in zip(meta.loads, first_bad) if i >= 0]
        return {t.req_id: t.keys[i] for t, i in failed}, \
            {b for t, i in failed for b in t.block_ids[i:]}

    def discard_output(self) -> None:
        """Drop a launched or sampled step that will not be collected (the engine aborted its
        requests, whose rows go with the next step's finished ids)."""
        self._step = self._pending = None
        self._kv_load_failures = {}
        self._launched_failures, self._sampled_failures = StepFailures(), StepFailures()
        if self.input_batch is not None:
            self.input_batch.pending_sample[:] = -1

    def _forward(self, inputs: ModelInputs, intermediate_tensors: IntermediateTensors | None,
                 batch: InputBatch | None = None, lora_mapping: LoRAMapping | None = None,
                 rows: torch.Tensor | None = None) -> torch.Tensor | IntermediateTensors:
        """This rank's layers: final hidden states [T, hidden] (last pipeline stage) or the
        tensors for the next stage. ``batch``: the rows ``inputs`` came from (default: the
        persistent input batch); ``lora_mapping``: the step's tokens -> adapter slots;
        ``rows``: int64 token indices whose hidden states are read (None: all; under a
        context-parallel token split the other rows are 0)."""
        metadata = inputs.attn_metadata
        batch = batch or self.input_batch
        spans = prompt_embed_spans(inputs, batch) if self.embed_prompts is not None else []
        if not spans and self.graph_runner is not None and \
                self.graph_runner.can_run(metadata[0]):
            start = time.perf_counter()
            lora = nullcontext() if self.lora_manager is None else \
                self.lora_manager.ctx.bind(lora_mapping)
            with lora:  # a CPU step graph stages the step's adapter slots from it
                hidden = self.graph_runner.run(inputs.input_ids, inputs.positions,
                                               metadata[0])
            self.counters.dense_tokens += metadata[0].num_reqs
            self.counters.forward_s += time.perf_counter() - start
            return hidden
        positions, extra = model_extra_inputs(
            self.mm_runner, inputs, batch, self.requests,
            getattr(self.model, "uses_token_types", False),
            (self.embed_prompts, spans) if spans else None)
        if self.lora_manager is not None:
            with self.lora_manager.ctx.bind(lora_mapping):
                return self._run_model(inputs, intermediate_tensors, positions, extra, rows)
        return self._run_model(inputs, intermediate_tensors, positions, extra, rows)

    def _run_model(self, inputs: ModelInputs, intermediate_tensors: IntermediateTensors | None,
                   positions: torch.Tensor, extra: dict[str, Any],
                   rows: torch.Tensor | None = None) -> torch.Tensor | IntermediateTensors:
        return run_model(self.model, self.attn_ctx, self.parallel.cp.world_size,
                         self.block_size, self.counters, inputs, intermediate_tensors,
                         positions, extra, rows,
                         None if self.lora_manager is None else self.lora_manager.ctx)
