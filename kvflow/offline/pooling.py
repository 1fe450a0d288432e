"""``LLM``'s pooling half (vLLM's offline pooling API): ``embed``, ``encode`` and
``classify`` over an embedding or classification engine (``score``:
:mod:`kvflow.offline.score`), mixed into :class:`kvflow.offline.llm.LLM`, whose ``engine``,
``get_tokenizer`` and ``_run`` it uses."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvflow.engine.llm_engine import LLMEngine
from kvflow.inputs.prompts import PromptType
from kvflow.inputs.tokenization import POOLING_SIDE, parse_tokenization_kwargs
from kvflow.inputs.truncation import truncation_length
from kvflow.lora.request import LoRARequest
from kvflow.offline.arguments import (
    as_prompt_list,
    broadcast_loras,
    broadcast_pooling_params,
    check_users,
    cut_pooling_prompt,
    resolve_pooling_task,
    tokenized_pooling_prompt,
    with_pooling_task,
)
from kvflow.outputs import (
    ClassificationOutput,
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    PoolingOutput,
    PoolingRequestOutput,
    token_rows,
)
from kvflow.pooling_params import TOKEN_TASKS, PoolingParams


class LLMPooling:
    """The pooling methods of :class:`kvflow.offline.llm.LLM` (a mixin: ``LLM`` sets ``engine``
    and defines ``get_tokenizer`` and ``_run``)."""

    engine: LLMEngine

    def embed(self, prompts: PromptType | Sequence[PromptType],
              pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
              use_tqdm: bool | Callable[..., Any] = True, user: Sequence[str] | None = None,
              truncate_prompt_tokens: int | None = None,
              lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None, *,
              tokenization_kwargs: dict[str, Any] | None = None
              ) -> list[EmbeddingRequestOutput]:
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
                ``max_model_len``), as ``/v1/embeddings`` and vLLM's pooling runner cut an
                input: its FIRST ``k`` tokens kept, a text as the tokenizer truncates it on
                the right (its special tokens counted), token ids to their first ``k``
                (``tokenization_kwargs``' ``truncation_side="left"`` keeps the last ``k``
                instead); None: a prompt longer than ``max_model_len`` is refused.
            lora_request: vLLM's keyword: None (or None per prompt); pooling engines run no
                adapters (see :func:`refuse_pooling_loras`).
            tokenization_kwargs: as ``LLM.generate`` takes them (vLLM's overrides for
                ``tokenizer.encode``), applied before ``truncate_prompt_tokens`` (whose cut
                takes their ``truncation_side``); without a ``truncation_side`` they cut on
                the right (the first tokens kept), as vLLM's pooling runner does.

        Raises:
            ValueError: on a generation model (start it with ``task="embed"``), for a bad
                prompt, ``dimensions`` or ``truncate_prompt_tokens``, a ``user`` list
                ``generate`` would refuse, or a LoRA adapter (nothing is queued then).
        """
        prompts = as_prompt_list(prompts)
        refuse_pooling_loras(lora_request, len(prompts))
        params = broadcast_pooling_params(pooling_params, len(prompts))
        if any(p is not None and p.task != "embed" for p in params):
            raise ValueError("LLM.embed takes PoolingParams with task='embed'; score text pairs "
                             "with LLM.score, classify texts with LLM.classify")
        return self._pool(prompts, params, use_tqdm, user,
                          truncate_prompt_tokens=truncate_prompt_tokens,
                          tokenization_kwargs=tokenization_kwargs)

    def encode(self, prompts: PromptType | Sequence[PromptType],
               pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
               use_tqdm: bool | Callable[..., Any] = True,
               lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
               pooling_task: str | None = None, user: Sequence[str] | None = None,
               truncate_prompt_tokens: int | None = None, *,
               tokenization_kwargs: dict[str, Any] | None = None
               ) -> list[PoolingRequestOutput]:
        """vLLM's ``LLM.encode``: each prompt's pooled output as a float32 tensor
        (``out.outputs.data``): the embedding (as ``embed``, [hidden] or [dimensions]) or
        the class probabilities (as ``classify``, [num_labels]); or vLLM's per-token tasks,
        one row per prompt token: ``token_embed`` every token's final hidden state
        ([num_prompt_tokens, hidden], each row normalized as ``embed`` normalizes its
        vector, cut to ``dimensions``) and ``token_classify`` a token classifier's class
        probabilities ([num_prompt_tokens, num_labels]). Batched like ``embed``; a per-token
        request computes its whole prompt (no prefix-cache hit).

        Args:
            prompts: as ``embed`` takes them.
            pooling_params: one for all prompts or one per prompt (None: the defaults);
                their ``task`` is set to the pooling task.
            lora_request: None (or None per prompt): pooling engines run no adapters (see
                :func:`refuse_pooling_loras`).
            pooling_task: ``"embed"``, ``"classify"``, ``"token_embed"`` or
                ``"token_classify"``, where the engine runs it; None: the engine's (``embed``
                on an embedding engine, ``token_classify`` on a token classifier, else
                ``classify``).
            user: one client name per prompt (needs ``policy="fair"``), as for ``generate``.
            truncate_prompt_tokens: as ``embed`` takes it.
            tokenization_kwargs: as ``embed`` takes them.

        Raises:
            ValueError: on a generating engine, for a pooling task the engine does not run
                (or ``score`` and vLLM 0.10's ``encode``, which kvflow's encode does not run),
                a LoRA adapter, PoolingParams of another task or with fields the task
                refuses, or what ``embed`` refuses (nothing is queued then).
        """
        task = resolve_pooling_task(self.engine.processor, pooling_task)
        prompts = as_prompt_list(prompts)
        refuse_pooling_loras(lora_request, len(prompts))
        params = [with_pooling_task(p, task)
                  for p in broadcast_pooling_params(pooling_params, len(prompts))]
        per_token = task in TOKEN_TASKS
        return [PoolingRequestOutput(o.request_id, o.prompt_token_ids, PoolingOutput(
                    token_rows(o.outputs.embedding, len(o.prompt_token_ids)) if per_token
                    else torch.tensor(o.outputs.embedding, dtype=torch.float32)),
                    o.finished, o.metrics)
                for o in self._pool(prompts, params, use_tqdm, user,
                                    truncate_prompt_tokens=truncate_prompt_tokens,
                                    tokenization_kwargs=tokenization_kwargs)]

    def _pool(self, prompts: list[PromptType], params: list[PoolingParams | None],
              use_tqdm: bool | Callable[..., Any], user: Sequence[str] | None,
              name_prompts: bool = False,
              truncate_prompt_tokens: int | None = None,
              tokenization_kwargs: dict[str, Any] | None = None
              ) -> list[EmbeddingRequestOutput]:
        """Queue one pooling request per prompt (with its params; None: an embedding's
        defaults) after checking them all, run them; outputs in prompt order. Each prompt is
        first tokenized as ``tokenization_kwargs`` say (``tokenized_pooling_prompt``), then
        cut to ``truncate_prompt_tokens`` (``cut_pooling_prompt``).

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
        options = parse_tokenization_kwargs(tokenization_kwargs, processor.max_model_len,
                                            default_side=POOLING_SIDE)
        side = options.side if options is not None and options.side_given else None
        prompts = list(prompts)
        for i, (p, pp) in enumerate(zip(prompts, params)):  # check all before queuing any
            task = pp.task if pp is not None else "embed"
            try:
                p = tokenized_pooling_prompt(processor, self.get_tokenizer(), p, task, options)
                prompts[i] = cut_pooling_prompt(processor, self.get_tokenizer(), p, task, limit,
                                                side)
                processor.make_pooling_request(
                    "check", processor.pooling_prompt(prompts[i], task)[1], pp)
            except ValueError as e:
                if not name_prompts:
                    raise
                raise ValueError(f"prompt {i}: {e}") from None
        ids = self._queue_all(list(zip(prompts, params)), users)
        return self._run(ids, use_tqdm)

    def _queue_all(self, requests: Sequence[tuple[Any, PoolingParams | None]],
                   users: Sequence[str]) -> list[str]:
        """Queue each ``(prompt, params)`` pooling request for its user; their request ids,
        in order. If one fails (or the caller is interrupted) those already queued are
        aborted and the error re-raised, so nothing stays queued."""
        ids: list[str] = []
        try:
            for (p, pp), who in zip(requests, users):
                ids.append(self.engine.add_pooling_request(p, pp, client_id=who))
        except BaseException:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        return ids

    def classify(self, prompts: PromptType | Sequence[PromptType],
                 use_tqdm: bool | Callable[..., Any] = True,
                 user: Sequence[str] | None = None, truncate_prompt_tokens: int | None = None,
                 pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None, *,
                 tokenization_kwargs: dict[str, Any] | None = None
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
            pooling_params: one for all prompts or one per prompt (None: the defaults), their
                ``task`` set to ``classify``: ``use_activation`` / ``activation`` False gives
                the head's raw logits in ``probs`` instead of their softmax / sigmoid.
            lora_request: vLLM's keyword: None (or None per prompt); pooling engines run no
                adapters (see :func:`refuse_pooling_loras`).
            tokenization_kwargs: as ``embed`` takes them.

        Raises:
            ValueError: on an engine not running ``task="classify"`` or ``"score"`` (naming
                what it runs),
                for an empty prompt, a token id outside the vocabulary or a prompt longer than
                ``max_model_len`` (naming the prompt by its index), a bad ``user``, or
                pooling_params of another task or with embedding fields, or a LoRA adapter
                (nothing is queued then).
        """
        self.engine.processor.require_task("classify")
        prompts = as_prompt_list(prompts)
        refuse_pooling_loras(lora_request, len(prompts))
        params = [with_pooling_task(p, "classify")
                  for p in broadcast_pooling_params(pooling_params, len(prompts))]
        outs = self._pool(prompts, params, use_tqdm, user, name_prompts=True,
                          truncate_prompt_tokens=truncate_prompt_tokens,
                          tokenization_kwargs=tokenization_kwargs)
        return [ClassificationRequestOutput(o.request_id, o.prompt_token_ids,
                                            ClassificationOutput(o.outputs.embedding),
                                            o.finished, o.metrics)
                for o in outs]

def refuse_pooling_loras(lora_request: Any, count: int) -> None:
    """``lora_request`` of a pooling call (``embed``, ``encode``, ``classify``, ``score``,
    which take vLLM's keyword): None, or None for each of the ``count`` prompts (or pairs).
    vLLM runs adapters on pooling models; kvflow runs them on generating engines only (a
    pooling engine refuses ``enable_lora`` at start), so an adapter is refused, never
    ignored.

    Raises:
        ValueError: for an adapter, or a ``lora_request`` that is not None, a LoRARequest or
            a list of ``count`` of them.
    """
    if any(lora is not None for lora in broadcast_loras(lora_request, count)):
        raise ValueError("lora_request: a pooling engine runs no LoRA adapters (LoRA is "
                         "refused with a pooling task; kvflow applies adapters to text "
                         "generation only)")
