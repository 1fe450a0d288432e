"""The offline API, shaped like vLLM's: ``LLM(model=...).generate(prompts, SamplingParams)``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from tqdm.auto import tqdm

from kvflow.beam_search import BeamSearchOutput, BeamSearchParams, beam_search_offline
from kvflow.chat_tool_calls import check_tool_call_ids, check_tool_calls, message_turns
from kvflow.config import EngineConfig
from kvflow.engine.llm_engine import LLMEngine
from kvflow.engine.streams import RequestRefused
from kvflow.input_processor import PromptType
from kvflow.llm_inputs import (
    as_prompt_list,
    beam_search_prompts,
    broadcast_loras,
    broadcast_params,
    broadcast_pooling_params,
    check_priorities,
    check_users,
    cut_pooling_prompt,
    processed_prompts,
    refuse_server_options,
    resolve_pooling_task,
    with_images,
    with_pooling_task,
)
from kvflow.lora.request import LoRARequest
from kvflow.outputs import (
    ClassificationOutput,
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    PoolingOutput,
    PoolingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from kvflow.pooling_params import PoolingParams
from kvflow.prompt_truncation import truncation_length
from kvflow.sampling_params import SamplingParams
from kvflow.score_inputs import cosine_similarity, pair_prompt, score_pairs, score_value


class LLM:
    """Offline batch generation.

    Args:
        model: packaged model name, HF folder or GGUF path.
        **kwargs: any EngineConfig field (dtype, block_size, kv_cache_memory, num_kv_blocks,
            enable_prefix_caching, max_num_batched_tokens, max_num_seqs, device, ...).

    Raises:
        ValueError: for an unknown option, model or impossible configuration, or
            ``admission_control`` (a server option: offline requests are never refused).
    """

    def __init__(self, model: str = "SmolLM2-135M-Instruct", **kwargs: Any) -> None:
        refuse_server_options(bool(kwargs.get("admission_control")))
        self.engine = LLMEngine(EngineConfig.from_kwargs(model=model, **kwargs))

    @classmethod
    def from_engine_config(cls, config: EngineConfig) -> LLM:
        """An LLM on an engine built from ``config`` (``kvflow generate`` and ``kvflow
        bench`` build theirs so).

        Raises:
            ValueError: as the constructor, ``admission_control`` included.
        """
        refuse_server_options(config.scheduler_config.admission_control)
        llm = cls.__new__(cls)
        llm.engine = LLMEngine(config)
        return llm

    def shutdown(self) -> None:
        """Stop the worker processes of a multi-rank engine now (they also stop when this
        process exits); the LLM takes no more requests after it."""
        self.engine.shutdown()

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    # ---- sleep mode (vLLM's; needs enable_sleep_mode=True) -----------------------------------
    def sleep(self, level: int = 1) -> None:
        """Free accelerator memory while the engine is idle: level 1 offloads the weights to
        host memory (on a CPU device they stay) and frees the KV cache; level 2 drops both
        (wake_up, then ``collective_rpc("reload_weights")``). The prefix cache is reset; a
        second sleep is a no-op. Generation is refused until :meth:`wake_up`.

        Raises:
            ValueError: without enable_sleep_mode, for a level other than 1 and 2, or while
                requests are in flight.
        """
        self.engine.local_core("sleep").sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Give back what :meth:`sleep` freed: ``tags`` "weights" and/or "kv_cache" (None:
        both); the KV cache has as many blocks as before. A no-op while awake.

        Raises:
            ValueError: for an unknown tag.
        """
        self.engine.local_core("wake_up").wake_up(tags)

    def is_sleeping(self) -> bool:
        """True from :meth:`sleep` until every tag woke up."""
        return self.engine.local_core("is_sleeping").sleep_mode.is_sleeping

    def collective_rpc(self, method: str | Callable[..., Any], timeout: float | None = None,
                       args: tuple = (), kwargs: dict[str, Any] | None = None) -> list[Any]:
        """Run the Worker method named ``method`` on every rank (e.g. ``"reload_weights"``
        after a level-2 sleep) and return the results by rank; a callable (called as
        ``method(worker, *args, **kwargs)``) only with the in-process executor.

        Raises:
            ValueError: for a name that is not a Worker method, a callable with worker
                processes, or a ``timeout`` (not supported: calls are waited for).
        """
        if timeout is not None:
            raise ValueError(f"collective_rpc timeout={timeout!r} is not supported; leave it "
                             "None (the call is waited for)")
        return self.engine.local_core("collective_rpc").collective_rpc(method, args, kwargs)

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: Sequence[int] | None = None,
                 user: Sequence[str] | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
                 on_output: Callable[[int, RequestOutput], None] | None = None
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
            priority: one integer per prompt, lower first (needs ``policy="priority"`` or
                ``"fair"``).
            user: one client name per prompt (needs ``policy="fair"``; default: one client).
            lora_request: the LoRA adapter for all prompts, or one per prompt (None: the base
                model); needs ``enable_lora=True``. Adapters of different prompts share steps.
            on_output: called with the prompt's index and its RequestOutput so far (every
                sample's whole text until now) each time a step adds to it, the finished one
                last; a kvflow extension (``kvflow generate`` prints the tokens as they come
                with it).

        Raises:
            ValueError: if any prompt, parameter or adapter is invalid, or ``on_output`` is
                not callable (nothing is queued then); ``RequestRefused`` (a ValueError)
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
        prompts = processed_prompts(self.engine.processor, prompts, params)
        loras = broadcast_loras(lora_request, len(prompts))
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
        return self._run(ids, use_tqdm and len(ids) > 1, on_output)

    def beam_search(self, prompts: PromptType | Sequence[PromptType],
                    params: BeamSearchParams,
                    lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
                    ) -> list[BeamSearchOutput]:
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

        Raises:
            ValueError: for a bad prompt, a prompt that leaves no room for
                ``params.max_tokens`` in the context, ``params`` that is not a
                BeamSearchParams, or a ``lora_request`` ``generate`` would refuse (nothing
                is run then).
        """
        if not isinstance(params, BeamSearchParams):
            raise ValueError(  # noqa: TRY004 (bad input is a ValueError throughout kvflow)
                f"params must be a BeamSearchParams, got {type(params).__name__}")
        processor = self.engine.processor
        checked = beam_search_prompts(processor, as_prompt_list(prompts), params.max_tokens)
        token_prompts, salts = [p.token_ids for p in checked], [p.cache_salt for p in checked]
        loras = broadcast_loras(lora_request, len(token_prompts))
        for lora in {lr for lr in loras if lr is not None}:  # refused here, before a step
            self.engine.core.add_lora(lora)
        eos = frozenset([processor.eos_token_id, *processor.extra_eos_ids]) - {None}

        def generate(batch: list[list[int]], sp: SamplingParams,
                     owners: list[int]) -> list[RequestOutput]:
            steps = [ids if salts[i] is None else {"prompt_token_ids": ids,
                                                   "cache_salt": salts[i]}
                     for ids, i in zip(batch, owners)]
            return self.generate(steps, sp, use_tqdm=False,
                                 lora_request=[loras[i] for i in owners])

        return beam_search_offline(generate, token_prompts, params, eos, self.engine.tokenizer)

    def embed(self, prompts: PromptType | Sequence[PromptType],
              pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
              use_tqdm: bool = True, user: Sequence[str] | None = None,
              truncate_prompt_tokens: int | None = None) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt, in order (``out.outputs.embedding``: a list of floats),
        batched by the same scheduler as generation (prompts only, nothing sampled).

        Args:
            prompts: a string, a token-id list, a dict prompt (``{"prompt": ...}`` or
                ``{"prompt_token_ids": ...}``; ``multi_modal_data`` is refused), or a list
                of these.
            pooling_params: one for all prompts or one per prompt (``dimensions``: Matryoshka
                truncation, for models that support it; ``normalize``: True / False to
                L2-normalize the vector or not, None as the model's pooling config says).
            user: one client name per prompt (needs ``policy="fair"``; default: one client),
                as for ``generate``.
            truncate_prompt_tokens: cut each prompt to at most this many tokens (-1:
                ``max_model_len``), as ``/v1/embeddings`` cuts an input: a text as the
                tokenizer truncates it (its special tokens counted), token ids to their last
                ``k``; None: a prompt longer than ``max_model_len`` is refused.

        Raises:
            ValueError: on a generation model (start it with ``task="embed"``), for a bad
                prompt, ``dimensions`` or ``truncate_prompt_tokens``, or a ``user`` list
                ``generate`` would refuse (nothing is queued then).
        """
        prompts = as_prompt_list(prompts)
        params = broadcast_pooling_params(pooling_params, len(prompts))
        if any(p is not None and p.task != "embed" for p in params):
            raise ValueError("LLM.embed takes PoolingParams with task='embed'; score text pairs "
                             "with LLM.score, classify texts with LLM.classify")
        return self._pool(prompts, params, use_tqdm, user,
                          truncate_prompt_tokens=truncate_prompt_tokens)

    def encode(self, prompts: PromptType | Sequence[PromptType],
               pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
               use_tqdm: bool = True,
               lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
               pooling_task: str | None = None, user: Sequence[str] | None = None,
               truncate_prompt_tokens: int | None = None) -> list[PoolingRequestOutput]:
        """vLLM's ``LLM.encode``: each prompt's pooled output as a float32 tensor
        (``out.outputs.data``, shape [n]): the embedding (as ``embed``) or the class
        probabilities (as ``classify``), batched like ``embed``.

        Args:
            prompts: as ``embed`` takes them.
            pooling_params: one for all prompts or one per prompt (None: the defaults);
                their ``task`` is set to the pooling task.
            lora_request: None (or None per prompt): pooling engines run no adapters.
            pooling_task: ``"embed"`` or ``"classify"``, where the engine runs it; None: the
                engine's (``embed`` on an embedding engine, else ``classify``).
            user: one client name per prompt (needs ``policy="fair"``), as for ``generate``.
            truncate_prompt_tokens: as ``embed`` takes it.

        Raises:
            ValueError: on a generating engine, for a pooling task the engine does not run
                (or vLLM's per-token tasks and ``score``, which kvflow's encode does not run),
                a LoRA adapter, PoolingParams of another task or with fields the task
                refuses, or what ``embed`` refuses (nothing is queued then).
        """
        task = resolve_pooling_task(self.engine.processor, pooling_task)
        prompts = as_prompt_list(prompts)
        if any(lora is not None for lora in broadcast_loras(lora_request, len(prompts))):
            raise ValueError("lora_request: a pooling engine runs no LoRA adapters (LoRA is "
                             "refused with a pooling task)")
        params = [with_pooling_task(p, task)
                  for p in broadcast_pooling_params(pooling_params, len(prompts))]
        return [PoolingRequestOutput(o.request_id, o.prompt_token_ids,
                                     PoolingOutput(torch.tensor(o.outputs.embedding,
                                                                dtype=torch.float32)),
                                     o.finished, o.metrics)
                for o in self._pool(prompts, params, use_tqdm, user,
                                    truncate_prompt_tokens=truncate_prompt_tokens)]

    def _pool(self, prompts: list[PromptType], params: list[PoolingParams | None],
              use_tqdm: bool, user: Sequence[str] | None, name_prompts: bool = False,
              truncate_prompt_tokens: int | None = None) -> list[EmbeddingRequestOutput]:
        """Queue one pooling request per prompt (with its params; None: an embedding's
        defaults) after checking them all, run them; outputs in prompt order. With
        ``truncate_prompt_tokens`` each prompt is cut first (``cut_pooling_prompt``).

        Raises:
            ValueError: for a prompt or params the engine refuses (``prompt i: ...`` with
                ``name_prompts``), a bad ``truncate_prompt_tokens`` or ``user`` (nothing is
                queued then).
        """
        if not prompts:
            return []
        users = check_users(user, len(prompts), self.engine.config.scheduler_config.policy)
        processor = self.engine.processor
        limit = truncation_length(truncate_prompt_tokens, processor.max_model_len)
        prompts = list(prompts)
        for i, (p, pp) in enumerate(zip(prompts, params)):  # check all before queuing any
            task = pp.task if pp is not None else "embed"
            try:
                prompts[i] = cut_pooling_prompt(processor, self.get_tokenizer(), p, task, limit)
                processor.make_pooling_request(
                    "check", processor.pooling_prompt(prompts[i], task)[1], pp)
            except ValueError as e:
                if not name_prompts:
                    raise
                raise ValueError(f"prompt {i}: {e}") from None
        ids: list[str] = []
        try:
            for p, pp, who in zip(prompts, params, users):
                ids.append(self.engine.add_pooling_request(p, pp, client_id=who))
        except BaseException:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        return self._run(ids, use_tqdm and len(ids) > 1)

    def score(self, text_1: str | Sequence[str], text_2: str | Sequence[str],
              truncate_prompt_tokens: int | None = None, use_tqdm: bool = True,
              user: Sequence[str] | None = None) -> list[ScoringRequestOutput]:
        """A cross-encoder's score of each text pair, in pair order
        (``out.outputs.score``; see :class:`~kvflow.outputs.ScoringOutput`).

        Args:
            text_1 / text_2: a string or a list of strings: one text against one or each of
                N texts (1-to-N), or two lists of the same length paired item by item
                (N-to-N) (``kvflow.score_inputs.score_pairs``).
            truncate_prompt_tokens: cut each pair to at most this many tokens (the longer
                text first); None: a pair longer than ``max_model_len`` is refused.
            user: one client name per pair (needs ``policy="fair"``), as for ``generate``.

        On an embedding model (``task="embed"``) a pair's score is the cosine similarity of
        its two texts' embeddings, as vLLM scores with embedding models
        (``_score_embeddings``).

        A ``task="classify"`` engine scores too when its classifier has one label (vLLM's
        rule: a relevance logit, through a sigmoid).

        Raises:
            ValueError: on a generating engine or a classify engine whose classifier has
                several labels, for bad ``text_1`` / ``text_2`` (named), a
                pair longer than ``max_model_len`` (named by its index and texts), or a bad
                ``truncate_prompt_tokens`` or ``user`` (nothing is queued then).
        """
        processor = self.engine.processor
        if processor.pooler is not None and processor.pooler.task == "embed":
            return self._score_embeddings(score_pairs(text_1, text_2), truncate_prompt_tokens,
                                          use_tqdm, user)
        processor.require_task("score")
        pairs = score_pairs(text_1, text_2)
        users = check_users(user, len(pairs), self.engine.config.scheduler_config.policy)
        limit = truncation_length(truncate_prompt_tokens, processor.max_model_len)  # -1: all
        prompts = []
        for i, (a, b) in enumerate(pairs):  # validate everything before queuing anything
            try:
                ids, params = pair_prompt(processor.tokenizer, a, b, limit)
                processor.make_pooling_request("check", ids, params)
            except ValueError as e:
                raise ValueError(f"pair {i} (text_1={a[:40]!r}, text_2={b[:40]!r}): {e}") \
                    from None
            prompts.append((ids, params))
        request_ids: list[str] = []
        try:
            for (ids, params), who in zip(prompts, users):
                request_ids.append(self.engine.add_pooling_request(ids, params, client_id=who))
        except BaseException:
            for rid in request_ids:
                self.engine.abort_request(rid)
            raise
        return [ScoringRequestOutput(o.request_id, o.prompt_token_ids,
                                     ScoringOutput(score_value(o.outputs.embedding)),
                                     o.finished, o.metrics)
                for o in self._run(request_ids, use_tqdm and len(request_ids) > 1)]

    def classify(self, prompts: PromptType | Sequence[PromptType], use_tqdm: bool = True,
                 user: Sequence[str] | None = None, truncate_prompt_tokens: int | None = None
                 ) -> list[ClassificationRequestOutput]:
        """A sequence classifier's class probabilities for each prompt, in order
        (``out.outputs.probs``: the softmax of its ``num_labels`` logits, the sigmoid of a
        single one; see :class:`~kvflow.outputs.ClassificationOutput`), batched like
        ``embed``. Needs an engine started with ``task="classify"`` or ``"score"`` on a
        ``*ForSequenceClassification`` model (BERT / RoBERTa / XLM-R pool their first token,
        Llama / Mistral / Qwen2 / Qwen3 their last).

        Args:
            prompts: as ``embed`` takes them (text, token ids, dict prompts, or a list).
            user: one client name per prompt (needs ``policy="fair"``), as for ``generate``.
            truncate_prompt_tokens: as ``embed`` takes it (as ``/classify`` cuts inputs).

        Raises:
            ValueError: on an engine not running ``task="classify"`` or ``"score"`` (naming
                what it runs),
                for an empty prompt, a token id outside the vocabulary or a prompt longer than
                ``max_model_len`` (naming the prompt by its index), or a bad ``user``
                (nothing is queued then).
        """
        self.engine.processor.require_task("classify")
        prompts = as_prompt_list(prompts)
        outs = self._pool(prompts, [PoolingParams(task="classify")] * len(prompts), use_tqdm,
                          user, name_prompts=True, truncate_prompt_tokens=truncate_prompt_tokens)
        return [ClassificationRequestOutput(o.request_id, o.prompt_token_ids,
                                            ClassificationOutput(o.outputs.embedding),
                                            o.finished, o.metrics)
                for o in outs]

    def _score_embeddings(self, pairs: list[tuple[str, str]],
                          truncate_prompt_tokens: int | None, use_tqdm: bool,
                          user: Sequence[str] | None) -> list[ScoringRequestOutput]:
        """``score`` on an embedding model: each distinct text embedded once (as ``embed``
        does), a pair's score the cosine similarity of its two embeddings (vLLM's rule); its
        ``prompt_token_ids`` are both texts' ids, its ``request_id`` and metrics the second
        text's request's. ``user`` names the sender of each pair (the same for its texts).

        ``truncate_prompt_tokens`` cuts each text on its own, as ``/v1/embeddings`` cuts an
        input (:func:`~kvflow.prompt_truncation.cut_text_ids`; -1: ``max_model_len``).

        Raises:
            ValueError: for a bad ``truncate_prompt_tokens``, a text the engine refuses
                (named), or a bad ``user``.
        """
        processor = self.engine.processor
        limit = truncation_length(truncate_prompt_tokens, processor.max_model_len)
        users = check_users(user, len(pairs), self.engine.config.scheduler_config.policy)
        owner = {}
        for (a, b), who in zip(pairs, users):
            owner.setdefault(a, who)
            owner.setdefault(b, who)
        for text in owner:  # name a refused text before queuing anything
            try:
                cut = cut_pooling_prompt(processor, self.get_tokenizer(), text, "embed", limit)
                processor.make_pooling_request("check", processor.pooling_prompt(cut)[1])
            except ValueError as e:
                raise ValueError(f"text {text[:40]!r}: {e}") from None
        texts = list(owner)
        outs = dict(zip(texts, self.embed(texts, use_tqdm=use_tqdm,
                                          user=None if user is None else list(owner.values()),
                                          truncate_prompt_tokens=truncate_prompt_tokens)))
        return [ScoringRequestOutput(
            outs[b].request_id, outs[a].prompt_token_ids + outs[b].prompt_token_ids,
            ScoringOutput(cosine_similarity(outs[a].outputs.embedding, outs[b].outputs.embedding)),
            outs[a].finished and outs[b].finished, outs[b].metrics) for a, b in pairs]

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             add_generation_prompt: bool = True, use_tqdm: bool = True,
             chat_template_kwargs: dict | None = None, continue_final_message: bool = False,
             chat_template: str | None = None, tools: list[dict] | None = None,
             documents: list[dict] | None = None,
             on_output: Callable[[int, RequestOutput], None] | None = None,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
             ) -> list[RequestOutput]:
        """Apply the chat template to one conversation or a list of them and generate.

        Message ``content`` may be a string, a list of text (and, for a vision-language
        model, ``image_url``) parts or None (see ``kvflow.chat_messages``; image URLs are
        ``data:`` URLs, or http(s) from ``allowed_media_domains``);
        ``continue_final_message`` continues the last (assistant)
        message instead of starting a new turn; ``chat_template`` replaces the model's;
        ``tools`` / ``documents`` / ``chat_template_kwargs`` become template variables;
        ``on_output`` is ``generate``'s (the outputs it sees have no ``prompt`` text: ``chat``
        sets it on the ones it returns); ``lora_request`` is ``generate``'s too (one adapter
        for every conversation, or one per conversation).

        Raises:
            ValueError: if the model has no chat template, or for a message or option the
                template cannot honour (``ChatTemplateError`` names the field): an
                assistant's ``tool_calls`` not in the server's shape
                (``messages.N.tool_calls.M.id`` for an empty id, ...), or a tool message's
                ``tool_call_id`` that no earlier assistant message's call has
                (``kvflow.chat_tool_calls``).
        """
        if not isinstance(messages, list) or not messages:
            raise ValueError("chat() needs a non-empty list of messages (or of conversations)")
        conversations = [messages] if isinstance(messages[0], dict) else messages
        for conversation in conversations:  # what the server's schema checks
            if isinstance(conversation, list):
                check_tool_calls(conversation)
                check_tool_call_ids(message_turns(conversation))
        options = {"continue_final_message": continue_final_message,
                   "chat_template": chat_template, "tools": tools, "documents": documents,
                   "template_kwargs": chat_template_kwargs}
        prompts = [self.engine.processor.apply_chat_template(c, add_generation_prompt,
                                                             **options)
                   for c in conversations]
        tokenizer = self.engine.tokenizer
        token_prompts = [with_images(tokenizer.encode(p, add_special_tokens=False),
                                      self.engine.processor.load_chat_images(c))
                         for p, c in zip(prompts, conversations)]
        outputs = self.generate(token_prompts, sampling_params, use_tqdm,
                                lora_request=lora_request, on_output=on_output)
        for out, text in zip(outputs, prompts):
            out.prompt = text
        return outputs

    def _run(self, request_ids: list[str], use_tqdm: bool,
             on_output: Callable[[int, Any], None] | None = None) -> list[Any]:
        finished: dict[str, Any] = {}
        index = {rid: i for i, rid in enumerate(request_ids)}
        try:
            with tqdm(total=len(request_ids), desc="Processed prompts",
                      disable=not use_tqdm) as bar:
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

