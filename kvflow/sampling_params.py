"""Per-request sampling parameters, validated on construction (OpenAI / vLLM semantics)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """How to sample one request's output.

    Attributes:
        n: number of independent samples (completions) per prompt.
        temperature: softmax temperature; 0 means greedy (argmax).
        top_p: nucleus sampling mass in (0, 1]; 1 disables.
        top_k: keep the k most likely tokens; 0 or -1 disables.
        min_p: drop tokens whose probability is below min_p * p(max); 0 disables.
        seed: per-request RNG seed; the same seed gives the same tokens whatever else is batched.
        max_tokens: maximum number of generated tokens (>= 1).
        min_tokens: EOS and ``stop_token_ids`` are masked until this many tokens are generated.
        stop: strings that end generation; the output text is cut before the match.
        stop_token_ids: token ids that end generation (kept in ``token_ids``).
        ignore_eos: keep generating past the EOS token.
        logprobs: if set, return this many top logprobs per generated token (plus the sampled).
        include_stop_str_in_output: keep the matched stop string in the text.
        skip_special_tokens: drop special tokens when detokenizing.

    Raises:
        ValueError: on any out-of-range value, naming the field and the allowed range.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        checks = [
            (self.n >= 1, "n", self.n, "must be >= 1"),
            (self.temperature >= 0.0, "temperature", self.temperature, "must be >= 0"),
            (0.0 < self.top_p <= 1.0, "top_p", self.top_p, "must be in (0, 1]"),
            (self.top_k >= 0, "top_k", self.top_k, "must be >= 0 (0 or -1 disables)"),
            (0.0 <= self.min_p <= 1.0, "min_p", self.min_p, "must be in [0, 1]"),
            (self.max_tokens >= 1, "max_tokens", self.max_tokens, "must be >= 1"),
            (self.min_tokens >= 0, "min_tokens", self.min_tokens, "must be >= 0"),
            (self.min_tokens <= self.max_tokens, "min_tokens", self.min_tokens,
             f"must be <= max_tokens ({self.max_tokens})"),
            (self.logprobs is None or self.logprobs >= 0, "logprobs", self.logprobs,
             "must be >= 0"),
            (all(isinstance(s, str) and s for s in self.stop), "stop", self.stop,
             "must be non-empty strings"),
        ]
        for ok, name, value, why in checks:
            if not ok:
                raise ValueError(f"SamplingParams.{name}={value!r} is invalid: it {why}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0
