"""``SamplingParams``' own checks of its fields, which need no model (``inputs/sampling_checks.py``
checks a request's parameters against the model): their types, values and ranges,
``logit_bias`` and ``extra_args``. Each error names the field (``SamplingParams.NAME=VALUE is
invalid: ...``)."""

from __future__ import annotations

import math
import numbers
import reprlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np

from kvflow.sampling.stop_limits import check_stop_limits
from kvflow.utils.int_limits import INT32_MAX, INT64_MAX, INT64_MIN
from kvflow.utils.text_checks import find_lone_surrogate

if TYPE_CHECKING:
    from kvflow.sampling_params import SamplingParams

# (holds, field name, its value, what it must be)
Check = tuple[bool, str, Any, str]
# the upper bound of the count fields (utils/int_limits.py), as the server's request models
# hold them: past it a count overflows a C long / int64 on its way to the engine's tensors
_INT32 = f"must be <= {INT32_MAX} (a signed 32-bit integer, the server's limit too)"


def check_field_types(params: SamplingParams) -> None:
    """Integers must be ints (not bools or floats); numbers must be real numbers; flags
    bools; ``stop`` a string or list, ``stop_token_ids`` a list of ints. Numpy integers and
    numbers are stored as plain ``int`` / ``float`` (they cross to the engine).

    Raises:
        ValueError: naming the first field of the wrong type and what it must be.
    """
    from kvflow.sampling_params import RequestOutputKind  # here: that module imports this

    _check_numbers(params)
    for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens",
                 "spaces_between_special_tokens", "detokenize", "grammar_in_reasoning"):
        if not isinstance(getattr(params, name), bool):
            raise _bad_type(name, getattr(params, name), "True or False")
    if not (params.output_kind is None or isinstance(params.output_kind, RequestOutputKind)):
        raise _bad_type("output_kind", params.output_kind,
                        "a RequestOutputKind (CUMULATIVE, DELTA or FINAL_ONLY) or None")
    _check_lists(params)


def _bad_type(name: str, value: Any, what: str) -> ValueError:
    """The error for field ``name`` holding ``value``, which must be ``what``."""
    return ValueError(f"SamplingParams.{name}={value!r} is invalid: it must be {what}")


def _check_numbers(params: SamplingParams) -> None:
    """The integer fields ints, the real ones numbers (the latency targets or None); each
    stored as a plain ``int`` / ``float``. Raises ValueError (``_bad_type``)."""
    optional = {"seed", "logprobs", "max_tokens", "prompt_logprobs",
                "truncate_prompt_tokens", "stream_interval"}
    for name in ("n", "top_k", "max_tokens", "min_tokens", "seed", "logprobs",
                 "prompt_logprobs", "truncate_prompt_tokens", "stream_interval"):
        value = getattr(params, name)
        if not (_is_int(value) or (value is None and name in optional)):
            raise _bad_type(name, value,
                            "an integer" + (" or None" if name in optional else ""))
        if value is not None:  # a numpy integer as a plain int (it crosses to the engine)
            setattr(params, name, int(value))
    for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty"):
        value = getattr(params, name)
        if not _is_real(value):
            raise _bad_type(name, value, "a number")
        setattr(params, name, float(value))
    for name in ("target_ttft_ms", "target_tpot_ms"):
        value = getattr(params, name)
        if value is not None:
            if not _is_real(value):
                raise _bad_type(name, value, "a number of milliseconds or None")
            setattr(params, name, float(value))


def _check_lists(params: SamplingParams) -> None:
    """``stop`` a string or a list, the token id lists lists of integers, ``bad_words`` a
    list of strings. Raises ValueError (``_bad_type``)."""
    if not (params.stop is None or isinstance(params.stop, (str, list, tuple))):
        raise _bad_type("stop", params.stop, "a string or a list of strings")
    if not isinstance(params.stop_token_ids, (list, tuple, type(None))) or \
            not all(_is_int(t) for t in params.stop_token_ids or []):
        raise _bad_type("stop_token_ids", params.stop_token_ids, "a list of integer token ids")
    for name in ("allowed_token_ids", "logprob_token_ids"):
        ids = getattr(params, name)
        if not isinstance(ids, (list, tuple, type(None))) or \
                not all(_is_int(t) for t in ids or []):
            raise _bad_type(name, ids, "a list of integer token ids or None")
    if not isinstance(params.bad_words, (list, tuple, type(None))) or \
            not all(isinstance(w, str) for w in params.bad_words or []):
        raise _bad_type("bad_words", params.bad_words, "a list of strings or None")


