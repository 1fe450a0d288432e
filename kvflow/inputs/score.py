"""Text pairs for a cross-encoder (``task="score"``): which pairs ``text_1`` / ``text_2`` make
(vLLM's forms: 1-to-1, 1-to-N, N-to-N) and how one pair becomes a prompt (the tokenizer's
``(text, text_pair)`` encoding, with BERT's token types turned into
``PoolingParams.second_segment_start``). Shared by ``LLM.score`` and the server's
``/v1/score`` and ``/v1/rerank``."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvflow.inputs.tokenization import POOLING_SIDE, parse_tokenization_kwargs
from kvflow.inputs.truncation import truncation_length
from kvflow.pooling_params import PoolingParams


def score_pairs(text_1: str | Sequence[str], text_2: str | Sequence[str],
                names: tuple[str, str] = ("text_1", "text_2")) -> list[tuple[str, str]]:
    """The (text_1, text_2) pairs to score, in order: one string and one string give one
    pair; one string (or a one-item list) and a list give it paired with each item (1-to-N);
    two lists of the same length pair item by item (N-to-N).

    Args:
        names: what to call the two arguments in errors (the server's field names).

    Raises:
        ValueError: for an argument that is not a string or a list of strings, an empty list,
            an empty string, or lists whose lengths are neither 1-to-N nor N-to-N (naming the
            argument and, for a list, the item).
    """
    first, second = (_as_texts(v, n) for v, n in zip((text_1, text_2), names))
    if len(first) == 1:
        return [(first[0], t) for t in second]
    if len(first) != len(second):
        raise ValueError(f"{names[0]} has {len(first)} texts and {names[1]} {len(second)}: "
                         f"score one {names[0]} against N texts (1-to-N) or two lists of the "
                         "same length (N-to-N)")
    return list(zip(first, second))


def _as_texts(value: Any, name: str) -> list[str]:
    texts = [value] if isinstance(value, str) else value
    if not isinstance(texts, (list, tuple)):
        raise ValueError(f"{name} must be a string or a list of strings, got "  # noqa: TRY004
                         f"{type(value).__name__}")
    if not texts:
        raise ValueError(f"{name} is an empty list: give at least one text")
    for i, text in enumerate(texts):
        where = name if isinstance(value, str) else f"{name}[{i}]"
        if not isinstance(text, str):
            raise ValueError(f"{where} must be a string, got "  # noqa: TRY004
                             f"{type(text).__name__}")
        if not text:
            raise ValueError(f"{where} is an empty string")
    return list(texts)


def cut_text(text: str, tokenizer: Any, max_tokens: int) -> str:
    """``text`` cut to its first ``max_tokens`` tokens (the tokenizer's, special tokens not
    counted) at a character boundary: vLLM 0.32's ``truncate_text_to_tokens`` for /score's
    and /rerank's ``max_tokens_per_query`` / ``max_tokens_per_doc``. With a fast tokenizer
    the text is cut where token ``max_tokens`` begins (its character offsets, the text
    re-tokenized until it fits); otherwise its first ``max_tokens`` ids decoded.

    Raises:
        ValueError: for a ``max_tokens`` below 1.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens={max_tokens} must be >= 1")
    if not getattr(tokenizer, "is_fast", False):
        ids = tokenizer.encode(text, add_special_tokens=False)
        return text if len(ids) <= max_tokens else tokenizer.decode(ids[:max_tokens])
    while text:
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        offsets = enc["offset_mapping"]
        if len(enc["input_ids"]) <= max_tokens:
            break
        end = min(offsets[max_tokens - 1][1], offsets[max_tokens][0])
        text = text[:min(end, len(text) - 1)]  # always shorter: the loop ends
    return text


def pair_prompt(tokenizer: Any, text_1: str, text_2: str,
                truncate_prompt_tokens: int | None = None,
                truncation_side: str | None = None) -> tuple[list[int], PoolingParams]:
    """One pair as the cross-encoder reads it: the token ids of
    ``tokenizer(text_1, text_2)`` (special tokens added: ``[CLS] A [SEP] B [SEP]`` for BERT,
    ``<s> A </s></s> B </s>`` for RoBERTa) and the request's PoolingParams (``task="score"``,
    ``second_segment_start`` where the tokenizer gives token type 1).

    Args:
        tokenizer: an HF tokenizer (callable on a text pair).
        truncate_prompt_tokens: cut the pair to at most this many tokens as vLLM 0.32's
            cross-encoder does (``scoring/io_processor.py``); None: never cut (the engine
            refuses a pair longer than ``max_model_len``).
        truncation_side: vLLM's request field. None: the tokenizer's ``longest_first`` cut
            on the right (``POOLING_SIDE``, whatever the tokenizer's config says; the
            longer text first, each keeping its first tokens, the special tokens kept;
            what sentence-transformers' CrossEncoder does at its ``max_length``), then, if
            the special tokens alone are longer, the first ``truncate_prompt_tokens`` of
            the whole; ``"right"`` / ``"left"``: the whole encoding (special tokens and
            token types too) cut to its first / last ``truncate_prompt_tokens``.

    Raises:
        ValueError: without a tokenizer, for a ``truncate_prompt_tokens`` below 1, a
            ``truncation_side`` other than None, ``"left"`` or ``"right"``, or token types
            that are not one run of 0s then one run of 1s.
    """
    if tokenizer is None or not callable(tokenizer):
        raise ValueError("scoring text pairs needs the model's HF tokenizer")
    if truncation_side not in (None, "left", "right"):
        raise ValueError(f"truncation_side must be 'left' or 'right', got {truncation_side!r}")
    t = truncate_prompt_tokens
    cut: dict[str, Any] = {}
    if t is not None:
        if not isinstance(t, int) or isinstance(t, bool) or t < 1:
            raise ValueError(f"truncate_prompt_tokens={t!r} must be an integer >= 1")
        if truncation_side is None:  # vLLM: truncation=True on a right-side tokenizer
            tokenizer = _on_side(tokenizer, POOLING_SIDE)
            cut = {"truncation": "longest_first", "max_length": t}
    enc = tokenizer(text_1, text_2, add_special_tokens=True, **cut)
    ids, types = list(enc["input_ids"]), list(enc.get("token_type_ids") or [])
    if t is not None and len(ids) > t:  # vLLM then slices ids and token types alike
        kept = slice(len(ids) - t, None) if truncation_side == "left" else slice(0, t)
        ids, types = ids[kept], types[kept]
    start = types.index(1) if 1 in types else None
    if start is not None and types != [0] * start + [1] * (len(types) - start):
        raise ValueError(f"the tokenizer's token types {types} are not one segment of 0s "
                         "then one of 1s")
    return ids, PoolingParams(task="score", second_segment_start=start)


def template_pair_prompt(tokenizer: Any, chat_template: str, text_1: str, text_2: str,
                         truncate_prompt_tokens: int | None = None,
                         truncation_side: str | None = None,
                         template_kwargs: dict[str, Any] | None = None
                         ) -> tuple[list[int], PoolingParams]:
    """One pair as vLLM 0.32's cross-encoder reads it under ``LLM.score(chat_template=...)``
    (``scoring/io_processor.py``, ``get_score_prompt``): the template renders the messages
    ``[{"role": "query", "content": text_1}, {"role": "document", "content": text_2}]``
    (transformers' ``apply_chat_template``, no generation prompt), and the text is tokenized
    as one sequence with the tokenizer's special tokens (no second segment: every token
    type 0).

    Args:
        chat_template: the Jinja template (its text).
        truncate_prompt_tokens / truncation_side: as :func:`pair_prompt` cuts (None: the
            tokenizer's cut on the right, its special tokens kept).
        template_kwargs: further variables of the template (vLLM 0.32's
            ``chat_template_kwargs``, e.g. ``instruction``), checked by
            :func:`score_extra_kwargs`.

    Raises:
        ValueError: for a template that cannot render the pair (naming ``chat_template``),
            or what :func:`pair_prompt` refuses.
    """
    if tokenizer is None or not callable(tokenizer):
        raise ValueError("scoring text pairs needs the model's HF tokenizer")
    if not isinstance(chat_template, str) or not chat_template.strip():
        raise ValueError("chat_template must be a non-empty Jinja template string")
    messages = [{"role": "query", "content": text_1}, {"role": "document", "content": text_2}]
    try:
        text = tokenizer.apply_chat_template(messages, chat_template=chat_template,
                                             tokenize=False, **(template_kwargs or {}))
    except Exception as e:  # noqa: BLE001 - jinja and transformers errors: a bad template
        raise ValueError(f"chat_template cannot render the pair (messages with roles "
                         f"'query' and 'document'): {type(e).__name__}: {e}") from None
    t = truncate_prompt_tokens
    if t is not None and (not isinstance(t, int) or isinstance(t, bool) or t < 1):
        raise ValueError(f"truncate_prompt_tokens={t!r} must be an integer >= 1")
    if t is not None and truncation_side is None:
        ids = list(_on_side(tokenizer, POOLING_SIDE)(text, truncation=True,
                                                     max_length=t)["input_ids"])
    else:
        ids = list(tokenizer(text)["input_ids"])
    if t is not None and len(ids) > t:
        ids = ids[len(ids) - t:] if truncation_side == "left" else ids[:t]
    return ids, PoolingParams(task="score")


_EXTRA_KEYS = ("max_tokens_per_query", "max_tokens_per_doc", "chat_template_kwargs")
# apply_chat_template's own arguments, which a template variable may not replace (vLLM's
# reserved keys, and the ones kvflow passes)
_RESERVED = ("chat_template", "tools", "tokenize", "conversation", "add_generation_prompt")


def score_extra_kwargs(params: PoolingParams | None, max_model_len: int,
                       chat_template: str | None
                       ) -> tuple[tuple[int, int], dict[str, Any] | None]:
    """What ``LLM.score`` reads from vLLM 0.32's ``PoolingParams.extra_kwargs``:
    ((``max_tokens_per_query``, ``max_tokens_per_doc``), 0: no cut;
    ``chat_template_kwargs`` or None).

    Raises:
        ValueError: naming the key, for an unknown key, a limit that is not an integer in
            ``[0, max_model_len)`` (vLLM's rule), ``chat_template_kwargs`` that is not a
            dict, sets one of the template call's own arguments, or comes without
            ``chat_template`` (nothing would render it).
    """
    extra = (params.extra_kwargs if params is not None else None) or {}
    unknown = sorted(set(extra) - set(_EXTRA_KEYS))
    if unknown:
        raise ValueError(f"PoolingParams.extra_kwargs: LLM.score reads {list(_EXTRA_KEYS)}, "
                         f"not {unknown}")
    limits = []
    for name in _EXTRA_KEYS[:2]:
        n = extra.get(name) or 0
        if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n < max_model_len:
            raise ValueError(f"extra_kwargs {name}={n!r} must be an integer in [0, "
                             f"max_model_len={max_model_len}) (0: no cut)")
        limits.append(n)
    kwargs = extra.get("chat_template_kwargs")
    if kwargs is not None:
        if not isinstance(kwargs, dict):
            raise ValueError(f"extra_kwargs chat_template_kwargs={kwargs!r} must be a dict")
        reserved = sorted(set(kwargs) & set(_RESERVED))
        if reserved:
            raise ValueError(f"extra_kwargs chat_template_kwargs sets {reserved}, the "
                             "template call's own arguments")
        if kwargs and chat_template is None:
            raise ValueError("extra_kwargs chat_template_kwargs is read by a score chat "
                             "template: give LLM.score(chat_template=...)")
    return (limits[0], limits[1]), kwargs or None


def cut_pairs(pairs: list[tuple[str, str]], tokenizer: Any, limits: tuple[int, int]
              ) -> list[tuple[str, str]]:
    """``pairs`` with each first text cut to ``limits[0]`` tokens and each second text to
    ``limits[1]`` (:func:`cut_text`; 0: not cut), each distinct (text, limit) cut once."""
    if not any(limits):
        return pairs
    done: dict[tuple[str, int], str] = {}

    def one(text: str, limit: int) -> str:
        if not limit:
            return text
        if (text, limit) not in done:
            done[text, limit] = cut_text(text, tokenizer, limit)
        return done[text, limit]

    return [(one(a, limits[0]), one(b, limits[1])) for a, b in pairs]


def score_cut(tokenization_kwargs: dict[str, Any] | None, max_model_len: int,
              truncate_prompt_tokens: int | None) -> tuple[int | None, str | None]:
    """How ``LLM.score`` cuts each pair: (tokens kept, None: no cut; ``truncation_side``,
    None: the default cut), from its ``truncate_prompt_tokens`` argument (-1:
    ``max_model_len``) or vLLM 0.32's ``tokenization_kwargs`` (``truncate_prompt_tokens``,
    ``truncation`` with ``max_length``, ``truncation_side``).

    Raises:
        ValueError: for a bad value, both a ``truncate_prompt_tokens`` argument and a cut in
            ``tokenization_kwargs``, or a key a pair cannot take (``add_special_tokens``
            False, ``do_lower_case``, ``padding`` / ``pad_prompt_tokens``: kvflow tokenizes
            a pair with its special tokens, as given, unpadded).
    """
    limit = truncation_length(truncate_prompt_tokens, max_model_len)
    options = parse_tokenization_kwargs(tokenization_kwargs, max_model_len,
                                        default_side=POOLING_SIDE)
    if options is None:
        return limit, None
    refused = [name for name, on in (("add_special_tokens=False", not options.add_special_tokens),
                                     ("do_lower_case", options.do_lower_case),
                                     ("padding", options.pad_to is not None)) if on]
    if refused:
        raise ValueError(f"tokenization_kwargs {refused}: LLM.score tokenizes each pair with "
                         "its special tokens, as given and unpadded; it reads "
                         "truncate_prompt_tokens, truncation / max_length and "
                         "truncation_side")
    if limit is not None and options.keep is not None:
        raise ValueError("truncate_prompt_tokens is given twice: as an argument and in "
                         "tokenization_kwargs; give one")
    return (limit if options.keep is None else options.keep,
            options.side if options.side_given else None)


def _on_side(tokenizer: Any, side: str) -> Any:
    """``tokenizer`` truncating on ``side``: itself when it already does, else a shallow
    copy (its vocabulary and backend shared) with that ``truncation_side``, so the
    engine's tokenizer is never changed."""
    if getattr(tokenizer, "truncation_side", side) == side:
        return tokenizer
    view = copy.copy(tokenizer)
    view.truncation_side = side
    return view


def score_value(values: list[float]) -> float | list[float]:
    """A pooled score request's values -> its score: the one value of a one-label model, the
    ``num_labels`` values otherwise (what ``CrossEncoder.predict`` gives per pair)."""
    return values[0] if len(values) == 1 else list(values)


def cosine_similarity(u: Sequence[float], v: Sequence[float]) -> float:
    """``u . v / (|u| |v|)`` of two embeddings (float64 sums; 0.0 when either is all zeros):
    the score of a pair on an embedding model (vLLM's, and sentence-transformers'
    ``util.cos_sim``).

    Raises:
        ValueError: for vectors of different lengths.
    """
    if len(u) != len(v):
        raise ValueError(f"embeddings of {len(u)} and {len(v)} values cannot be compared")
    a, b = np.asarray(u, np.float64), np.asarray(v, np.float64)
    norms = float(np.linalg.norm(a) * np.linalg.norm(b))
    return float(a @ b / norms) if norms > 0 else 0.0


def score_use_activation(params: PoolingParams | None) -> bool | None:
    """The ``use_activation`` of ``LLM.score``'s PoolingParams (None: unset), the one field a
    score request takes from them (vLLM's ``activation``; False: raw head logits).

    Raises:
        ValueError: for params that are not a PoolingParams, of a task other than ``score``
            (or the default ``embed``), or with ``dimensions`` / ``normalize`` / ``softmax`` set (naming the field).
    """
    if params is None:
        return None  # (its extra_kwargs: score_extra_kwargs)
    if not isinstance(params, PoolingParams):
        raise ValueError(  # noqa: TRY004 (bad input is a ValueError throughout kvflow)
            f"pooling_params must be a PoolingParams or None, got {type(params).__name__}")
    if params.task not in ("embed", "score"):
        raise ValueError(f"PoolingParams.task={params.task!r} but LLM.score runs task "
                         "'score'")
    for name in ("dimensions", "normalize"):
        if getattr(params, name) is not None:
            raise ValueError(f"PoolingParams.{name} applies to embeddings, not to scores")
    if params.softmax is not None:
        raise ValueError("PoolingParams.softmax (vLLM 0.10's reward-model field) applies to "
                         "token_classify, not to scores (send activation)")
    return params.use_activation
