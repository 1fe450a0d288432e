"""The request side of ``allowed_token_ids`` and ``bad_words`` (vLLM's SamplingParams
fields): the token-id sequences the bad words ban, and the refusal of masks that leave no
token to sample. The sampler applies them each step (``layers/sampler.py``)."""

from __future__ import annotations

from typing import Any

from kvflow.sampling_params import SamplingParams


def check_masks_leave_a_token(params: SamplingParams, bad_words_ids: list[list[int]],
                              stop_ids: list[int]) -> None:
    """Refuse ``allowed_token_ids`` that the request's other bans leave empty: every allowed
    id a one-token bad word (banned at every step), or, with ``min_tokens`` > 0, every
    allowed id a stop token or such a bad word (nothing could be sampled before
    ``min_tokens`` are out). Such a step's logits would be all -inf, and the sampler's
    "choice" there is id 0, a token the request never allowed.

    Args:
        params: the request's parameters (``allowed_token_ids`` set).
        bad_words_ids: ``bad_words_token_ids`` of its ``bad_words`` ([] for none).
        stop_ids: the ids ``min_tokens`` bans: ``stop_token_ids``, the model's further EOS
            ids and its EOS (the last two unless ``ignore_eos``).

    Raises:
        ValueError: naming ``SamplingParams.bad_words`` or ``SamplingParams.min_tokens``.
    """
    allowed = set(params.allowed_token_ids or ())
    if not allowed:
        return
    one_token_bans = {ids[0] for ids in bad_words_ids if len(ids) == 1}
    if allowed <= one_token_bans:
        raise ValueError(f"SamplingParams.bad_words ban every token allowed_token_ids allows "
                         f"({sorted(allowed)[:8]}{' ...' if len(allowed) > 8 else ''}): no "
                         "token could ever be sampled")
    if params.min_tokens > 0 and allowed <= one_token_bans | set(stop_ids):
        raise ValueError(f"SamplingParams.min_tokens={params.min_tokens} bans the stop tokens "
                         f"(EOS and stop_token_ids), and every token allowed_token_ids allows "
                         f"({sorted(allowed)[:8]}{' ...' if len(allowed) > 8 else ''}) is one "
                         "of them or a bad word: no first token could be sampled")


def bad_words_token_ids(tokenizer: Any, bad_words: list[str], vocab_size: int
                        ) -> list[list[int]]:
    """The token-id sequences ``bad_words`` ban (vLLM's rule): each word, leading spaces
    stripped, is encoded without special tokens as it is and with one leading space; the
    spaced variant is kept only when its first token differs and it has as many tokens
    (a tokenizer that adds a prefix space itself gives the same ids twice: kept once).

    Args:
        tokenizer: an HF tokenizer (``encode(text, add_special_tokens=False)``).
        bad_words: non-empty words.
        vocab_size: the model's vocabulary size (ids must be below it).

    Raises:
        ValueError: naming ``bad_words`` and the word for a word that encodes to no token or
            to an id outside the vocabulary (a tokenizer larger than the model).
    """
    out: list[list[int]] = []
    for word in bad_words:
        plain = list(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        spaced = list(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        for ids in (plain, spaced):
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if not ids or bad:
                why = "encodes to no token" if not ids else \
                    f"encodes to token id {bad[0]} outside the vocabulary [0, {vocab_size})"
                raise ValueError(f"SamplingParams.bad_words: the word {word!r} {why}")
        out.append(plain)
        if spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    return out