def check_field_values(params: SamplingParams) -> None:
    """Every field's value in its range, once the types are checked and normalized
    (``stop`` a list, ``logit_bias`` a dict of ints or None): ``stop``'s limits
    (:func:`~kvflow.sampling.stop_limits.check_stop_limits`), then the sampling knobs, lengths and
    logprob counts, stop strings, logit adjustments and the per-request options, in that
    order.

    Raises:
        ValueError: naming the first field out of range and what it must be.
    """
    check_stop_limits(params.stop)
    checks = [*_sampling_checks(params), *_length_checks(params), *_stop_checks(params),
              *_logit_checks(params), *_request_checks(params)]
    for ok, name, value, why in checks:
        if not ok:
            raise ValueError(f"SamplingParams.{name}={value!r} is invalid: it {why}")


def _sampling_checks(p: SamplingParams) -> list[Check]:
    """How a token is drawn: n, temperature, seed, top-p, top-k, min-p."""
    return [
        (p.n >= 1, "n", p.n, "must be >= 1"),
        (p.n <= INT32_MAX, "n", p.n, _INT32),
        (math.isfinite(p.temperature) and p.temperature >= 0.0, "temperature",
         p.temperature, "must be a finite number >= 0"),
        (p.seed is None or INT64_MIN <= p.seed <= INT64_MAX, "seed", p.seed,
         f"must fit in a signed 64-bit integer [{INT64_MIN}, {INT64_MAX}]"),
        (0.0 < p.top_p <= 1.0, "top_p", p.top_p, "must be in (0, 1]"),
        (p.top_k >= 0, "top_k", p.top_k, "must be >= 0 (0 or -1 disables)"),
        (p.top_k <= INT32_MAX, "top_k", p.top_k, _INT32),
        (0.0 <= p.min_p <= 1.0, "min_p", p.min_p, "must be in [0, 1]"),
    ]


def _length_checks(p: SamplingParams) -> list[Check]:
    """Counts of tokens: max_tokens, min_tokens, logprobs, prompt_logprobs."""
    max_tokens = p.max_tokens if p.max_tokens is not None else math.inf
    return [
        (max_tokens >= 1, "max_tokens", p.max_tokens, "must be >= 1"),
        (p.max_tokens is None or p.max_tokens <= INT32_MAX, "max_tokens", p.max_tokens,
         _INT32),
        (p.min_tokens >= 0, "min_tokens", p.min_tokens, "must be >= 0"),
        (p.min_tokens <= INT32_MAX, "min_tokens", p.min_tokens, _INT32),
        (p.min_tokens <= max_tokens, "min_tokens", p.min_tokens,
         f"must be <= max_tokens ({p.max_tokens})"),
        (p.logprobs is None or p.logprobs >= -1, "logprobs", p.logprobs,
         "must be >= 0, or -1 (the whole vocabulary)"),
        (p.logprobs is None or p.logprobs <= INT32_MAX, "logprobs", p.logprobs, _INT32),
        (p.prompt_logprobs is None or p.prompt_logprobs >= -1, "prompt_logprobs",
         p.prompt_logprobs, "must be >= 0, or -1 (the whole vocabulary)"),
        (p.prompt_logprobs is None or p.prompt_logprobs <= INT32_MAX, "prompt_logprobs",
         p.prompt_logprobs, _INT32),
    ]


def _stop_checks(p: SamplingParams) -> list[Check]:
    """Stop strings: non-empty, valid Unicode, and text to match them on (detokenize)."""
    return [
        (all(isinstance(s, str) and s for s in p.stop), "stop", p.stop,
         "must be non-empty strings"),
        (p.detokenize or not p.stop, "detokenize", p.detokenize,
         "must be True with stop strings (they are matched on the text; vLLM's rule)"),
        (find_lone_surrogate(p.stop) is None, "stop", p.stop,
         "must be valid Unicode (no lone UTF-16 surrogates)"),
    ]


def _logit_checks(p: SamplingParams) -> list[Check]:
    """What is added to or scales the logits: the three penalties and logit_bias."""
    # a bias out of range is named alone: logit_bias may hold 100,000s of entries
    out_of_range = next(({t: b} for t, b in (p.logit_bias or {}).items()
                         if not -100.0 <= b <= 100.0), None)
    return [
        (-2.0 <= p.presence_penalty <= 2.0, "presence_penalty", p.presence_penalty,
         "must be in [-2, 2]"),
        (-2.0 <= p.frequency_penalty <= 2.0, "frequency_penalty", p.frequency_penalty,
         "must be in [-2, 2]"),
        (0.0 < p.repetition_penalty < math.inf, "repetition_penalty",
         p.repetition_penalty, "must be a finite number > 0"),
        (out_of_range is None, "logit_bias", out_of_range,
         "must map token ids to biases in [-100, 100]"),
    ]


