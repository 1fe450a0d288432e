"""The offline API, shaped like vLLM's: ``LLM(model=...).generate(prompts, SamplingParams)``."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

from kvflow.beam_search import (
    BeamSearchOutput,
    BeamSearchParams,
    beam_search_offline,
    check_logprobs_mode,
)
from kvflow.config import EngineConfig
from kvflow.engine.llm_engine import LLMEngine
from kvflow.inputs.prompts import ProcessedPrompt, PromptType
from kvflow.inputs.reasoning import OfflineReasoning, ReasoningOptions
from kvflow.lora.request import LoRARequest
from kvflow.offline.arguments import (
    as_prompt_list,
    beam_search_prompts,
    broadcast_loras,
    broadcast_params,
    check_concurrency_limit,
    check_priorities,
    check_users,
    processed_prompts,
    refuse_data_parallel_rank,
    refuse_server_options,
)
from kvflow.offline.chat import LLMChat
from kvflow.offline.ops import LLMOps
from kvflow.offline.pooling import LLMPooling
from kvflow.offline.queue import EnqueuedRequests, LLMQueue, _progress_bar
from kvflow.offline.score import LLMScore
from kvflow.offline.stats import OfflineStats
from kvflow.outputs import RequestOutput
from kvflow.sampling_params import SamplingParams


class LLM(LLMChat, LLMQueue, LLMScore, LLMPooling, LLMOps):
    """Offline batch generation, and pooling (``embed``, ``encode``, ``classify``:
    :class:`~kvflow.offline.pooling.LLMPooling`; ``score``: :class:`~kvflow.offline.score.LLMScore`);
    ``chat`` (:class:`~kvflow.offline.chat.LLMChat`), vLLM's queue without waiting (``enqueue``,
    ``enqueue_chat``, ``wait_for_completion``, ``get_default_sampling_params``:
    :class:`~kvflow.offline.queue.LLMQueue`) and the engine operations (sleep mode,
    ``collective_rpc``, ``apply_model``, cache resets, profiler, ``get_world_size``,
    ``get_metrics``: :class:`~kvflow.offline.ops.LLMOps`).

    Args:
        model: packaged model name, HF folder or GGUF path.
        **kwargs: any EngineConfig field (dtype, block_size, kv_cache_memory, num_kv_blocks,
            enable_prefix_caching, max_num_batched_tokens, max_num_seqs, device, ...);
            ``logits_processors``: custom logits processor classes or ``"module:Class"``
            paths (``kvflow.logits_process``), whose per-request arguments come in
            ``SamplingParams.extra_args``; vLLM's ``disable_log_stats``: False keeps the
            metrics ``get_metrics`` reads (vLLM's rule; kvflow writes no periodic stats log
            line either way), True or unset (vLLM's offline default) keeps none;
            vLLM's ``reasoning_parser`` (the server's ``--reasoning-parser`` names),
            ``reasoning_config`` (``{"reasoning_start_str": "<think>",
            "reasoning_end_str": "</think>"}``, its strings winning over the parser's) and
            ``structured_outputs_config`` (``{"enable_in_reasoning": True}``): the markers a
            ``thinking_token_budget`` is counted and ended with and a grammar starts after
            (``kvflow.inputs.reasoning``), tokenized once here.

    Raises:
        ValueError: for an unknown option, model or impossible configuration, or
            an unknown ``reasoning_parser`` (listing the choices) or a reasoning marker that
            tokenizes to nothing, or
            ``admission_control`` or ``idle_batch_window_ms`` (server options: offline
            requests are never refused, nor waited for), or ``data_parallel_rank`` (kvflow
            sets each replica's; vLLM's one-LLM-per-rank mode is not available).
    """

    def __init__(self, model: str = "SmolLM2-135M-Instruct", **kwargs: Any) -> None:
        refuse_server_options(bool(kwargs.get("admission_control")),
                              kwargs.get("idle_batch_window_ms") or 0.0)
        refuse_data_parallel_rank(kwargs)
        log_stats = kwargs.pop("disable_log_stats", None) is False  # vLLM's offline default
        reasoning = ReasoningOptions.pop(kwargs)
        self._attach(LLMEngine(EngineConfig.from_kwargs(model=model, **kwargs)), log_stats)
        self._reasoning = OfflineReasoning.of(reasoning, self.engine.tokenizer)

    @classmethod
    def from_engine_config(cls, config: EngineConfig) -> LLM:
        """An LLM on an engine built from ``config`` (``kvflow generate`` and ``kvflow
        bench`` build theirs so).

        Raises:
            ValueError: as the constructor, the server options included.
        """
        sc = config.scheduler_config
        refuse_server_options(sc.admission_control, sc.idle_batch_window_ms)
        llm = cls.__new__(cls)
        llm._attach(LLMEngine(config), log_stats=False)
        return llm

    def _attach(self, engine: LLMEngine, log_stats: bool) -> None:
        """Run on ``engine``, with an empty ``enqueue`` queue; ``log_stats``: keep the
        metrics ``get_metrics`` reads."""
        self.engine = engine
        self._reasoning = OfflineReasoning()
        self._enqueued = EnqueuedRequests()
        self._stats = OfflineStats(engine.config.model_config.model,
                                   engine.processor.max_model_len) if log_stats else None
        if self._stats is not None:
            self._stats.record_cache_config(engine)

    def shutdown(self) -> None:
        """Stop the worker processes of a multi-rank engine now (they also stop when this
        process exits); the LLM takes no more requests after it."""
        self.engine.shutdown()

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool | Callable[..., Any] = True,
                 priority: int | Sequence[int] | None = None,
                 user: Sequence[str] | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
                 on_output: Callable[[int, RequestOutput], None] | None = None,
                 *, tokenization_kwargs: dict[str, Any] | None = None,
                 mm_processor_kwargs: dict[str, Any] | None = None
                 ) -> list[RequestOutput]:
        """Generate for every prompt; returns one finished RequestOutput per prompt, in order.

        Args:
            prompts: a string, a token-id list, a dict (``{"prompt": str}`` or
                ``{"prompt_token_ids": [...]}``, for a vision-language model with
                ``"multi_modal_data": {"image": PIL image or list}`` and one image
                placeholder per image in the prompt; ``"cache_salt"``: a non-empty string,
                vLLM's, so that only prompts with the same salt share prefix-cache blocks),
                or a list of these.
            sampling_params: one for all prompts or one per prompt (default: SamplingParams()).
            use_tqdm: show a progress bar (for more than one prompt); a callable is vLLM's
                tqdm factory (e.g. ``functools.partial(tqdm, leave=False)``), called with
                ``total`` and ``desc`` (likewise for ``chat`` and the pooling methods).
            priority: one integer per prompt, or one for all (vLLM's), lower first (needs
                ``policy="priority"`` or ``"fair"``).
            user: one client name per prompt (needs ``policy="fair"``; default: one client).
            lora_request: the LoRA adapter for all prompts, or one per prompt (None: the base
                model); needs ``enable_lora=True``. Adapters of different prompts share steps.
            on_output: called with the prompt's index and its RequestOutput so far (every
                sample's whole text until now) each time a step adds to it, the finished one
                last; a kvflow extension (``kvflow generate`` prints the tokens as they come
                with it).
            tokenization_kwargs: vLLM's overrides for ``tokenizer.encode``, for every text
                and token-id prompt: ``add_special_tokens``, ``truncation`` with
                ``max_length``, ``truncate_prompt_tokens``, ``truncation_side`` (when not
                given the LAST tokens are kept, as vLLM's generate runner keeps them),
                ``do_lower_case``, ``padding="max_length"``, ``pad_prompt_tokens`` (see
                :mod:`kvflow.inputs.tokenization`); another key is a ValueError naming it.
            mm_processor_kwargs: vLLM's overrides for the processor's call, for every
                prompt's images and video frames (a dict prompt's own
                ``"mm_processor_kwargs"`` win over them), e.g. Qwen2-VL's
                ``{"max_pixels": 200704}``; a key the model's image processor does not take,
                or one that would change the vision encoder's geometry, is a ValueError
                naming it (see :mod:`kvflow.multimodal.processor_kwargs`); refused for a
                text-only model.

        Raises:
            ValueError: if any prompt, parameter, adapter or ``tokenization_kwargs`` key is
                invalid, or ``on_output`` is not callable (nothing is queued then); ``RequestRefused`` (a ValueError)
                ``"prompt <i>: <why>"`` when the engine core could not run prompt ``i`` (its
                structured-output grammar did not compile within
                ``structured_output_compile_timeout``, or failed to, or its
                ``allowed_token_ids`` miss every token it allows first): this call's other
                requests are aborted then and their outputs dropped; the engine stays
                usable.
        """
        if on_output is not None and not callable(on_output):
            raise ValueError(f"on_output must be a callable (index, RequestOutput) or None, "
                             f"got {type(on_output).__name__}")
        ids = self._add_generate_requests(prompts, sampling_params, priority, user,
                                          lora_request, tokenization_kwargs,
                                          mm_processor_kwargs)
        return self._run(ids, use_tqdm, on_output) if ids else []

    def _add_generate_requests(self, prompts: PromptType | Sequence[PromptType],
                               sampling_params: Any, priority: Any, user: Any,
                               lora_request: Any, tokenization_kwargs: dict[str, Any] | None,
                               mm_processor_kwargs: dict[str, Any] | None) -> list[str]:
        """``generate``'s arguments checked and its requests queued (not run): their ids,
        in prompt order.

        Raises:
            ValueError: see :meth:`generate` (nothing is queued then).
        """
        prompts = as_prompt_list(prompts)
        if not prompts:
            return []
        params = [self._reasoning.apply(p)
                  for p in broadcast_params(sampling_params, len(prompts))]
        policy = self.engine.config.scheduler_config.policy
        priorities = check_priorities(priority, len(prompts), policy)
        users = check_users(user, len(prompts), policy)
        prompts = processed_prompts(self.engine.processor, prompts, params,
                                    tokenization_kwargs, mm_processor_kwargs)
        loras = broadcast_loras(lora_request, len(prompts))
        return self._queue_requests(prompts, params, priorities, users, loras)

    def _queue_requests(self, prompts: list[ProcessedPrompt], params: list[SamplingParams],
                        priorities: list[int], users: list[str],
                        loras: list[LoRARequest | None]) -> list[str]:
        """Load each distinct adapter, then queue one request per prompt; their request ids,
        in order. If one is refused (or the caller is interrupted) those already queued are
        aborted and the error re-raised, so nothing stays queued.

        Raises:
            ValueError: for a request or adapter the engine refuses.
        """
        for lora in {lr for lr in loras if lr is not None}:
            self.engine.core.add_lora(lora)
        ids: list[str] = []
        try:
            for p, sp, prio, who, lora in zip(prompts, params, priorities, users, loras):
                ids.append(self.engine.add_request(p, sp, priority=prio, client_id=who,
                                                   lora_request=lora))
                if self._stats is not None:
                    self._stats.queued(ids[-1], sp.with_defaults(
                        self.engine.sampling_defaults).max_tokens)
        except BaseException:  # a later request's parameters were rejected: queue none
            for rid in ids:
                self._abort(rid)
            raise
        return ids

    def beam_search(self, prompts: PromptType | Sequence[PromptType],
                    params: BeamSearchParams,
                    lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
                    use_tqdm: bool | Callable[..., Any] = False,
                    concurrency_limit: int | None = None) -> list[BeamSearchOutput]:
        """Beam search over each prompt (vLLM's ``LLM.beam_search``; the algorithm and its
        source: ``kvflow.beam_search``): one BeamSearchOutput per prompt, in order, its
        ``sequences`` the ``beam_width`` best beams, best first, each with ``tokens``
        (prompt included), ``cum_logprob``, per-token ``logprobs``, ``text`` and
        ``finish_reason``. Each step runs every live beam as a one-token request through
        ``generate`` (prefix caching makes their shared prefix a cache hit).

        Args:
            prompts: as for ``generate`` (text, token ids, a dict prompt without
                ``multi_modal_data``, or a list of these); a prompt's ``cache_salt`` salts
                every step request of its search.
            params: the search's parameters (``kvflow.beam_search.BeamSearchParams``).
            lora_request: the LoRA adapter every beam of a prompt runs with, one for all
                prompts or one (or None: the base model) per prompt, as for ``generate``.
            use_tqdm: a progress bar over the prompts searched (vLLM's argument; a callable
                is a tqdm factory, as for ``generate``).
            concurrency_limit: search at most this many prompts at once (vLLM's; None: all),
                the next ones when those finished: the same results, fewer beams per step.

        Raises:
            ValueError: for a bad prompt, an engine whose --logprobs-mode reports logits, a
                prompt that leaves no room for
                ``params.max_tokens`` in the context, ``params`` that is not a
                BeamSearchParams, a ``lora_request`` ``generate`` would refuse, or a
                ``concurrency_limit`` that is not a positive integer (nothing is run then).
        """
        check_concurrency_limit(concurrency_limit)
        token_prompts, salts, loras = self._beam_search_inputs(prompts, params, lora_request)
        processor = self.engine.processor
        eos = frozenset([processor.eos_token_id, *processor.extra_eos_ids]) - {None}

        def generate(batch: list[list[int]], sp: SamplingParams,
                     owners: list[int]) -> list[RequestOutput]:
            owners = [start + i for i in owners]  # in the whole list, not the chunk's
            steps = [ids if salts[i] is None else {"prompt_token_ids": ids,
                                                   "cache_salt": salts[i]}
                     for ids, i in zip(batch, owners)]
            return self.generate(steps, sp, use_tqdm=False,
                                 lora_request=[loras[i] for i in owners])

        limit = concurrency_limit or max(len(token_prompts), 1)
        bar = _progress_bar(use_tqdm, len(token_prompts), "Beam search")
        results: list[BeamSearchOutput] = []
        with contextlib.closing(bar):
            for start in range(0, len(token_prompts), limit):
                chunk = token_prompts[start:start + limit]
                results += beam_search_offline(generate, chunk, params, eos,
                                               self.engine.tokenizer)
                bar.update(len(chunk))
        return results

    def _beam_search_inputs(self, prompts: PromptType | Sequence[PromptType],
                            params: BeamSearchParams,
                            lora_request: LoRARequest | Sequence[LoRARequest | None] | None
                            ) -> tuple[list[list[int]], list[str | None],
                                       list[LoRARequest | None]]:
        """``beam_search``'s arguments checked: each prompt's token ids and cache salt, and
        its LoRA adapter (loaded now, so that a bad one is refused before any step).

        Raises:
            ValueError: see :meth:`beam_search`.
        """
        if not isinstance(params, BeamSearchParams):
            raise ValueError(  # noqa: TRY004 (bad input is a ValueError throughout kvflow)
                f"params must be a BeamSearchParams, got {type(params).__name__}")
        check_logprobs_mode(self.engine.config.model_config.logprobs_mode)
        checked = beam_search_prompts(self.engine.processor, as_prompt_list(prompts),
                                      params.max_tokens)
        loras = broadcast_loras(lora_request, len(checked))
        for lora in {lr for lr in loras if lr is not None}:
            self.engine.core.add_lora(lora)
        return [p.token_ids for p in checked], [p.cache_salt for p in checked], loras
