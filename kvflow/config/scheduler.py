"""The scheduler: token budget, running requests, policy, service-level targets,
preemption and async scheduling."""

from __future__ import annotations

import numbers
from dataclasses import dataclass

from kvflow.config.options import check_choices, human_readable_int, opt
from kvflow.utils.int_limits import INT32_MAX

# the waiting-queue orders that read a request's priority
PRIORITY_POLICIES = ("priority", "fair")


def check_priority(priority: int, policy: str) -> None:
    """The rule for a request's ``priority`` under scheduling ``policy``: only the
    priority and fair policies read it, so a nonzero one under fcfs is refused rather
    than ignored. ``SchedulerConfig.check_priority``, ``LLM.generate``'s per-prompt
    check (``llm_inputs.check_priorities``) and the server's (``serving_checks``) apply it.

    Raises:
        ValueError: for a ``priority`` that is not an integer, one outside
            ``[-INT32_MAX, INT32_MAX]`` (the server's bounds too), or a nonzero one under
            another policy, naming the policies that read it.
    """
    if isinstance(priority, bool) or not isinstance(priority, numbers.Integral):
        raise ValueError(  # noqa: TRY004 (bad input is a ValueError throughout kvflow)
            f"priority={priority!r} is invalid: it must be an integer")
    if not -INT32_MAX <= priority <= INT32_MAX:
        raise ValueError(f"priority={priority} is invalid: it must be in [{-INT32_MAX}, "
                         f"{INT32_MAX}] (a signed 32-bit integer, the server's limit too)")
    if priority and policy not in PRIORITY_POLICIES:
        raise ValueError(f"priority={priority} needs the priority or fair scheduling "
                         f"policy (policy='priority' or 'fair'); this engine runs "
                         f"{policy!r}")


@dataclass
class SchedulerConfig:
    max_num_batched_tokens: int | None = opt(None, "token budget of one engine step "
                                              "(default: the platform's, 2048 CPU / 4096 "
                                              "CUDA); 2k = 2000, 2K = 2048, as vLLM's",
                                              type=human_readable_int)
    max_num_seqs: int = opt(256, "maximum number of running requests")
    long_prefill_token_threshold: int = opt(
        0, "vLLM's: while more than one request is running or waiting, a request computes at "
        "most this many tokens per step (a long prompt's chunks), so that it does not take "
        "a step's whole budget from the other requests' decodes and prefills; 0: no cap "
        "(default); at most max_model_len")
    policy: str = opt("fcfs", "waiting-queue order: fcfs, priority (lower first), or fair "
                       "(deficit round robin of tokens over clients, the OpenAI 'user' field or "
                       "API key; priority classes weighted, none starved)",
                       choices=["fcfs", "priority", "fair"],
                       aliases=["--scheduling-policy"])  # vLLM's flag
    target_ttft_ms: float | None = opt(None, "time-to-first-token target of every request "
                                        "(ms; a request's target_ttft_ms overrides it): "
                                        "admissions skip requests that already missed it "
                                        "while others can still meet theirs (default: none)")
    target_tpot_ms: float | None = opt(None, "time-per-output-token target of every request "
                                        "(ms; a request's target_tpot_ms overrides it): each "
                                        "step's prefill tokens and admissions are sized from a "
                                        "step-time model fitted online so running requests "
                                        "stay under it (default: none, the fixed budget)")
    idle_batch_window_ms: float = opt(
        0.0, "kvflow serve: when requests reach an idle engine (nothing running), hold its "
        "first step up to this many ms after the first of them while more arrive, so that a "
        "burst's first step is filled (stepping at once when the waiting prompts fill "
        "--max-num-batched-tokens or --max-num-seqs); a lone request waits the whole window, "
        "never longer; 0: off (default: a burst's p99 TTFT did not improve, "
        "docs/benchmarks.md, session 36: burst TTFT)")
    admission_control: bool = opt(False, "kvflow serve: refuse at arrival (503 + Retry-After) "
                                   "a request whose predicted time to first token exceeds "
                                   "its TTFT target (requests without one are admitted)")
    enable_chunked_prefill: bool | None = opt(
        None, "accepted for vLLM command lines: kvflow always splits a long prompt over steps "
        "within --max-num-batched-tokens (its one scheduling rule; an encoder-only model, "
        "BERT or RoBERTa, runs prompts whole and refuses the flag); "
        "--no-enable-chunked-prefill is refused, as kvflow cannot turn chunking off")
    stream_interval: int = opt(1, "streamed replies (kvflow serve, AsyncLLM): send a "
                                "request's new tokens once every this many tokens instead "
                                "of every step; the first token and the last chunk are "
                                "sent at once (vLLM's flag of the same name; offline LLM "
                                "outputs are whole, as in vLLM)")
    preemption_mode: str = opt("recompute", "what a preempted request's KV becomes: "
                                "recompute (freed, recomputed on readmission) or swap (copied "
                                "to a host pool of --swap-space and back, when the context is "
                                "long enough for the copies to cost less than recomputing it)",
                                choices=["recompute", "swap"])
    async_scheduling: bool | None = opt(
        None, "schedule and prepare step N+1 on the host while step N runs on the device, and "
        "fold step N's tokens in after launching N+1 (same outputs); one-rank engines only "
        "(default: the platform's: off on CPU, where the forward pass runs on the calling "
        "thread, and off on CUDA until measured)")

    def check_priority(self, priority: int) -> None:
        """A request's ``priority`` orders only the priority and fair policies' queues
        (:func:`check_priority`, the one rule every caller applies).

        Raises:
            ValueError: for a nonzero ``priority`` under another policy (it would be
                ignored), naming the policies that read it.
        """
        check_priority(priority, self.policy)

    def __post_init__(self) -> None:
        check_choices(self)
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens={self.max_num_batched_tokens} must be >= 1")
        if self.stream_interval < 1:
            raise ValueError(f"stream_interval={self.stream_interval} must be >= 1 (1: every "
                             "step's tokens are streamed at once)")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs={self.max_num_seqs} must be >= 1")
        if self.long_prefill_token_threshold < 0:
            raise ValueError(f"long_prefill_token_threshold={self.long_prefill_token_threshold}"
                             " must be >= 0 (0: no cap)")
        if self.enable_chunked_prefill is False:
            raise ValueError("turning chunked prefill off (--no-enable-chunked-prefill, "
                             "enable_chunked_prefill False) is refused: kvflow always splits "
                             "a long prompt over steps (chunked prefill is its one scheduling "
                             "rule) and cannot turn that off; leave the flag out")
        if not 0 <= self.idle_batch_window_ms <= 1000:
            raise ValueError(f"idle_batch_window_ms={self.idle_batch_window_ms} must be "
                             "between 0 and 1000 ms")
        for name in ("target_ttft_ms", "target_tpot_ms"):
            value = getattr(self, name)
            if value is not None and not 0 < value < float("inf"):
                raise ValueError(f"{name}={value} must be a number of milliseconds > 0")
