"""``truncate_prompt_tokens``: its value read (``truncation_length``, every endpoint and
``LLM`` call that takes it) and a generation prompt cut to its last ``k`` tokens (vLLM's
generate runner's rule: ``SamplingParams.truncate_prompt_tokens``,
``InputProcessor.make_requests``, the /v1/completions and /v1/chat/completions handlers).
Pooling inputs keep their first ``k``: :func:`kvflow.inputs.tokenization.pooling_cut`."""

from __future__ import annotations

SAMPLING_FIELD = "SamplingParams.truncate_prompt_tokens"  # as errors name a SamplingParams' value


def truncation_length(truncate_prompt_tokens: int | None, max_model_len: int,
                      field: str = "truncate_prompt_tokens",
                      generation: bool = False) -> int | None:
    """How many prompt tokens to keep: None for None (never cut), ``max_model_len`` for -1
    (``max_model_len - 1`` for a ``generation`` prompt, which must leave a position for its
    first generated token: vLLM 0.32's ``TokenizeParams.max_truncation_tokens``; keeping
    ``max_model_len`` would only have the prompt refused as too long), else
    ``truncate_prompt_tokens`` itself (vLLM's reading of the field).

    Raises:
        ValueError: naming ``field`` (``SamplingParams.truncate_prompt_tokens`` for a
            SamplingParams' value) for a value that is not an integer (a bool included), 0,
            a value below -1, or one above ``max_model_len``
            (tokens).
    """
    k = truncate_prompt_tokens
    if k is None:
        return None
    if isinstance(k, bool) or not isinstance(k, int):
        raise ValueError(  # noqa: TRY004 (bad input is a ValueError throughout kvflow)
            f"{field}={k!r} is invalid: it must be an integer >= 1, -1 (max_model_len) or "
            "None")
    if k == -1:
        return max_model_len - 1 if generation else max_model_len
    if k < 1:
        raise ValueError(f"{field}={k} is invalid: it must be an integer >= 1, "
                         "or -1 (max_model_len)")
    if k > max_model_len:
        raise ValueError(f"{field}={k} is greater than max_model_len "
                         f"({max_model_len}): send a smaller one, or -1 for max_model_len")
    return k


def keep_last_tokens(token_ids: list[int], limit: int | None) -> list[int]:
    """The last ``limit`` of ``token_ids`` (all of them when there are no more, or ``limit``
    is None); ``token_ids`` itself when nothing is cut."""
    if limit is None or len(token_ids) <= limit:
        return token_ids
    return token_ids[-limit:]
