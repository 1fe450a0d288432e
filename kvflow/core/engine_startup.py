"""EngineCore's start-up, in the order ``EngineCore.__init__`` runs it: the platform, the
model (config, task, executor: the workers load the weights), the KV cache (sized once the
model is loaded), the scheduler, structured output and KV cache events. A base class of
:class:`kvflow.core.engine_core.EngineCore`, which runs the loop over what this builds."""

from __future__ import annotations

import logging
from collections import deque

from kvflow.config import EngineConfig
from kvflow.config.speculative import HEAD_METHODS
from kvflow.core.block_hashing import BlockHasher
from kvflow.core.encoder_cache_manager import EncoderCacheManager
from kvflow.core.engine_dtype import cpu_dtype_measure, resolve_dtype
from kvflow.core.engine_steps import InFlightStep
from kvflow.core.kv_cache_manager import KVCacheManager
from kvflow.core.kv_cache_sizing import (
    make_kv_cache_config,
    model_len_refusal,
    model_positions,
    window_capped,
)
from kvflow.core.kv_cache_utils import (
    kv_bytes_per_token,
    max_concurrency,
    max_tokens_per_request,
)
from kvflow.core.kv_connector_startup import connector_identity, make_connector
from kvflow.core.kv_event_publisher import make_kv_event_publisher
from kvflow.core.kv_events import MEDIUM_CPU, MEDIUM_GPU
from kvflow.core.kv_swap import SwapManager
from kvflow.core.log_scheduling import log_scheduling
from kvflow.core.scheduler import Scheduler
from kvflow.core.unread_options import (
    check_cpu_only_options,
    check_no_image_settings,
    check_no_kv_cache_settings,
    check_prefix_caching_pooling,
    check_prompt_embeds_model,
    warn_unread_model_settings,
    warn_unread_settings,
)
from kvflow.engine_outputs import EngineCoreOutput
from kvflow.executor import make_executor
from kvflow.kernels.cpu_threads import check_cpu_threads
from kvflow.layers.rotary import long_prompt_rope
from kvflow.lora.request import LoRARequest
from kvflow.models.classifier_from_tokens import resolve_classifier_tokens
from kvflow.models.gguf_tp_checks import check_tp_block_splits
from kvflow.models.loader import load_hf_config, load_tokenizer
from kvflow.models.model_resolver import ModelSource
from kvflow.models.model_task import model_task
from kvflow.models.pooling_config import TASK_VERB
from kvflow.models.registry import is_multimodal, model_traits
from kvflow.models.tokenizer_source import tokenizer_source
from kvflow.platforms import get_platform
from kvflow.sched_output import SchedulerOutput
from kvflow.spec_decode.draft_positions import draft_positions
from kvflow.spec_decode.speculator import Speculator
from kvflow.structured.manager import StructuredOutputManager
from kvflow.worker.step_graphs import cpu_step_graphs_expected

logger = logging.getLogger(__name__)

