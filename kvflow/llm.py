"""The offline API, shaped like vLLM's: ``LLM(model=...).generate(prompts, SamplingParams)``."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Sequence
from typing import Any

from tqdm.auto import tqdm

from kvflow.beam_search import (
    BeamSearchOutput,
    BeamSearchParams,
    beam_search_offline,
    check_logprobs_mode,
)
from kvflow.chat_tool_calls import check_tool_call_ids, check_tool_calls, message_turns
from kvflow.config import EngineConfig
from kvflow.config.server_values import check_disable_log_stats
from kvflow.engine.llm_engine import LLMEngine
from kvflow.engine.streams import RequestRefused
from kvflow.gc_heap import caller_heap_frozen
from kvflow.llm_inputs import (
    as_prompt_list,
    beam_search_prompts,
    broadcast_loras,
    broadcast_params,
    check_concurrency_limit,
    check_priorities,
    check_users,
    processed_prompts,
    refuse_server_options,
    with_images,
)
from kvflow.llm_ops import LLMOps
from kvflow.llm_pooling import LLMPooling
from kvflow.lora.request import LoRARequest
from kvflow.outputs import (
    RequestOutput,
)
from kvflow.prompt_inputs import ProcessedPrompt, PromptType
from kvflow.sampling_params import SamplingParams
from kvflow.tokenization_options import TokenizationOptions, parse_tokenization_kwargs

# vLLM's chat_template_content_format values (kvflow.chat_template.render_chat's content_format)
CONTENT_FORMATS = ("auto", "string", "openai")


class LLM(LLMPooling, LLMOps):
    """Offline batch generation, and pooling (``embed``, ``encode``, ``classify``,
    ``score``: :class:`~kvflow.llm_pooling.LLMPooling`).

    Args:
        model: packaged model name, HF folder or GGUF path.
        **kwargs: any EngineConfig field (dtype, block_size, kv_cache_memory, num_kv_blocks,
            enable_prefix_caching, max_num_batched_tokens, max_num_seqs, device, ...);
            ``logits_processors``: custom logits processor classes or ``"module:Class"``
            paths (``kvflow.logits_process``), whose per-request arguments come in
            ``SamplingParams.extra_args``; vLLM's ``disable_log_stats=True`` is accepted
            (kvflow logs no stats lines).

    Raises:
        ValueError: for an unknown option, model or impossible configuration,
            ``admission_control`` or ``idle_batch_window_ms`` (server options: offline
            requests are never refused, nor waited for), or ``disable_log_stats=False``.
    """

    def __init__(self, model: str = "SmolLM2-135M-Instruct", **kwargs: Any) -> None:
        refuse_server_options(bool(kwargs.get("admission_control")),
                              kwargs.get("idle_batch_window_ms") or 0.0)
        check_disable_log_stats(kwargs.pop("disable_log_stats", None))  # vLLM's; no log line
        self.engine = LLMEngine(EngineConfig.from_kwargs(model=model, **kwargs))

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
        llm.engine = LLMEngine(config)
        return llm

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
                :mod:`kvflow.tokenization_options`); another key is a ValueError naming it.
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
        prompts = as_prompt_list(prompts)
        if not prompts:
            return []
        params = broadcast_params(sampling_params, len(prompts))
        priorities = check_priorities(priority, len(prompts),
                                       self.engine.config.scheduler_config.policy)
        users = check_users(user, len(prompts), self.engine.config.scheduler_config.policy)
        prompts = processed_prompts(self.engine.processor, prompts, params,
                                    tokenization_kwargs, mm_processor_kwargs)
        loras = broadcast_loras(lora_request, len(prompts))
        ids = self._queue_requests(prompts, params, priorities, users, loras)
        return self._run(ids, use_tqdm, on_output)

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
        except BaseException:  # a later request's parameters were rejected: queue none
            for rid in ids:
                self.engine.abort_request(rid)
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

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool | Callable[..., Any] = True,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None, *,
             priority: int | Sequence[int] | None = None, chat_template: str | None = None,
             chat_template_content_format: str = "auto", add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: list[dict] | None = None,
             chat_template_kwargs: dict | None = None, documents: list[dict] | None = None,
             on_output: Callable[[int, RequestOutput], None] | None = None,
             mm_processor_kwargs: dict[str, Any] | None = None,
             tokenization_kwargs: dict[str, Any] | None = None
             ) -> list[RequestOutput]:
        """Apply the chat template to one conversation or a list of them and generate.

        The positional arguments are vLLM's first four (``messages``, ``sampling_params``,
        ``use_tqdm``, ``lora_request``); the rest are keyword-only (vLLM's order after those
        differs between its versions, so a positional one would bind to another argument).

        Message ``content`` may be a string, a list of text (and, for a vision-language
        model, ``image_url`` and ``video_url``) parts or None (see ``kvflow.chat_messages``;
        image URLs are ``data:`` URLs, http(s) from ``allowed_media_domains`` or ``file://``
        inside ``allowed_local_media_path``; video URLs
        likewise, see ``kvflow.multimodal.video``);
        ``continue_final_message`` continues the last (assistant)
        message instead of starting a new turn; ``chat_template`` replaces the model's;
        ``tools`` / ``documents`` / ``chat_template_kwargs`` become template variables;
        ``on_output`` is ``generate``'s (the outputs it sees have no ``prompt`` text: ``chat``
        sets it on the ones it returns); ``mm_processor_kwargs``, ``lora_request`` and
        ``priority`` are ``generate``'s
        too (one adapter or priority for every conversation, or one per conversation);
        ``chat_template_content_format`` is vLLM's: ``auto`` (content as a
        list of parts for a template that loops over a message's content, else one string),
        ``string`` (always one string) or ``openai`` (always a list of ``{type, ...}``
        parts), as ``kvflow serve --chat-template-content-format``. ``tokenization_kwargs``
        are ``generate``'s, for the rendered text (``add_special_tokens`` False unless they
        say otherwise: the template writes the special tokens).

        Raises:
            ValueError: for a ``chat_template_content_format`` other than the three, if the
                model has no chat template, or for a message or option the
                template cannot honour (``ChatTemplateError`` names the field): an
                assistant's ``tool_calls`` not in the server's shape
                (``messages.N.tool_calls.M.id`` for an empty id, ...), or a tool message's
                ``tool_call_id`` that no earlier assistant message's call has
                (``kvflow.chat_tool_calls``).
        """
        if not isinstance(messages, list) or not messages:
            raise ValueError("chat() needs a non-empty list of messages (or of conversations)")
        if chat_template_content_format not in CONTENT_FORMATS:
            raise ValueError(f"chat_template_content_format={chat_template_content_format!r} "
                             f"must be one of {', '.join(CONTENT_FORMATS)}")
        conversations = [messages] if isinstance(messages[0], dict) else messages
        options = {"continue_final_message": continue_final_message,
                   "chat_template": chat_template, "tools": tools, "documents": documents,
                   "template_kwargs": chat_template_kwargs,
                   "content_format": chat_template_content_format}
        tokenization = parse_tokenization_kwargs(tokenization_kwargs,
                                                 self.engine.processor.max_model_len,
                                                 add_special_tokens=False)
        prompts, token_prompts = self._chat_prompts(conversations, add_generation_prompt,
                                                    options, tokenization)
        outputs = self.generate(token_prompts, sampling_params, use_tqdm, priority=priority,
                                lora_request=lora_request, on_output=on_output,
                                mm_processor_kwargs=mm_processor_kwargs)
        for out, text in zip(outputs, prompts):
            out.prompt = text
        return outputs

    def _chat_prompts(self, conversations: list, add_generation_prompt: bool,
                      options: dict[str, Any],
                      tokenization: TokenizationOptions | None = None
                      ) -> tuple[list[str], list[Any]]:
        """Each conversation checked as the server's schema checks it (tool calls and their
        ids), rendered with the chat template (``options``: ``apply_chat_template``'s) and
        tokenized without special tokens (the template writes them; ``tokenization``: the
        call's ``tokenization_kwargs``), its images attached: (the rendered texts, the
        prompts for ``generate``).

        Raises:
            ValueError: see :meth:`chat`; ``tokenization_kwargs`` that cut or pad a
                conversation with images or videos.
        """
        for conversation in conversations:
            if isinstance(conversation, list):
                check_tool_calls(conversation)
                check_tool_call_ids(message_turns(conversation))
        processor, tokenizer = self.engine.processor, self.engine.tokenizer
        texts = [processor.apply_chat_template(c, add_generation_prompt, **options)
                 for c in conversations]
        prompts = []
        for text, c in zip(texts, conversations):
            images, videos = processor.load_chat_media(c)
            if tokenization is None:
                ids = tokenizer.encode(text, add_special_tokens=False)
            elif tokenization.reshapes and (images or videos):
                raise ValueError("tokenization_kwargs cannot cut or pad a conversation with "
                                 "images or videos (their placeholders are expanded after "
                                 "tokenization)")
            else:
                ids = tokenization.encode(tokenizer, text)
            prompts.append(with_images(ids, images, videos))
        return texts, prompts

    def _run(self, request_ids: list[str], use_tqdm: bool | Callable[..., Any],
             on_output: Callable[[int, Any], None] | None = None) -> list[Any]:
        """Step the engine until ``request_ids`` finished; their last outputs, in order.
        A progress bar when ``use_tqdm`` and more than one request: ``use_tqdm`` itself
        where it is a callable (vLLM's: a tqdm-like factory, e.g. ``functools.partial(tqdm,
        leave=False)``, called with ``total`` and ``desc``; its bar needs ``update`` and
        ``close``), else tqdm's."""
        finished: dict[str, Any] = {}
        index = {rid: i for i, rid in enumerate(request_ids)}
        try:  # no full collection of the caller's heap between steps (kvflow/gc_heap.py)
            bar = _progress_bar(use_tqdm if len(request_ids) > 1 else False,
                                len(request_ids), "Processed prompts")
            with caller_heap_frozen(), contextlib.closing(bar):
                while self.engine.has_unfinished_requests():
                    for out in self.engine.step():
                        if on_output is not None:
                            on_output(index[out.request_id], out)
                        if out.finished:
                            finished[out.request_id] = out
                            bar.update(1)
        except BaseException as e:
            # Leave the engine usable: drop this call's requests and free their KV blocks.
            for rid in request_ids:
                self.engine.abort_request(rid)
            if isinstance(e, RequestRefused) and e.request_id in index:
                i = index[e.request_id]  # name the prompt, as the checks before queuing do
                raise RequestRefused(f"prompt {i}: {e}", e.request_id) from None
            raise
        return [finished[rid] for rid in request_ids]


def _progress_bar(use_tqdm: bool | Callable[..., Any], total: int, desc: str) -> Any:
    """A progress bar over ``total`` items: ``use_tqdm`` itself where it is a callable
    (vLLM's tqdm-like factory, called with ``total`` and ``desc``; its bar needs ``update``
    and ``close``), else tqdm's, hidden when ``use_tqdm`` is false."""
    factory = use_tqdm if callable(use_tqdm) else functools.partial(tqdm, disable=not use_tqdm)
    return factory(total=total, desc=desc)
