"""Checking and broadcasting ``LLM``'s per-call arguments: the prompts as a list, one
SamplingParams (or PoolingParams), LoRARequest, priority and client name per prompt,
``encode``'s pooling task, and beam search's prompts
(``kvflow/offline/llm.py`` calls these before queuing anything, so a bad argument queues nothing)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from kvflow.config.scheduler import check_priority
from kvflow.inputs.processor import InputProcessor
from kvflow.inputs.prompts import ProcessedPrompt, PromptType
from kvflow.inputs.tokenization import (
    TokenizationOptions,
    cut_generation_prompt,
    parse_tokenization_kwargs,
    pooling_cut,
)
from kvflow.inputs.truncation import SAMPLING_FIELD, keep_last_tokens, truncation_length
from kvflow.lora.request import LoRARequest
from kvflow.pooling_params import PoolingParams
from kvflow.sampling_params import SamplingParams


def with_images(token_ids: list[int], images: list[Any], videos: Sequence[Any] = ()
                ) -> PromptType:
    """A token-id prompt, as a dict with its images and videos (each a list of frames) when
    it has some."""
    if not images and not videos:
        return token_ids
    data: dict[str, Any] = {"image": images}
    if videos:
        data["video"] = list(videos)
    return {"prompt_token_ids": token_ids, "multi_modal_data": data}


def as_prompt_list(prompts: Any) -> list[PromptType]:
    """``prompts`` (one prompt: a string, a dict prompt or a list of token ids; or a list or
    tuple of prompts) as a list of prompts.

    Raises:
        ValueError: for anything else, naming what it got and the accepted forms (a numpy
            array or torch tensor of token ids is pointed to ``.tolist()``).
    """
    if isinstance(prompts, (str, Mapping)):
        return [prompts]
    if isinstance(prompts, (list, tuple)) and prompts and all(isinstance(t, int) for t in prompts):
        return [list(prompts)]
    if not isinstance(prompts, (list, tuple)):  # ValueError, like every bad input here
        hint = " (token ids in an array or tensor: pass prompts.tolist())" \
            if hasattr(prompts, "tolist") else ""
        raise ValueError(  # noqa: TRY004 (bad input is a ValueError throughout kvflow)
            f"prompts must be a string, a list of token ids, a dict prompt (TextPrompt "
            f"{{'prompt': ...}}, TokensPrompt {{'prompt_token_ids': [...]}} or EmbedsPrompt "
            f"{{'prompt_embeds': tensor}}, with 'multi_modal_data' for images), or a list "
            f"of these; got {type(prompts).__name__}{hint}")
    return list(prompts)


def broadcast_params(params: Any, n: int) -> list[SamplingParams]:
    """One SamplingParams per prompt (the defaults when None, one repeated, or a list of n).

    Raises:
        ValueError: for a list of the wrong length or of other things.
    """
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    if not isinstance(params, (list, tuple)):
        raise ValueError(  # noqa: TRY004 (bad input is a ValueError throughout kvflow)
            "sampling_params must be a SamplingParams, a list of them (one per prompt) or "
            f"None, got {type(params).__name__}")
    _check_items("sampling_params", params, SamplingParams)
    params = list(params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} SamplingParams for {n} prompts")
    return params


def broadcast_pooling_params(params: Any, n: int) -> list[PoolingParams | None]:
    """One PoolingParams (or None: the defaults) per prompt: None or one repeated, or a list
    of n.

    Raises:
        ValueError: for a list of the wrong length or of other things.
    """
    if params is None or isinstance(params, PoolingParams):
        return [params] * n
    if not isinstance(params, (list, tuple)):
        raise ValueError(  # noqa: TRY004 (bad input is a ValueError throughout kvflow)
            "pooling_params must be a PoolingParams, a list of them (one per prompt) or "
            f"None, got {type(params).__name__}")
    _check_items("pooling_params", params, PoolingParams)
    if len(params) != n:
        raise ValueError(f"got {len(params)} PoolingParams for {n} prompts")
    return list(params)


def _check_items(name: str, items: Sequence[Any], cls: type) -> None:
    """Raises ValueError naming ``name[i]`` and its type for the first item of ``items``
    that is not a ``cls``."""
    bad = next((i for i, p in enumerate(items) if not isinstance(p, cls)), None)
    if bad is not None:
        raise ValueError(f"{name}[{bad}] must be a {cls.__name__}, got "
                         f"{type(items[bad]).__name__}")


# vLLM's pooling tasks that LLM.encode does not run, and what to use instead
OTHER_POOLING_TASKS = {
    "score": "score text pairs with LLM.score",
    "encode": "vLLM 0.10's per-token task is 'token_embed' (an embedding engine) or "
              "'token_classify' (a token classifier) here",
}
ENCODE_TASKS = ("embed", "classify", "token_embed", "token_classify")


def resolve_pooling_task(processor: InputProcessor, task: str | None) -> str:
    """``LLM.encode``'s task: ``task``, else the engine's (``embed`` on an embedding engine,
    ``token_classify`` on a token classifier, else ``classify``, which score engines run
    too).

    Raises:
        ValueError: on a generating engine, for a task the engine does not run (naming what
            it runs), one of ``OTHER_POOLING_TASKS``, an unknown one or a non-string.
    """
    if task is not None and not isinstance(task, str):
        raise ValueError(f"pooling_task={task!r} must be a string, one of "
                         f"{', '.join(ENCODE_TASKS)}, or None")
    if task in OTHER_POOLING_TASKS:
        raise ValueError(f"pooling_task={task!r} is not supported: {OTHER_POOLING_TASKS[task]}")
    if task is not None and task not in ENCODE_TASKS:
        raise ValueError(f"pooling_task={task!r} must be one of {', '.join(ENCODE_TASKS)} or "
                         "None")
    pooler = processor.pooler
    if task is None:
        task = "embed" if pooler is None or pooler.task == "embed" else \
            "token_classify" if pooler.task == "token_classify" else "classify"
    processor.require_task(task)
    return task


def with_pooling_task(params: PoolingParams | None, task: str) -> PoolingParams:
    """``params`` (None: the defaults) for ``task``: its ``task`` set when it is the default
    (``embed``), so that ``normalize`` and the rest are checked for ``task``.

    Raises:
        ValueError: for params of another explicit task, or fields ``task`` refuses
            (``normalize`` for ``classify`` / ``token_classify``).
    """
    if params is None:
        return PoolingParams(task=task)
    if params.task not in ("embed", task):
        raise ValueError(f"PoolingParams.task={params.task!r} but the pooling task is "
                         f"{task!r}")
    return params if params.task == task else dataclasses.replace(params, task=task)


def broadcast_loras(lora: Any, n: int) -> list[LoRARequest | None]:
    """One LoRARequest (or None) per prompt.

    Raises:
        ValueError: for a list of the wrong length or of other things.
    """
    if lora is None or isinstance(lora, LoRARequest):
        return [lora] * n
    loras = list(lora) if isinstance(lora, (list, tuple)) else None
    if loras is None or len(loras) != n or \
            not all(x is None or isinstance(x, LoRARequest) for x in loras):
        raise ValueError(f"lora_request must be a LoRARequest, None, or a list of {n} of them "
                         f"(one per prompt), got {lora!r}")
    return loras


def check_priorities(priority: int | Sequence[int] | None, n: int, policy: str) -> list[int]:
    """One priority per prompt (0 when None; one integer is every prompt's, as vLLM's
    ``LLM.generate`` takes it).

    Raises:
        ValueError: for a value that is neither an integer nor a list, a wrong count, a
            non-integer, or a non-zero priority while the scheduling policy is not
            ``priority`` (it would be ignored).
    """
    if priority is None:
        return [0] * n
    if isinstance(priority, int) and not isinstance(priority, bool):
        priority = [priority] * n
    try:  # a bare int is no list: named below, not a TypeError from list()
        priorities = list(priority)
    except TypeError:
        priorities = None
    if priorities is None or len(priorities) != n or not all(isinstance(p, int) and not isinstance(p, bool)
                                       for p in priorities):
        raise ValueError(f"priority must be an integer or a list of {n} integers (one per "
                         f"prompt), got {priority!r}")
    for p in priorities:  # the scheduler's rule: a nonzero one needs priority or fair
        check_priority(p, policy)
    return priorities


def check_concurrency_limit(limit: Any) -> None:
    """``LLM.beam_search``'s ``concurrency_limit``: None or an integer >= 1.

    Raises:
        ValueError: naming ``concurrency_limit`` for anything else.
    """
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int)
                              or limit < 1):
        raise ValueError(f"concurrency_limit must be an integer >= 1 or None, got {limit!r}")


def check_users(user: Sequence[str] | None, n: int, policy: str) -> list[str]:
    """One client name per prompt ("" when None).

    Raises:
        ValueError: for a value that is not a list or tuple, a wrong count, a name that is
            not a string, or a name while the
            scheduling policy is not ``fair`` (the only one that reads it: it would be
            ignored).
    """
    if user is None:
        return [""] * n
    users = list(user) if isinstance(user, (list, tuple)) else []
    if len(users) != n or not all(isinstance(u, str) for u in users):
        raise ValueError(f"user must be a list of {n} strings (one per prompt), got {user!r}")
    if policy != "fair" and any(users):
        raise ValueError(f"user={users} needs the fair scheduling policy (policy='fair'); "
                         f"this engine runs {policy!r}")
    return users


def refuse_server_options(admission_control: bool, idle_batch_window_ms: float = 0.0) -> None:
    """Raises ValueError for ``admission_control`` or a nonzero ``idle_batch_window_ms``:
    server options (offline requests are never refused, and all of them are queued before
    the first step, so there is no arrival to wait for: either would be ignored)."""
    if admission_control:
        raise ValueError("admission_control is a server option (kvflow serve "
                         "--admission-control): LLM.generate never refuses a request")
    if idle_batch_window_ms:
        raise ValueError(f"idle_batch_window_ms={idle_batch_window_ms} is a server option "
                         "(kvflow serve --idle-batch-window-ms): LLM.generate queues every "
                         "prompt before its first step, so there is no arrival to wait for")


def refuse_data_parallel_rank(kwargs: dict[str, Any]) -> None:
    """Raises ValueError when ``LLM(...)`` is given ``data_parallel_rank``: kvflow sets it for
    each replica that ``data_parallel_size`` starts, and vLLM's meaning of it (this process
    is that one replica of a deployment balanced outside, one ``LLM`` per rank) is not built,
    so it was silently ignored: every such process ran all the replicas."""
    if "data_parallel_rank" in kwargs:
        raise ValueError(f"data_parallel_rank={kwargs['data_parallel_rank']!r}: kvflow sets "
                         "each replica's rank itself; LLM(..., data_parallel_size=N) runs all "
                         "N replicas in this LLM (one LLM per rank, balanced outside, as in "
                         "vLLM's external load balancing, is not available): drop it")


def beam_search_prompts(processor: InputProcessor, prompts: list[PromptType],
                        max_tokens: int) -> list[ProcessedPrompt]:
    """``LLM.beam_search``'s prompts, processed and checked before any step runs: token ids
    (and a dict prompt's ``cache_salt``), each leaving room for ``max_tokens``.

    Raises:
        ValueError: ``prompt i: ...`` for a bad prompt, images or prompt embeddings (each
            step is a new token-id prompt), or a prompt that leaves no room for
            ``max_tokens`` in ``max_model_len``.
    """
    checked = []
    for i, prompt in enumerate(prompts):
        try:
            p = processor.process(prompt)
            processor.validate(p.token_ids)
        except ValueError as e:
            raise ValueError(f"prompt {i}: {e}") from None
        if p.mm_features:
            raise ValueError(f"prompt {i}: beam search takes no multi_modal_data")
        if p.prompt_embeds is not None:  # each step is a new token-id prompt
            raise ValueError(f"prompt {i}: beam search takes no prompt_embeds (generation "
                             "only, with LLM.generate)")
        if len(p.token_ids) + max_tokens > processor.max_model_len:
            raise ValueError(f"prompt {i} has {len(p.token_ids)} tokens: with "
                             f"max_tokens={max_tokens} it exceeds max_model_len "
                             f"({processor.max_model_len})")
        checked.append(p)
    return checked


def processed_prompts(processor: InputProcessor, prompts: list[PromptType],
                      params: list[SamplingParams],
                      tokenization_kwargs: dict[str, Any] | None = None,
                      mm_processor_kwargs: dict[str, Any] | None = None
                      ) -> list[ProcessedPrompt]:
    """Each prompt processed (tokenized as ``tokenization_kwargs`` say, see
    :mod:`kvflow.inputs.tokenization`; images decoded, preprocessed with
    ``mm_processor_kwargs`` and expanded; prompt embeddings cut to their last
    ``truncate_prompt_tokens`` rows) and checked against the context as
    ``params[i].truncate_prompt_tokens`` leaves it: the kept tokens are what must fit
    (vLLM's order), so nothing is queued if one does not.

    Raises:
        ValueError: for a bad prompt, ``tokenization_kwargs`` or truncation
            (``SamplingParams.truncate_prompt_tokens`` above ``max_model_len``), or kept
            tokens that do not fit. Of several prompts, an empty one, one with an id
            outside the vocabulary or one that does not fit is named by its index,
            ``prompt i: ...``, as ``beam_search`` and ``classify`` name it.
    """
    options = parse_tokenization_kwargs(tokenization_kwargs, processor.max_model_len,
                                        generation=True)
    limits = [truncation_length(p.truncate_prompt_tokens, processor.max_model_len,
                                SAMPLING_FIELD, generation=True) for p in params]
    processed = [processor.process(p, keep_last=limit, options=options,
                                   mm_kwargs=mm_processor_kwargs)
                 for p, limit in zip(prompts, limits)]
    processed = [_cut_text_prompt(processor.tokenizer, raw, p, limit, options)
                 for raw, p, limit in zip(prompts, processed, limits)]
    for i, (p, limit) in enumerate(zip(processed, limits)):
        try:
            processor.validate(keep_last_tokens(p.token_ids, limit))
        except ValueError as e:
            if len(processed) == 1:
                raise
            raise ValueError(f"prompt {i}: {e}") from None
    return processed



def _cut_text_prompt(tokenizer: Any, raw: PromptType, prompt: ProcessedPrompt,
                     limit: int | None, options: TokenizationOptions | None
                     ) -> ProcessedPrompt:
    """A text prompt (``raw``: a str or ``{"prompt": str}``, no images) cut to ``limit``
    tokens (``SamplingParams.truncate_prompt_tokens``) as vLLM 0.32 cuts it: the tokenizer's
    left truncation, so the special tokens it adds (a BOS) stay
    (``tokenization_options.cut_generation_prompt``, the server's cut). Others, and a text
    tokenized without special tokens, with a ``truncation_side``, lower-cased or padded by
    ``options``, are unchanged here (``make_requests`` keeps their last ``limit``)."""
    text = raw if isinstance(raw, str) else raw.get("prompt") if isinstance(raw, Mapping) \
        and set(raw) <= {"prompt", "cache_salt", "mm_processor_kwargs"} else None
    plain = options is None or (options.add_special_tokens and not options.side_given
                                and not options.do_lower_case and options.pad_to is None)
    if limit is None or not isinstance(text, str) or not plain or prompt.mm_features \
            or len(prompt.token_ids) <= limit:
        return prompt
    return dataclasses.replace(prompt, token_ids=cut_generation_prompt(
        tokenizer, text, prompt.token_ids, limit, True))


def tokenized_pooling_prompt(processor: InputProcessor, tokenizer: Any, prompt: PromptType,
                             task: str, options: TokenizationOptions | None) -> PromptType:
    """A pooling prompt tokenized, cut and padded as a call's ``tokenization_kwargs`` say
    (``options``; None: ``prompt`` unchanged): a text as ``InputProcessor.pooling_text``
    prepares it, encoded with ``options``; token ids reshaped. The result is a token-id
    list.

    Raises:
        ValueError: for a prompt ``InputProcessor.pooling_prompt`` refuses for ``task``, or
            padding without a pad token.
    """
    if options is None:
        return prompt
    text, ids = processor.pooling_prompt(prompt, task)
    if text is None:
        return options.reshape(tokenizer, ids)
    return options.encode(tokenizer, processor.pooling_text(text))


def cut_pooling_prompt(processor: InputProcessor, tokenizer: Any, prompt: PromptType,
                       task: str, limit: int | None, side: str | None = None) -> PromptType:
    """A pooling prompt cut to ``limit`` tokens as vLLM's pooling requests cut their inputs
    (``limit`` from :func:`~kvflow.inputs.truncation.truncation_length`; None: ``prompt``
    unchanged; ``side``: their ``truncation_side``, see
    :func:`~kvflow.inputs.tokenization.pooling_cut`): by default a text as the tokenizer
    truncates it on the right (its special tokens kept), token ids to their first
    ``limit``; a cut prompt is its token-id list.

    Raises:
        ValueError: for a prompt ``InputProcessor.pooling_prompt`` refuses for ``task``.
    """
    if limit is None:
        return prompt
    text, ids = processor.pooling_prompt(prompt, task)
    cut = pooling_cut(limit, side)
    return cut.reshape(tokenizer, ids) if text is None else \
        cut.encode(tokenizer, processor.pooling_text(text))
