"""Per-request sampling parameters, validated on construction (OpenAI / vLLM semantics)."""

from __future__ import annotations

import dataclasses
import enum
import math
import numbers
import reprlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np

from kvflow.beam_search_params import BeamSearchParams  # noqa: F401 (vLLM's path of it)
from kvflow.close_names import guess_unknown_keywords
from kvflow.repetition_detection import RepetitionDetectionParams
from kvflow.stop_limits import (  # noqa: F401 (re-exports: defined here before)
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    LimitError,
    check_stop_limits,
)
from kvflow.structured.params import StructuredOutputsParams
from kvflow.text_checks import find_lone_surrogate
from kvflow.thinking_budget import ReasoningTokenIds, check_thinking_token_budget

if TYPE_CHECKING:
    from typing_extensions import Self


class RequestOutputKind(enum.Enum):
    """What an ``AsyncLLM`` request's stream yields (vLLM's ``RequestOutputKind``):
    ``CUMULATIVE`` each output holds every sample's whole output so far, ``DELTA`` only what
    changed since the previous one, ``FINAL_ONLY`` one output, the finished one."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@guess_unknown_keywords
@dataclass
class SamplingParams:
    """How to sample one request's output.

    Attributes:
        n: number of independent samples (completions) per prompt.
        temperature: softmax temperature; 0 means greedy (argmax).
        top_p: nucleus sampling mass in (0, 1]; 1 disables.
        top_k: keep the k most likely tokens (and any tied with the k-th, as transformers and
            vLLM keep them); 0 or -1 disables.
        min_p: drop tokens whose probability is below min_p * p(max); 0 disables.
        seed: per-request RNG seed (a signed 64-bit integer); the same seed gives the same
            tokens whatever else is batched. -1 given to the constructor is None
            (unseeded), as in vLLM, whose ``SamplingParams`` turns it into None (sample
            ``i`` of a request seeded ``s`` is seeded ``s + i``, which may be -1: the engine
            sets that after constructing, so it stays a seed). Output token ``p`` is drawn
            with numbers that are a function of the seed (all 64 bits) and ``p`` only
            (``layers/seeded_noise.py``), so speculative decoding and preemption do not
            change a seeded request's tokens either.
        max_tokens: maximum number of generated tokens (>= 1); None: as many as the context
            leaves (``max_model_len`` minus the prompt), as in vLLM.
        min_tokens: no stop condition ends the request before this many tokens are generated:
            EOS and ``stop_token_ids`` are masked until then, and a stop string counts only
            when it completes in a later token.
        stop: strings that end generation; the output text is cut before the match. At most
            ``MAX_STOP_STRINGS`` (128) non-empty strings of at most ``MAX_STOP_CHARS`` (256)
            characters each.
        stop_token_ids: token ids that end generation (kept in ``token_ids``).
        ignore_eos: keep generating past the EOS token.
        logprobs: if set, return this many top logprobs per generated token (plus the sampled);
            -1: every token of the vocabulary (vLLM's), resolved when the request is queued.
        logprob_token_ids: vLLM 0.32's: the logprobs of these token ids (a non-empty list)
            at every generated position, in place of the top ``logprobs`` (which must be set,
            its value is then not read); each position's dict holds the sampled token, then
            these in order (a listed token's ``Logprob.rank`` is its place in the list, as
            vLLM's). Ids outside the vocabulary are refused when the request is queued.
        prompt_logprobs: if set, return this many top logprobs per prompt token (plus the
            prompt token's own) in ``RequestOutput.prompt_logprobs``; the first prompt token has
            none (None); -1: the whole vocabulary, as for ``logprobs``. Such a request takes no
            prefix-cache hits for its prompt.
        include_stop_str_in_output: keep the matched stop string in the text.
        skip_special_tokens: drop special tokens when detokenizing.
        spaces_between_special_tokens: False: an added token (special or not) right after
            another one is written as its content alone, with nothing a decoder would put
            between them (WordPiece's space); read only with ``skip_special_tokens=False``
            (vLLM's fast detokenizer's rule: byte-level and SentencePiece decoders put nothing
            there, so their text is the same either way).
        output_kind: what an ``AsyncLLM`` stream yields (:class:`RequestOutputKind`); None:
            ``CUMULATIVE`` from ``AsyncLLM.generate`` (vLLM's default), ``DELTA`` from the
            lower-level ``AsyncLLM.add_request`` (the server's call). The offline ``LLM``
            returns finished outputs whatever it says (vLLM's ``LLM`` sets ``FINAL_ONLY``), and
            the server streams its own way.
        detokenize: False: no text (vLLM's): ``CompletionOutput.text`` stays "" and the
            ``decoded_token`` of every logprob (and prompt logprob) is None; only the token
            ids come back, which saves detokenizing them. Stop strings need text: refused
            with False.
        presence_penalty: subtracted once from the logit of every token already generated;
            in [-2, 2] (OpenAI semantics).
        frequency_penalty: subtracted from a token's logit once per time it was generated;
            in [-2, 2] (OpenAI semantics).
        repetition_penalty: finite and > 0; logits of tokens seen in the prompt or the output
            are divided by it when positive and multiplied by it when negative (CTRL, Keskar
            et al. 2019); 1 disables.
        logit_bias: token id -> bias in [-100, 100] added to that token's logit every step
            (string keys such as JSON's are converted to int).
        structured_outputs: constrain the output to a JSON schema, JSON object, regex, choice,
            grammar or structural tag (see ``kvflow.structured``); a dict of its fields is
            accepted.
        target_ttft_ms: this request's time-to-first-token target in milliseconds (overrides
            the engine's ``target_ttft_ms``); None: the engine's.
        target_tpot_ms: this request's time-per-output-token target in milliseconds
            (overrides the engine's ``target_tpot_ms``): the scheduler sizes each step so the
            request's mean time per token after the first stays under it; None: the engine's.
        allowed_token_ids: only these token ids can be sampled (every other logit is -inf
            before sampling, logprobs included, as vLLM's); None: all. A non-empty list; ids
            outside the vocabulary are refused when the request is queued.
        bad_words: words never generated (vLLM's semantics): each word is tokenized as given
            (leading spaces stripped) and with one leading space; a one-token word's token is
            banned at every step, a longer word's last token only where the generated tokens
            so far end with the word's other tokens (the prompt is not searched). Tokenized
            when the request is queued (:attr:`bad_words_token_ids`).
        truncate_prompt_tokens: keep only the prompt's last ``k`` tokens (``k >= 1``; -1:
            ``max_model_len - 1``, leaving a position for the first generated token, as
            vLLM 0.32's generation requests keep); None: never cut (a prompt the context cannot take is
            refused). A ``k`` above ``max_model_len`` is refused when the request is queued.
        bad_words_token_ids: the token ids of ``bad_words``' variants, filled in by the
            engine's ``InputProcessor`` when the request is queued (a value given here is
            replaced then); None before.
        extra_args: arguments for custom logits processors (``kvflow.logits_process``;
            vLLM's field): a dict with string keys whose values msgpack can encode (None,
            bools, numbers, strings, bytes, lists and dicts of them), since it travels to
            the engine's processes; kvflow itself reads none of it. The server fills it from
            a request's ``vllm_xargs``. None: no arguments.
        thinking_token_budget: vLLM 0.32's: once this many tokens follow the opening
            reasoning marker (inside a think block), the end marker is forced, then the reply
            goes on (``kvflow.thinking_budget``); 0 ends thinking at once. None or -1
            (given as -1, stored as None): unlimited. Needs :attr:`reasoning_token_ids`.
        reasoning_token_ids: the reasoning markers' token ids the budget is counted and ended
            with (:class:`kvflow.thinking_budget.ReasoningTokenIds`, vLLM's
            ``ReasoningConfig`` names; a dict of its fields is accepted). The server fills it
            from its ``--reasoning-parser``; offline, pass it with the budget.
        stream_interval: vLLM 0.32's per-request ``stream_interval``: an ``AsyncLLM``
            stream of deltas (``output_kind`` ``DELTA``, the server's streamed replies) sends
            this many new tokens per output, its first and last output at once
            (``engine/stream_interval.py``); an interval below the engine's
            ``stream_interval`` is raised to it. An integer >= 1; None: the engine's. It
            changes nothing in a cumulative or final-only output.
        repetition_detection: vLLM 0.32's: finish the request with reason ``repetition``
            (stop reason ``"repetition_detected"``) once its generated tokens end with an
            n-gram repeated ``min_count`` times in a row
            (:class:`~kvflow.repetition_detection.RepetitionDetectionParams`; a dict of its
            fields is accepted); None or ``max_pattern_size`` 0: off.

    The constructor records which fields it was given (:attr:`fields_set`, like pydantic's
    ``model_fields_set``), so a model's sampling defaults (:meth:`with_defaults`) fill only
    the others: ``SamplingParams(temperature=1.0)`` keeps 1.0 even where the model's
    ``generation_config.json`` says 0.7.

    Raises:
        ValueError: on a value of the wrong type or out of range, naming the field and what it
            must be.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    logprob_token_ids: list[int] | None = None
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    target_ttft_ms: float | None = None
    target_tpot_ms: float | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None
    bad_words_token_ids: list[list[int]] | None = field(default=None, repr=False)
    extra_args: dict[str, Any] | None = None
    detokenize: bool = True
    output_kind: RequestOutputKind | None = None
    thinking_token_budget: int | None = None
    reasoning_token_ids: ReasoningTokenIds | None = field(default=None, repr=False)
    stream_interval: int | None = None
    repetition_detection: RepetitionDetectionParams | None = None

    def __new__(cls, *args: Any, **kwargs: Any) -> Self:
        self = super().__new__(cls)
        given = [f.name for f in dataclasses.fields(cls)][:len(args)]
        self._fields_set = frozenset(given) | frozenset(kwargs)
        return self

    @property
    def fields_set(self) -> frozenset[str]:
        """Names of the fields passed to the constructor (the rest hold their defaults)."""
        return getattr(self, "_fields_set", frozenset())

    def with_defaults(self, defaults: Mapping[str, Any]) -> Self:
        """These parameters with each field of ``defaults`` that the constructor was not given
        replaced (a model's sampling defaults, e.g. ``{"temperature": 0.7, "top_p": 0.8}``);
        ``self`` when nothing changes. The copy keeps ``self``'s :attr:`fields_set`.

        Raises:
            ValueError: if a default is invalid for its field.
        """
        unset = {k: v for k, v in defaults.items() if k not in self.fields_set}
        if not unset:
            return self
        merged = dataclasses.replace(self, **unset)
        merged._fields_set = self.fields_set
        return merged

    def __post_init__(self) -> None:
        self._check_types()
        if self.seed == -1 and "seed" in self.fields_set:  # vLLM's "no seed"; a decoded
            self.seed = None  # copy (msgspec: no fields_set) keeps a sample's seed + i of -1
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = [int(t) for t in self.stop_token_ids or []]
        if self.top_k == -1:
            self.top_k = 0
        self.logit_bias = _normalize_logit_bias(self.logit_bias)
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = [int(t) for t in self.allowed_token_ids]
        if self.logprob_token_ids is not None:
            self.logprob_token_ids = [int(t) for t in self.logprob_token_ids]
        self.bad_words = list(self.bad_words) if self.bad_words else None
        self.structured_outputs = StructuredOutputsParams.from_value(self.structured_outputs)
        self.thinking_token_budget = check_thinking_token_budget(self.thinking_token_budget)
        self.reasoning_token_ids = ReasoningTokenIds.from_value(self.reasoning_token_ids)
        self.repetition_detection = RepetitionDetectionParams.from_value(
            self.repetition_detection)
        self._check_extra_args()
        self._validate()

    def _check_extra_args(self) -> None:
        """``extra_args`` is None or a dict of string keys that msgpack can encode.

        Raises:
            ValueError: naming ``SamplingParams.extra_args`` and what is wrong.
        """
        args = self.extra_args
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

    def _check_types(self) -> None:
        """Integers must be ints (not bools or floats); numbers must be real numbers; flags
        bools; ``stop`` a string or list, ``stop_token_ids`` a list of ints."""
        def bad(name: str, value, what: str) -> ValueError:
            return ValueError(f"SamplingParams.{name}={value!r} is invalid: it must be {what}")

        optional = {"seed", "logprobs", "max_tokens", "prompt_logprobs",
                    "truncate_prompt_tokens", "stream_interval"}
        for name in ("n", "top_k", "max_tokens", "min_tokens", "seed", "logprobs",
                     "prompt_logprobs", "truncate_prompt_tokens", "stream_interval"):
            value = getattr(self, name)
            if not (_is_int(value) or (value is None and name in optional)):
                raise bad(name, value, "an integer" + (" or None" if name in optional else ""))
            if value is not None:  # a numpy integer as a plain int (it crosses to the engine)
                setattr(self, name, int(value))
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            value = getattr(self, name)
            if not _is_real(value):
                raise bad(name, value, "a number")
            setattr(self, name, float(value))
        for name in ("target_ttft_ms", "target_tpot_ms"):
            value = getattr(self, name)
            if value is not None:
                if not _is_real(value):
                    raise bad(name, value, "a number of milliseconds or None")
                setattr(self, name, float(value))
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens",
                     "spaces_between_special_tokens", "detokenize"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, getattr(self, name), "True or False")
        if not (self.output_kind is None or isinstance(self.output_kind, RequestOutputKind)):
            raise bad("output_kind", self.output_kind,
                      "a RequestOutputKind (CUMULATIVE, DELTA or FINAL_ONLY) or None")
        if not (self.stop is None or isinstance(self.stop, (str, list, tuple))):
            raise bad("stop", self.stop, "a string or a list of strings")
        if not isinstance(self.stop_token_ids, (list, tuple, type(None))) or \
                not all(_is_int(t) for t in self.stop_token_ids or []):
            raise bad("stop_token_ids", self.stop_token_ids, "a list of integer token ids")
        for name in ("allowed_token_ids", "logprob_token_ids"):
            ids = getattr(self, name)
            if not isinstance(ids, (list, tuple, type(None))) or \
                    not all(_is_int(t) for t in ids or []):
                raise bad(name, ids, "a list of integer token ids or None")
        if not isinstance(self.bad_words, (list, tuple, type(None))) or \
                not all(isinstance(w, str) for w in self.bad_words or []):
            raise bad("bad_words", self.bad_words, "a list of strings or None")

    def _validate(self) -> None:
        check_stop_limits(self.stop)
        max_tokens = self.max_tokens if self.max_tokens is not None else math.inf
        # a bias out of range is named alone: logit_bias may hold 100,000s of entries
        out_of_range = next(({t: b} for t, b in (self.logit_bias or {}).items()
                             if not -100.0 <= b <= 100.0), None)
        checks = [
            (self.n >= 1, "n", self.n, "must be >= 1"),
            (math.isfinite(self.temperature) and self.temperature >= 0.0, "temperature",
             self.temperature, "must be a finite number >= 0"),
            (self.seed is None or -2**63 <= self.seed < 2**63, "seed", self.seed,
             "must fit in a signed 64-bit integer"),
            (0.0 < self.top_p <= 1.0, "top_p", self.top_p, "must be in (0, 1]"),
            (self.top_k >= 0, "top_k", self.top_k, "must be >= 0 (0 or -1 disables)"),
            (0.0 <= self.min_p <= 1.0, "min_p", self.min_p, "must be in [0, 1]"),
            (max_tokens >= 1, "max_tokens", self.max_tokens, "must be >= 1"),
            (self.min_tokens >= 0, "min_tokens", self.min_tokens, "must be >= 0"),
            (self.min_tokens <= max_tokens, "min_tokens", self.min_tokens,
             f"must be <= max_tokens ({self.max_tokens})"),
            (self.logprobs is None or self.logprobs >= -1, "logprobs", self.logprobs,
             "must be >= 0, or -1 (the whole vocabulary)"),
            (self.prompt_logprobs is None or self.prompt_logprobs >= -1, "prompt_logprobs",
             self.prompt_logprobs, "must be >= 0, or -1 (the whole vocabulary)"),
            (all(isinstance(s, str) and s for s in self.stop), "stop", self.stop,
             "must be non-empty strings"),
            (self.detokenize or not self.stop, "detokenize", self.detokenize,
             "must be True with stop strings (they are matched on the text; vLLM's rule)"),
            (find_lone_surrogate(self.stop) is None, "stop", self.stop,
             "must be valid Unicode (no lone UTF-16 surrogates)"),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", self.presence_penalty,
             "must be in [-2, 2]"),
            (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", self.frequency_penalty,
             "must be in [-2, 2]"),
            (0.0 < self.repetition_penalty < math.inf, "repetition_penalty",
             self.repetition_penalty, "must be a finite number > 0"),
            (out_of_range is None, "logit_bias", out_of_range,
             "must map token ids to biases in [-100, 100]"),
            (self.target_ttft_ms is None or 0 < self.target_ttft_ms < math.inf,
             "target_ttft_ms", self.target_ttft_ms, "must be a number of milliseconds > 0"),
            (self.target_tpot_ms is None or 0 < self.target_tpot_ms < math.inf,
             "target_tpot_ms", self.target_tpot_ms, "must be a number of milliseconds > 0"),
            (self.allowed_token_ids is None or len(self.allowed_token_ids) > 0,
             "allowed_token_ids", self.allowed_token_ids,
             "must name at least one token id (None allows every token)"),
            (self.logprob_token_ids is None or len(self.logprob_token_ids) > 0,
             "logprob_token_ids", self.logprob_token_ids, "must name at least one token id"),
            (self.logprob_token_ids is None or self.logprobs is not None, "logprob_token_ids",
             self.logprob_token_ids,
             "needs logprobs set (the listed tokens' logprobs replace its top ones)"),
            (all(w.strip() for w in self.bad_words or []), "bad_words", self.bad_words,
             "must be words, not empty or whitespace-only strings"),
            (self.truncate_prompt_tokens is None or self.truncate_prompt_tokens >= 1
             or self.truncate_prompt_tokens == -1, "truncate_prompt_tokens",
             self.truncate_prompt_tokens, "must be an integer >= 1, or -1 (max_model_len)"),
            (self.stream_interval is None or self.stream_interval >= 1, "stream_interval",
             self.stream_interval, "must be an integer >= 1 (tokens per streamed output)"),
        ]
        for ok, name, value, why in checks:
            if not ok:
                raise ValueError(f"SamplingParams.{name}={value!r} is invalid: it {why}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_penalties(self) -> bool:
        """True if any of presence, frequency or repetition penalty is active."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)


def _is_int(value) -> bool:
    """An integer (numpy's included, as vLLM takes them), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def _is_real(value) -> bool:
    """A real number (numpy's included), not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))


def _normalize_logit_bias(bias: dict | None) -> dict[int, float] | None:
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