class EngineCoreStartup:
    """The start-up steps of :class:`~kvflow.core.engine_core.EngineCore` (each sets the
    attributes the loop reads: ``platform``, ``executor``, ``kv_cache_manager``,
    ``scheduler``, ``structured_output``, ``kv_event_publisher``, ...)."""

    config: EngineConfig

    def _init_platform(self) -> None:
        self.platform = get_platform(self.config.device_config.device)
        dc = self.config.device_config
        self.platform.check_kv_cache_dtype(
            self.config.cache_config.kv_cache_dtype,
            dc.attention_backend or self.platform.default_attention_backend)
        sc = self.config.scheduler_config
        if sc.max_num_batched_tokens is None:
            sc.max_num_batched_tokens = self.platform.default_max_num_batched_tokens
        fraction = self.config.cache_config.gpu_memory_utilization
        fixed = self.platform.default_kv_cache_bytes
        if fraction is not None and fixed is not None:  # it would size nothing here
            raise ValueError(f"gpu_memory_utilization={fraction} sizes a GPU's KV cache; on "
                             f"{self.platform.name} the KV cache is {fixed / 2**30:g} GiB "
                             "unless --kv-cache-memory or --num-kv-blocks sets it")
        check_cpu_only_options(self.config, self.platform)
        warn_unread_settings(self.config, self.platform)

    def _init_model(self, source: ModelSource) -> None:
        self.source = source
        self.hf_config = load_hf_config(
            source, warn_unread=self.config.parallel_config.data_parallel_rank == 0,
            hf_overrides=self.config.model_config.hf_overrides,
            trust_remote_code=self.config.model_config.trust_remote_code)
        mc = self.config.model_config  # a reranker's score head from LM-head rows: its tokens
        resolve_classifier_tokens(self.hf_config, lambda: None if mc.skip_tokenizer_init else
                                  load_tokenizer(source, tokenizer_source(mc),
                                                 mc.download_dir, mc.tokenizer_options,
                                                 mc.hf_token))
        sc = self.config.scheduler_config  # its step budget: set by _init_platform
        self.dtype = resolve_dtype(self.config.model_config.dtype, self.hf_config, self.platform,
                                   cpu_dtype_measure(self.platform, self.config.device_config,
                                                     self.hf_config, sc.max_num_batched_tokens,
                                                     sc.max_num_seqs, self.platform.name == "cpu"
                                                     and cpu_step_graphs_expected(self.config)))
        pc = self.config.parallel_config
        pc.verify_with_model(self.hf_config)
        if self.config.model_config.quantization == "gguf" and source.kind == "gguf":
            check_tp_block_splits(source.path, pc.tensor_parallel_size,
                                  pc.enable_expert_parallel)
        warn_unread_model_settings(self.config, self.hf_config)
        self._check_cpu_threads()
        self._init_task(source)
        # --max-model-len checked against the model before any worker loads weights
        self.positions = model_positions(self.hf_config, self.config, self.is_encoder)
        self.executor = make_executor(self.config, source, self.hf_config, self.dtype)
        self._resolve_async_scheduling()
        # Steps sent but not yet folded back in (pipeline parallelism keeps several).
        self.batch_queue: deque[InFlightStep] = deque()
        # Their outputs when a call waited for them (``EngineCore.drain_steps``): the next
        # step returns them.
        self.drained_outputs: list[EngineCoreOutput] = []

    def _check_cpu_threads(self) -> None:
        """On CPU, ``--cpu-threads`` / ``--cpu-threads-bind`` checked for every worker process
        of this machine before any starts (Ray places workers on other machines: they check
        their own).

        Raises:
            ValueError: see :func:`~kvflow.kernels.cpu_threads.resolve_threads`.
        """
        pc, dc = self.config.parallel_config, self.config.device_config
        if self.platform.name == "cpu" and pc.executor_backend != "ray":
            check_cpu_threads(dc.cpu_threads, dc.cpu_threads_bind,
                              pc.data_parallel_size * pc.world_size,
                              warn=pc.data_parallel_rank == 0)  # every replica checks all

    def _init_task(self, source: ModelSource) -> None:
        """``task`` (generate | embed), the pooling of an embedding model, and whether it is
        an encoder (no KV cache, whole prompts per step).

        Raises:
            ValueError: for a task the model cannot run, or embedding with LoRA, speculative
                decoding, swap preemption or pipeline parallelism; for an encoder, a KV-cache
                setting (``unread_options.check_no_kv_cache_settings``); prefix caching asked
                for where pooling turns it off (``check_prefix_caching_pooling``); for a
                text-only model, an image setting (``check_no_image_settings``);
                ``enable_prompt_embeds`` where nothing reads it
                (``check_prompt_embeds_model``); on a generating engine without
                speculative decoding, an installed logits processor plugin that does not
                import (``EngineConfig.find_logits_processor_plugins``).
        """
        folder, mc = source.path if source.kind == "hf" else None, self.config.model_config
        self.task, self.pooler_config = model_task(mc.requested_task, self.hf_config, folder,
                                                   mc.task_flags, mc.pooler_config)
        self.is_encoder = model_traits(self.hf_config)[1]
        self.config.find_logits_processor_plugins(self.task)  # before the workers get it
        pooling, does = self.task != "generate", TASK_VERB[self.task]
        if pooling and self.config.lora_config.enable_lora:
            raise ValueError(f"enable_lora is for text generation; this engine {does} "
                             f"(task={self.task!r})")
        if pooling and self.config.scheduler_config.preemption_mode == "swap":
            raise ValueError("preemption_mode='swap' is not available for embedding models "
                             "(a pooled prompt is recomputed when preempted)")
        if pooling and self.config.speculative_config is not None:
            raise ValueError(f"speculative decoding is for text generation; this engine "
                             f"{does} (task={self.task!r})")
        if (pooling or self.is_encoder) and self.config.kv_transfer_config is not None:
            raise ValueError(f"kv_transfer_config is for text generation; this engine "
                             f"{does} (task={self.task!r})")
        if pooling and self.config.parallel_config.pipeline_parallel_size > 1:
            raise ValueError("embedding models run without pipeline parallelism "
                             "(pipeline_parallel_size=1)")
        if self.is_encoder:
            check_no_kv_cache_settings(self.config, self.hf_config)
        else:
            check_prefix_caching_pooling(self.config, self.pooler_config and
                                         self.pooler_config.pooling_type)
        check_no_image_settings(self.config, self.hf_config)
        check_prompt_embeds_model(self.config, self.task, self.hf_config)

    def _resolve_async_scheduling(self) -> None:
        """--async-scheduling: the platform's default when not given (where the executor can
        split steps).

        Raises:
            ValueError: if asked for with an executor that cannot split steps (several ranks),
                or for an embedding engine.
        """
        sc = self.config.scheduler_config
        if sc.async_scheduling is None:  # not with speculative decoding (see EngineConfig)
            sc.async_scheduling = self.platform.default_async_scheduling and \
                self.executor.supports_async_scheduling and \
                self.config.speculative_config is None and self.task == "generate" and \
                self.config.kv_transfer_config is None
        elif sc.async_scheduling and self.task != "generate":
            raise ValueError(f"--async-scheduling is for text generation; this engine "
                             f"{TASK_VERB[self.task]} (task={self.task!r}: nothing is sampled)")
        elif sc.async_scheduling and not self.executor.supports_async_scheduling:
            raise ValueError(f"--async-scheduling needs an executor that splits steps (the "
                             f"uni executor: one rank in the engine's process); "
                             f"{type(self.executor).__name__} does not")
        self._in_flight: SchedulerOutput | None = None  # async: sampled, not folded in

    def _check_model_len_fits(self, model_len: int, capacity: int) -> None:
        """An explicit ``max_model_len`` (``model_len`` tokens) longer than one request's
        share of the pool (``capacity`` tokens) is refused, as vLLM refuses it at start-up
        (its ``num_gpu_blocks_override``, kvflow's ``--num-kv-blocks``, included); unset or
        -1 (vLLM's auto-fit) it is capped at ``capacity`` instead.

        Raises:
            ValueError: naming max_model_len, the blocks and bytes one such request needs
                and the pool has, the estimated maximum model length and the settings to
                change (``kv_cache_sizing.model_len_refusal``).
        """
        if self.config.model_config.max_model_len is not None:
            raise ValueError(model_len_refusal(self.config, self.kv_cache_config, model_len,
                                               capacity, self.platform.default_kv_cache_bytes))

    def _init_kv_cache(self) -> None:
        cc = self.config.cache_config
        positions = self.positions
        if self.pooler_config is not None:  # sentence-transformers' max_seq_length
            positions = self.pooler_config.cap_model_len(
                positions, self.config.model_config.max_model_len)
        self.kv_cache_config = make_kv_cache_config(self.executor, self.config, self.is_encoder,
                                                    self.dtype)
        self.num_blocks = self.kv_cache_config.num_blocks
        step_tokens = self.config.scheduler_config.max_num_batched_tokens
        wanted = window_capped(self.config, self.kv_cache_config,
                               self.config.model_config.max_model_len or positions)
        # only sliding-window layers: any length fits a pool holding one window (and chunk)
        capacity = max_tokens_per_request(self.kv_cache_config, step_tokens, wanted or 0)
        model_len = wanted or capacity
        if model_len > capacity:
            self._check_model_len_fits(model_len, capacity)
            logger.warning("max_model_len %d exceeds the KV cache (%d tokens); capping it",
                           model_len, capacity)
        self.executor.initialize_kv_cache(self.kv_cache_config)
        self.max_model_len = min(model_len, capacity)
        # why max_model_len is what it is, for the refusal of a prompt that does not fit
        self.max_model_len_note = "" if model_len <= capacity else (
            f" (capped from {model_len}: the KV cache holds {capacity} tokens per request; "
            "raise --num-kv-blocks or --kv-cache-memory for longer contexts)")
        self.executor.capture_graphs(self.max_model_len)
        self.weight_bytes = self.executor.weight_bytes
        self.kv_bytes_per_token = kv_bytes_per_token(self.kv_cache_config)
        logger.info("KV cache: %d blocks x %d tokens (block 0 is the null block); one request "
                    "can hold %d tokens, in %d group(s); max_model_len "
                    "%d; max concurrency at full length %.1f requests; %d bytes per token; "
                    "weights %.1f MiB", self.num_blocks,
                    cc.block_size, capacity, len(self.kv_cache_config.kv_cache_groups),
                    self.max_model_len,
                    max_concurrency(self.kv_cache_config, step_tokens, self.max_model_len),
                    self.kv_bytes_per_token,
                    self.weight_bytes / 2**20)
        log_scheduling(self.config.scheduler_config)

    def _init_speculator(self) -> Speculator | None:
        """The speculator (None without speculative decoding). A draft model's pass cost is
        timed now, over 1, 2, 4, ... requests (spec_decode/draft_timing.py, about a second),
        so the cost model knows it before the first step. A draft model drafts for
        constrained requests where the executor splits steps (``Executor.splits_draft_steps``:
        uni and mp; ``engine_steps.execute_with_grammar`` fills their grammar rows between
        the runner's proposal and its sampling)."""
        spec = self.config.speculative_config
        if spec is None:
            return None
        logger.info("speculative decoding: %s", spec.summary())
        # an EAGLE / MTP head is one decoder layer: its pass costs about one target layer's share
        ratio = 1.0 / max(getattr(self.hf_config, "num_hidden_layers", 1), 1) \
            if spec.method in HEAD_METHODS else 1.0
        positions = draft_positions(self.config)
        if positions is not None and positions < self.max_model_len:
            logger.info("the draft covers %d positions, max_model_len is %d: requests past "
                        "%d tokens decode without drafts", positions, self.max_model_len,
                        positions - 1)
        speculator = Speculator(
            spec, self.max_model_len, draft_cost_ratio=ratio,
            constrained_draft_model=self.executor.splits_draft_steps,
            draft_positions=positions)
        if spec.method == "draft_model":
            passes = self.executor.collective_rpc("time_draft_passes")[0]
            speculator.observe_draft_passes(passes)
            logger.info("draft model passes timed (requests: ms): %s", ", ".join(
                f"{rows}: {seconds * 1e3:.1f}" for rows, seconds in passes))
        return speculator

    def _init_scheduler(self) -> None:
        cc = self.config.cache_config
        # a pooled prompt needs every token's hidden state unless only its last one counts
        caching = cc.enable_prefix_caching is not False and not self.is_encoder and (
            self.pooler_config is None or self.pooler_config.pooling_type == "last")
        rope = long_prompt_rope(self.hf_config)
        self.kv_cache_manager = KVCacheManager(self.kv_cache_config, caching,
                                               rope.original if rope is not None else None,
                                               BlockHasher(cc.prefix_caching_hash_algo))
        # Pipeline stages before the last do not sample: they are sent every step's tokens.
        pipelined = self.config.parallel_config.pipeline_parallel_size > 1
        lc = self.config.lora_config
        self.speculator = self._init_speculator()
        self.scheduler = Scheduler(self.config.scheduler_config, self.kv_cache_manager,
                                   self.max_model_len, send_token_ids=pipelined,
                                   speculator=self.speculator,
                                   max_loras=lc.max_loras if lc.enable_lora else None,
                                   whole_prompts=self.is_encoder)
        self.loras: dict[int, LoRARequest] = {}  # adapters loaded on every rank, by id
        self.scheduler.track_in_flight = self.executor.max_concurrent_batches > 1
        if self.kv_cache_config.num_host_blocks:
            self.scheduler.swap = SwapManager(self.kv_cache_manager,
                                              self.kv_cache_config.num_host_blocks,
                                              self.kv_bytes_per_token,
                                              self.scheduler.planner.model)
        self._last_step: tuple[float, float] | None = None  # (start, end) of the last step
        self._init_kv_connector()
        if is_multimodal(self.hf_config):
            mm = self.config.multimodal_config
            budget = mm.max_num_encoder_input_tokens or \
                self.config.scheduler_config.max_num_batched_tokens
            self.scheduler.encoder = EncoderCacheManager(budget, mm.limit("encoder_cache_size"))

    def _init_kv_connector(self) -> None:
        """The KV connector's scheduler half (``--kv-transfer-config``); the runner builds
        its worker half from the same config.

        Raises:
            ValueError: see :func:`~kvflow.core.kv_connector_startup.make_connector` (a
                KV-cache layout the connector does not store, a consumer of a layout no
                producer stores).
        """
        if self.config.kv_transfer_config is not None:
            self.scheduler.connector = make_connector(self.config, self.kv_cache_config,
                                                      self.source.path, self.hf_config,
                                                      self.dtype)

    def weights_changed(self) -> None:
        """``reload_weights`` built the model again from its files, which may have changed:
        no block of the prefix cache serves a hit any more (those requests hold too), the
        KV connector keys blocks by the files' identity now, and neither indexes nor stores
        anything more of the requests with K/V now (running, or swapped out: their K/V are
        the old weights', or computed over them)."""
        sched = self.scheduler
        old_kv = {r.request_id for r in sched.running} | \
            {rid for rid, r in sched.requests.items() if r.num_computed_tokens > 0}
        self.kv_cache_manager.weights_changed(old_kv)
        if sched.connector is not None:
            sched.connector.weights_changed(*connector_identity(
                self.config, self.source.path, self.hf_config, self.dtype), old_kv)

    def _init_structured_output(self) -> None:
        """Grammar compiles run on compile threads, each within a time limit
        (``StructuredOutputConfig``); the backend (tokenizer + xgrammar) is built by the first
        compile. Offline ``LLM`` hands over its tokenizer through ``self.tokenizer``; the
        server's core process loads its own."""
        self.tokenizer = None
        so = self.config.structured_output_config
        self.structured_output = StructuredOutputManager(
            self._make_grammar_backend, self.hf_config.vocab_size,
            self.config.scheduler_config.max_num_seqs,
            compile_timeout_s=so.structured_output_compile_timeout,
            num_compile_threads=so.structured_output_compile_threads,
            max_compile_threads=so.structured_output_max_compile_threads)

    def _init_kv_events(self) -> None:
        """KV cache events (``kv_events_config``): the block pool records them and a
        publisher sends each step's batch (``kvflow/core/kv_event_publisher.py``); off, the
        publisher is None and the pool creates no event.

        Raises:
            ValueError: with prefix caching off, or if the publisher's sockets cannot open.
        """
        self.kv_event_publisher = None
        kc = self.config.kv_events_config
        if kc is None or not kc.enable_kv_cache_events:
            return
        medium = MEDIUM_CPU if self.platform.name == "cpu" else MEDIUM_GPU
        self.kv_cache_manager.enable_kv_events(medium)
        self.kv_event_publisher = make_kv_event_publisher(
            kc, self.config.parallel_config.data_parallel_rank)

    def _make_grammar_backend(self):
        from kvflow.models.loader import load_tokenizer, resolve_eos_token_id
        from kvflow.structured.xgrammar_backend import XgrammarBackend

        mc = self.config.model_config
        tokenizer = self.tokenizer or load_tokenizer(self.source, tokenizer_source(mc),
                                                     mc.download_dir, mc.tokenizer_options,
                                                     mc.hf_token)
        return XgrammarBackend(tokenizer, self.hf_config.vocab_size,
                               resolve_eos_token_id(tokenizer, self.hf_config))
