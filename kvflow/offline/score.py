"""``LLM.score`` (vLLM's offline scoring): text pairs through a cross-encoder (or a
one-label classifier), or the cosine similarity of two embeddings on an embedding model,
mixed into :class:`kvflow.offline.llm.LLM`, whose ``engine``, ``embed``, ``_queue_all`` and ``_run``
it uses."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from kvflow.engine.llm_engine import LLMEngine
from kvflow.inputs.score import (
    cosine_similarity,
    cut_pairs,
    pair_prompt,
    score_cut,
    score_extra_kwargs,
    score_pairs,
    score_use_activation,
    score_value,
    template_pair_prompt,
)
from kvflow.inputs.tokenization import POOLING_SIDE, parse_tokenization_kwargs
from kvflow.inputs.truncation import truncation_length
from kvflow.lora.request import LoRARequest
from kvflow.offline.arguments import check_users, cut_pooling_prompt, tokenized_pooling_prompt
from kvflow.offline.pooling import refuse_pooling_loras
from kvflow.outputs import ScoringOutput, ScoringRequestOutput
from kvflow.pooling_params import PoolingParams


class LLMScore:
    """``score`` of :class:`kvflow.offline.llm.LLM` (a mixin: ``LLM`` sets ``engine`` and defines
    ``get_tokenizer``, ``embed``, ``_queue_all`` and ``_run``)."""

    engine: LLMEngine
    get_tokenizer: Callable[[], Any]
    embed: Callable[..., list[Any]]
    _queue_all: Callable[..., list[str]]
    _run: Callable[..., list[Any]]

    def score(self, text_1: str | Sequence[str], text_2: str | Sequence[str],
              truncate_prompt_tokens: int | None = None,
              use_tqdm: bool | Callable[..., Any] = True,
              user: Sequence[str] | None = None,
              pooling_params: PoolingParams | None = None,
              lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None, *,
              tokenization_kwargs: dict[str, Any] | None = None,
              chat_template: str | None = None
              ) -> list[ScoringRequestOutput]:
        """A cross-encoder's score of each text pair, in pair order
        (``out.outputs.score``; see :class:`~kvflow.outputs.ScoringOutput`).

        Args:
            text_1 / text_2: a string or a list of strings: one text against one or each of
                N texts (1-to-N), or two lists of the same length paired item by item
                (N-to-N) (``kvflow.inputs.score.score_pairs``).
            truncate_prompt_tokens: cut each pair to at most this many tokens as vLLM's
                pooling runner cuts it (the longer text first, each keeping its first
                tokens: :func:`~kvflow.inputs.score.pair_prompt`); None: a pair longer than
                ``max_model_len`` is refused.
            user: one client name per pair (needs ``policy="fair"``), as for ``generate``.
            pooling_params: vLLM's: its ``use_activation`` / ``activation`` (False: each
                pair's raw head logits instead of the score activation) and vLLM 0.32's
                ``extra_kwargs``: ``max_tokens_per_query`` / ``max_tokens_per_doc`` (each
                first / second text cut to its first N tokens, special tokens not counted, at
                a character boundary, before the pair is tokenized or, on an embedding model,
                each text embedded: :func:`~kvflow.inputs.score.cut_text`, as /v1/score
                cuts; 0: no cut) and ``chat_template_kwargs`` (``chat_template``'s further
                variables, e.g. ``instruction``); None: the defaults.
            lora_request: vLLM's keyword: None (or None per pair); pooling engines run no
                adapters (see :func:`refuse_pooling_loras`).
            tokenization_kwargs: vLLM 0.32's keyword: the cut of each pair
                (``truncate_prompt_tokens``, ``truncation`` with ``max_length``,
                ``truncation_side``: :func:`~kvflow.inputs.score.score_cut`), instead of the
                ``truncate_prompt_tokens`` argument; on an embedding model, ``embed``'s.
            chat_template: vLLM 0.32's keyword: a cross-encoder reads each pair as this
                template renders it (``query`` and ``document`` messages, one sequence:
                :func:`~kvflow.inputs.score.template_pair_prompt`), e.g. a Qwen3 reranker's
                prompt; None: the tokenizer's text-pair encoding (the model's own chat
                template is not used, as in vLLM).

        vLLM 0.32's form, ``llm.score(data_1, data_2, use_tqdm=..., pooling_params=...,
        lora_request=..., tokenization_kwargs=..., chat_template=...)``, is taken as it is
        (the two texts positional, the rest by keyword).

        On an embedding model (``task="embed"``) a pair's score is the cosine similarity of
        its two texts' embeddings, as vLLM scores with embedding models
        (``_score_embeddings``).

        A ``task="classify"`` engine scores too when its classifier has one label (vLLM's
        rule: a relevance logit, through a sigmoid).

        Raises:
            ValueError: on a generating engine or a classify engine whose classifier has
                several labels, for bad ``text_1`` / ``text_2`` (named), a
                pair longer than ``max_model_len`` (named by its index and texts), or a bad
                ``truncate_prompt_tokens`` or ``user``, pooling_params of another task or
                with fields other than ``activation``, ``activation`` or ``chat_template``
                on an embedding model (cosine similarity has neither), a LoRA adapter,
                ``tokenization_kwargs`` :func:`~kvflow.inputs.score.score_cut` refuses,
                ``extra_kwargs`` :func:`~kvflow.inputs.score.score_extra_kwargs` refuses, or a
                ``chat_template`` that cannot render a pair (nothing is queued then).
        """
        processor = self.engine.processor
        use_activation = score_use_activation(pooling_params)
        limits, template_kwargs = score_extra_kwargs(pooling_params, processor.max_model_len,
                                                     chat_template)
        if processor.pooler is not None and processor.pooler.task == "embed":
            _refuse_cosine_options(use_activation, chat_template)
            pairs = _adapterless_pairs(text_1, text_2, lora_request)
            return self._score_embeddings(cut_pairs(pairs, self.get_tokenizer(), limits),
                                          truncate_prompt_tokens, use_tqdm, user,
                                          tokenization_kwargs)
        processor.require_task("score")
        pairs = _adapterless_pairs(text_1, text_2, lora_request)
        users = check_users(user, len(pairs), self.engine.config.scheduler_config.policy)
        cut = score_cut(tokenization_kwargs, processor.max_model_len, truncate_prompt_tokens)
        prompts = self._pair_requests(cut_pairs(pairs, processor.tokenizer, limits), cut,
                                      use_activation, chat_template, template_kwargs)
        return [_scoring_output(o) for o in self._run(self._queue_all(prompts, users), use_tqdm)]

    def _pair_requests(self, pairs: list[tuple[str, str]], cut: tuple[int | None, str | None],
                       use_activation: bool | None, chat_template: str | None = None,
                       template_kwargs: dict[str, Any] | None = None
                       ) -> list[tuple[list[int], PoolingParams]]:
        """Each pair's cross-encoder prompt (token ids, cut as ``cut`` says: tokens kept, None:
        not cut, and the ``truncation_side``; rendered by ``chat_template`` when given, with
        ``template_kwargs`` as its further variables) and score params, all checked by the
        engine before any is queued.

        Raises:
            ValueError: naming the first pair (index and texts) the engine refuses.
        """
        processor = self.engine.processor
        prompts = []
        for i, (a, b) in enumerate(pairs):
            try:
                if chat_template is None:
                    ids, params = pair_prompt(processor.tokenizer, a, b, *cut)
                else:
                    ids, params = template_pair_prompt(processor.tokenizer, chat_template, a, b,
                                                       *cut, template_kwargs)
                params = dataclasses.replace(params, use_activation=use_activation)
                processor.make_pooling_request("check", ids, params)
            except ValueError as e:
                raise ValueError(f"pair {i} (text_1={a[:40]!r}, text_2={b[:40]!r}): {e}") \
                    from None
            prompts.append((ids, params))
        return prompts

    def _score_embeddings(self, pairs: list[tuple[str, str]],
                          truncate_prompt_tokens: int | None, use_tqdm: bool | Callable[..., Any],
                          user: Sequence[str] | None,
                          tokenization_kwargs: dict[str, Any] | None = None
                          ) -> list[ScoringRequestOutput]:
        """``score`` on an embedding model: each distinct text embedded once (as ``embed``
        does, ``tokenization_kwargs`` included), a pair's score the cosine similarity of its
        two embeddings (vLLM's rule); its ``prompt_token_ids`` are both texts' ids, its
        ``request_id`` and metrics the second text's request's. ``user`` names the sender of
        each pair (the same for its texts).

        ``truncate_prompt_tokens`` cuts each text on its own, as ``/v1/embeddings`` cuts an
        input (its first tokens kept: :func:`~kvflow.offline.arguments.cut_pooling_prompt`; -1:
        ``max_model_len``).

        Raises:
            ValueError: for a bad ``truncate_prompt_tokens``, ``tokenization_kwargs`` or
                ``user``, or a text the engine refuses (named).
        """
        processor, tokenizer = self.engine.processor, self.get_tokenizer()
        limit = truncation_length(truncate_prompt_tokens, processor.max_model_len)
        options = parse_tokenization_kwargs(tokenization_kwargs, processor.max_model_len,
                                            default_side=POOLING_SIDE)
        side = options.side if options is not None and options.side_given else None
        users = check_users(user, len(pairs), self.engine.config.scheduler_config.policy)
        owner = {}
        for (a, b), who in zip(pairs, users):
            owner.setdefault(a, who)
            owner.setdefault(b, who)
        for text in owner:  # name a refused text before queuing anything (as embed checks)
            try:
                p = tokenized_pooling_prompt(processor, tokenizer, text, "embed", options)
                cut = cut_pooling_prompt(processor, tokenizer, p, "embed", limit, side)
                processor.make_pooling_request("check", processor.pooling_prompt(cut)[1])
            except ValueError as e:
                raise ValueError(f"text {text[:40]!r}: {e}") from None
        texts = list(owner)
        outs = dict(zip(texts, self.embed(texts, use_tqdm=use_tqdm,
                                          user=None if user is None else list(owner.values()),
                                          truncate_prompt_tokens=truncate_prompt_tokens,
                                          tokenization_kwargs=tokenization_kwargs)))
        return [ScoringRequestOutput(
            outs[b].request_id, outs[a].prompt_token_ids + outs[b].prompt_token_ids,
            ScoringOutput(cosine_similarity(outs[a].outputs.embedding, outs[b].outputs.embedding)),
            outs[a].finished and outs[b].finished, outs[b].metrics) for a, b in pairs]


def _refuse_cosine_options(use_activation: bool | None, chat_template: str | None) -> None:
    """An embedding model scores by cosine similarity: no activation, no pair template.

    Raises:
        ValueError: naming ``activation`` or ``chat_template`` when given.
    """
    for name, value, what in (("activation", use_activation, "activation to turn off"),
                              ("chat_template", chat_template, "pair to render")):
        if value is not None:
            raise ValueError(f"{name}: an embedding model scores by cosine "
                             f"similarity, which has no {what}")


def _adapterless_pairs(text_1: str | Sequence[str], text_2: str | Sequence[str],
                       lora_request: LoRARequest | Sequence[LoRARequest | None] | None
                       ) -> list[tuple[str, str]]:
    """The (text_1, text_2) pairs ``score`` scores (1-to-N or N-to-N:
    :func:`~kvflow.inputs.score.score_pairs`), with no adapter for any of them.

    Raises:
        ValueError: for bad ``text_1`` / ``text_2`` (named) or a LoRA adapter
            (:func:`~kvflow.offline.pooling.refuse_pooling_loras`).
    """
    pairs = score_pairs(text_1, text_2)
    refuse_pooling_loras(lora_request, len(pairs))
    return pairs


def _scoring_output(out: Any) -> ScoringRequestOutput:
    """A cross-encoder pair's engine output (``outputs.embedding``: the head's output) as
    its score (:func:`~kvflow.inputs.score.score_value`)."""
    return ScoringRequestOutput(out.request_id, out.prompt_token_ids,
                                ScoringOutput(score_value(out.outputs.embedding)),
                                out.finished, out.metrics)
