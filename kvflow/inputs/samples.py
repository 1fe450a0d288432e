"""A request's per-sample SamplingParams (the ``n`` fan-out of ``InputProcessor``): sample
``i``'s seed, the model's further EOS ids as stop ids, ``bad_words`` tokenized (after checking
that ``allowed_token_ids`` leave a token), and -1 logprobs (vLLM's "every token") as the
vocabulary size.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from kvflow.sampling.token_masks import bad_words_token_ids, check_masks_leave_a_token
from kvflow.sampling_params import SamplingParams


def sample_params(params: SamplingParams, i: int, bad_words_ids: list[list[int]] | None,
                  extra_eos_ids: list[int], vocab_size: int) -> SamplingParams:
    """Sample ``i``'s copy of ``params``: ``n=1``, the model's further EOS ids added to the
    stop ids (:func:`stop_token_ids`), the tokenized ``bad_words_ids``, -1 logprobs as
    ``vocab_size``, and seed + i (wrapped into the signed 64-bit range: the same generator
    seed modulo 2**64) when seeded."""
    seed = None if params.seed is None else (params.seed + i + 2**63) % 2**64 - 2**63
    child = dataclasses.replace(params, n=1,
                                stop_token_ids=stop_token_ids(params, extra_eos_ids),
                                bad_words_token_ids=bad_words_ids,
                                **_whole_vocab_logprobs(params, vocab_size))
    child.seed = seed  # set after the copy: its checks would read a seed + i of -1
    # as "unseeded" (SamplingParams.seed)
    return child


def _whole_vocab_logprobs(params: SamplingParams, vocab_size: int) -> dict[str, int]:
    """``logprobs`` / ``prompt_logprobs`` of -1 (vLLM's "every token") as ``vocab_size``,
    by field name (the fields that are -1 only)."""
    return {name: vocab_size for name in ("logprobs", "prompt_logprobs")
            if getattr(params, name) == -1}


def bad_words_ids_checked(tokenizer: Any, params: SamplingParams, vocab_size: int,
                          eos_token_id: int | None, extra_eos_ids: list[int]
                          ) -> list[list[int]] | None:
    """``params.bad_words`` tokenized by ``tokenizer`` (vLLM's variants; None without bad
    words), after checking that ``allowed_token_ids`` keep a token the bad words,
    ``min_tokens`` and the stop tokens (``eos_token_id`` unless ``ignore_eos``, the
    request's and the model's further EOS ids) leave sampleable
    (``check_masks_leave_a_token``).

    Raises:
        ValueError: for bad words without a tokenizer, or masks that leave no token.
    """
    bad_words_ids = bad_words_token_ids(tokenizer, params.bad_words, vocab_size) \
        if params.bad_words else None
    if params.allowed_token_ids:
        stop_ids = stop_token_ids(params, extra_eos_ids)
        if eos_token_id is not None and not params.ignore_eos:
            stop_ids.append(eos_token_id)
        check_masks_leave_a_token(params, bad_words_ids or [], stop_ids)
    return bad_words_ids


def stop_token_ids(params: SamplingParams, extra_eos_ids: list[int]) -> list[int]:
    """The request's ``stop_token_ids`` plus the model's further EOS ids (none with
    ``ignore_eos``), each once (a new list)."""
    ids = list(params.stop_token_ids)
    if not params.ignore_eos:
        ids += [t for t in extra_eos_ids if t not in ids]
    return ids