def _request_checks(p: SamplingParams) -> list[Check]:
    """The per-request options: latency targets, token id and word lists, prompt
    truncation and the stream interval."""
    return [
        (p.target_ttft_ms is None or 0 < p.target_ttft_ms < math.inf,
         "target_ttft_ms", p.target_ttft_ms, "must be a number of milliseconds > 0"),
        (p.target_tpot_ms is None or 0 < p.target_tpot_ms < math.inf,
         "target_tpot_ms", p.target_tpot_ms, "must be a number of milliseconds > 0"),
        (p.allowed_token_ids is None or len(p.allowed_token_ids) > 0,
         "allowed_token_ids", p.allowed_token_ids,
         "must name at least one token id (None allows every token)"),
        (p.logprob_token_ids is None or len(p.logprob_token_ids) > 0,
         "logprob_token_ids", p.logprob_token_ids, "must name at least one token id"),
        (p.logprob_token_ids is None or p.logprobs is not None, "logprob_token_ids",
         p.logprob_token_ids,
         "needs logprobs set (the listed tokens' logprobs replace its top ones)"),
        (all(w.strip() for w in p.bad_words or []), "bad_words", p.bad_words,
         "must be words, not empty or whitespace-only strings"),
        (p.truncate_prompt_tokens is None or p.truncate_prompt_tokens >= 1
         or p.truncate_prompt_tokens == -1, "truncate_prompt_tokens",
         p.truncate_prompt_tokens, "must be an integer >= 1, or -1 (max_model_len)"),
        (p.truncate_prompt_tokens is None or p.truncate_prompt_tokens <= INT64_MAX,
         "truncate_prompt_tokens", p.truncate_prompt_tokens,
         f"must be <= {INT64_MAX} (a signed 64-bit integer, the server's limit too)"),
        (p.stream_interval is None or p.stream_interval >= 1, "stream_interval",
         p.stream_interval, "must be an integer >= 1 (tokens per streamed output)"),
        (p.stream_interval is None or p.stream_interval <= INT32_MAX, "stream_interval",
         p.stream_interval, _INT32),
    ]


def check_extra_args_encodable(args: Any) -> None:
    """``extra_args`` is None or a dict of string keys that msgpack can encode.

    Raises:
        ValueError: naming ``SamplingParams.extra_args`` and what is wrong.
    """
    if args is None:
        return
    if not isinstance(args, dict) or not all(isinstance(k, str) for k in args):
        raise ValueError(f"SamplingParams.extra_args={reprlib.repr(args)} is invalid: it "
                         "must be a dict with string keys (or None)")
    try:
        msgspec.msgpack.encode(args)
    except (TypeError, msgspec.EncodeError) as e:
        raise ValueError(f"SamplingParams.extra_args={reprlib.repr(args)} is invalid: "
                         f"its values must be None, bools, numbers, strings, bytes, or "
                         f"lists and dicts of them, to reach the engine's processes "
                         f"({e})") from None


def _is_int(value) -> bool:
    """An integer (numpy's included, as vLLM takes them), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def _is_real(value) -> bool:
    """A real number (numpy's included), not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))


def normalize_logit_bias(bias: dict | None) -> dict[int, float] | None:
    """``{"50256": -100}`` -> ``{50256: -100.0}``; None or empty -> None.

    Raises:
        ValueError: for a value that is not a mapping (or None), a key that is not an
            integer token id, two keys naming one token id (``"7"`` and ``"07"``), or a
            non-numeric bias, showing those entries only.
    """
    if bias is not None and not isinstance(bias, Mapping):
        raise ValueError(f"SamplingParams.logit_bias={reprlib.repr(bias)} is invalid: it must "
                         "be a dict of token id -> bias, or None")
    if not bias:
        return None
    out, keys = {}, {}  # errors show the entries at fault, not the bias (100,000s of them)
    for key, value in bias.items():
        try:
            if not (_is_int(key) or isinstance(key, str)) or isinstance(value, bool):
                raise TypeError
            token_id, bias_value = int(key), float(value)
        except (TypeError, ValueError):
            raise ValueError(f"SamplingParams.logit_bias={ {key: value}!r} is invalid: keys "
                             "must be integer token ids and values numbers") from None
        if token_id in out:
            first = keys[token_id]
            raise ValueError(f"SamplingParams.logit_bias={ {first: bias[first], key: value}!r} "
                             f"is invalid: it names token id {token_id} more than once")
        out[token_id], keys[token_id] = bias_value, key
    return out
