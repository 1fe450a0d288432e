"""Per-request sampling parameters, validated on construction (OpenAI / vLLM semantics)."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvflow.beam_search_params import BeamSearchParams  # noqa: F401 (vLLM's path of it)
from kvflow.sampling.fields import (
    check_extra_args_encodable,
    check_field_types,
    check_field_values,
    normalize_logit_bias,
)
from kvflow.sampling.repetition_detection import RepetitionDetectionParams
from kvflow.sampling.stop_limits import (  # noqa: F401 (re-exports: defined here before)
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    LimitError,
    check_stop_limits,
)
from kvflow.structured.params import StructuredOutputsParams
from kvflow.thinking_budget import ReasoningTokenIds, check_thinking_token_budget
from kvflow.utils.close_names import guess_unknown_keywords

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
            from its ``--reasoning-parser``; offline, pass it with the budget. With
            ``structured_outputs`` too, the grammar starts after the reasoning (vLLM's rule:
            ``kvflow/structured/reasoning_gate.py``); without it, from the first token.
            Offline, ``LLM(reasoning_parser=...)`` (or vLLM's ``reasoning_config``) fills it
            for budgeted and constrained requests.
        grammar_in_reasoning: vLLM's ``structured_outputs_config.enable_in_reasoning`` for
            this request: with ``structured_outputs`` and :attr:`reasoning_token_ids` (the
            budget's markers), the grammar still applies from the first token, reasoning
            included (False: it starts after the reasoning). The server sets it under
            ``--structured-outputs-config '{"enable_in_reasoning": true}'``, the offline
            ``LLM`` under ``structured_outputs_config={"enable_in_reasoning": True}``.
        stream_interval: vLLM 0.32's per-request ``stream_interval``: an ``AsyncLLM``
            stream of deltas (``output_kind`` ``DELTA``, the server's streamed replies) sends
            this many new tokens per output, its first and last output at once
            (``engine/stream_interval.py``); an interval below the engine's
            ``stream_interval`` is raised to it. An integer >= 1; None: the engine's. It
            changes nothing in a cumulative or final-only output.
        repetition_detection: vLLM 0.32's: finish the request with reason ``repetition``
            (stop reason ``"repetition_detected"``) once its generated tokens end with an
            n-gram repeated ``min_count`` times in a row
            (:class:`~kvflow.sampling.repetition_detection.RepetitionDetectionParams`; a dict of its
            fields is accepted); None or ``max_pattern_size`` 0: off.

    The constructor records which fields it was given (:attr:`fields_set`, like pydantic's
    ``model_fields_set``), so a model's sampling defaults (:meth:`with_defaults`) fill only
    the others: ``SamplingParams(temperature=1.0)`` keeps 1.0 even where the model's
    ``generation_config.json`` says 0.7.

    The count fields (``n``, ``top_k``, ``max_tokens``, ``min_tokens``, ``logprobs``,
    ``prompt_logprobs``, ``stream_interval``) are at most 2**31 - 1, and ``seed`` and
    ``truncate_prompt_tokens`` fit a signed 64-bit integer: the OpenAI server's bounds
    (``kvflow/utils/int_limits.py``), past which a value would overflow a C long / int64 on
    its way to the engine's tensors.

    Raises:
        ValueError: on a value of the wrong type or out of range, naming the field and what it
            must be (the bound, for one past it).
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
    grammar_in_reasoning: bool = field(default=False, repr=False)

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
        check_field_types(self)
        if self.seed == -1 and "seed" in self.fields_set:  # vLLM's "no seed"; a decoded
            self.seed = None  # copy (msgspec: no fields_set) keeps a sample's seed + i of -1
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = [int(t) for t in self.stop_token_ids or []]
        if self.top_k == -1:
            self.top_k = 0
        self.logit_bias = normalize_logit_bias(self.logit_bias)
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
        check_extra_args_encodable(self.extra_args)
        check_field_values(self)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_penalties(self) -> bool:
        """True if any of presence, frequency or repetition penalty is active."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)
