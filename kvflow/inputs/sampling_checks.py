"""A request's SamplingParams checked against the engine's model: token ids inside the
vocabulary, logprobs counts, what needs a tokenizer, ``truncate_prompt_tokens`` against the
context, ``extra_args`` against the custom logits processors (``InputProcessor.validate_params``;
SamplingParams itself checks everything that does not depend on the model)."""

from __future__ import annotations

from collections.abc import Sequence

from kvflow.inputs.truncation import SAMPLING_FIELD, truncation_length
from kvflow.logits_process import LogitsProcessor
from kvflow.sampling_params import SamplingParams

__all__ = ["check_extra_args", "check_sampling_params"]


def check_sampling_params(params: SamplingParams, vocab_size: int, max_model_len: int, *,
                          has_tokenizer: bool) -> None:
    """Check ``params`` against a model of ``vocab_size`` tokens and a context of
    ``max_model_len`` tokens, served with or without a tokenizer.

    Raises:
        ValueError: for a ``logit_bias``, ``stop_token_ids``, ``allowed_token_ids`` or
            ``logprob_token_ids`` id
            outside ``[0, vocab_size)``, ``logprobs`` / ``prompt_logprobs`` above
            ``vocab_size``, stop strings or ``bad_words`` without a tokenizer, a
            ``truncate_prompt_tokens`` above ``max_model_len``, or a
            ``thinking_token_budget`` without ``reasoning_token_ids`` (vLLM refuses it
            without a reasoning parser) or with marker ids outside the vocabulary.
    """
    if params.stop and not has_tokenizer:
        raise ValueError("SamplingParams.stop needs a tokenizer to match text "
                         "(skip_tokenizer_init is set); use stop_token_ids")
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(params, name)
        if value is not None and value > vocab_size:
            raise ValueError(f"SamplingParams.{name}={value} exceeds the vocabulary "
                             f"size ({vocab_size})")
    for name, ids in (("logit_bias", params.logit_bias or {}),
                      ("stop_token_ids", params.stop_token_ids),
                      ("allowed_token_ids", params.allowed_token_ids or []),
                      ("logprob_token_ids", params.logprob_token_ids or [])):
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"SamplingParams.{name} has token id {bad[0]} outside the "
                             f"vocabulary [0, {vocab_size})")
    if params.bad_words and not has_tokenizer:
        raise ValueError("SamplingParams.bad_words needs a tokenizer to tokenize the words "
                         "(skip_tokenizer_init is set); use logit_bias or "
                         "allowed_token_ids")
    truncation_length(params.truncate_prompt_tokens, max_model_len, SAMPLING_FIELD)
    _check_thinking_budget(params, vocab_size)


def _check_thinking_budget(params: SamplingParams, vocab_size: int) -> None:
    """A ``thinking_token_budget`` needs the reasoning markers' ids, inside the vocabulary.

    Raises:
        ValueError: naming ``SamplingParams.thinking_token_budget`` or the marker field.
    """
    if params.thinking_token_budget is None:
        return
    ids = params.reasoning_token_ids
    if ids is None:
        raise ValueError("SamplingParams.thinking_token_budget needs the model's reasoning "
                         "markers: build the LLM or AsyncLLM with reasoning_parser=... or "
                         "reasoning_config={'reasoning_start_str': ..., 'reasoning_end_str': "
                         "...} (the server's --reasoning-parser / --reasoning-config), or set "
                         "SamplingParams.reasoning_token_ids; without them there is no think "
                         "block to count or end")
    for name in ("reasoning_start_token_ids", "reasoning_end_token_ids",
                 "natural_reasoning_end_token_ids"):
        bad = [t for t in getattr(ids, name) if t >= vocab_size]
        if bad:
            raise ValueError(f"SamplingParams.reasoning_token_ids.{name} has token id "
                             f"{bad[0]} outside the vocabulary [0, {vocab_size})")


def check_extra_args(params: SamplingParams,
                     logits_processors: Sequence[type[LogitsProcessor]]) -> None:
    """Check ``params`` against the engine's custom logits processor classes, the only
    readers of ``extra_args``.

    Raises:
        ValueError: for ``extra_args`` with no logits processor to read them, or what a
            processor's ``validate_params`` refuses.
    """
    if params.extra_args and not logits_processors:
        raise ValueError("SamplingParams.extra_args is read only by custom logits "
                         "processors, and this engine runs none: start it with "
                         "logits_processors (--logits-processors), or leave extra_args out")
    for processor in logits_processors:
        processor.validate_params(params)
