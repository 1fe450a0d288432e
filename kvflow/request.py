"""The engine-side state of one sequence being generated."""

from __future__ import annotations

import enum
import time

from kvflow.inputs.embeds import PromptEmbeds
from kvflow.inputs.multimodal import MultiModalFeature
from kvflow.lora.request import LoRARequest
from kvflow.pooling_params import PoolingParams
from kvflow.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_REPETITION = "repetition"  # vLLM 0.32's repetition_detection (its reason)

    def __init__(self, value: str) -> None:
        # Plain attributes, not properties: read for every request on every step.
        self.is_finished: bool = value in ("stop", "length", "abort", "repetition")
        self.finish_reason: str | None = value if self.is_finished else None


class RequestTimes:
    """When a request passed each phase (engine core clock, ``Scheduler.clock`` seconds;
    None until it did): queued in the core, first scheduled, first and latest token."""

    __slots__ = ("first_token", "last_token", "queued", "scheduled")

    def __init__(self) -> None:
        self.queued: float | None = None
        self.scheduled: float | None = None
        self.first_token: float | None = None
        self.last_token: float | None = None


class SpecDecodeCounts:
    """A request's speculative-decoding record (counts since it started).

    Attributes:
        num_drafts: verification steps that carried draft tokens.
        num_draft_tokens: draft tokens verified.
        num_accepted_tokens: draft tokens accepted (the bonus token is not counted).
        num_rejections: steps in which a draft token was rejected (the rest of that step's
            drafts are then not examined): accepted / (accepted + rejections) estimates the
            per-token acceptance probability.
        draft_synced_tokens: the request's computed tokens at its last verification step:
            about where a draft model's K/V of it ends (the cost model charges the draft's
            catch-up from there; 0 before it first drafts).
        synced_preemptions: the request's preemptions at that step (a preemption since
            drops the draft's K/V too).
    """

    __slots__ = ("draft_synced_tokens", "num_accepted_tokens", "num_draft_tokens",
                 "num_drafts", "num_rejections", "synced_preemptions")

    def __init__(self) -> None:
        self.num_drafts = self.num_draft_tokens = 0
        self.num_accepted_tokens = self.num_rejections = 0
        self.draft_synced_tokens = self.synced_preemptions = 0

    def record(self, num_draft_tokens: int, num_accepted: int) -> None:
        """Count one verification step: ``num_accepted`` of ``num_draft_tokens`` accepted."""
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        self.num_rejections += num_accepted < num_draft_tokens


class Request:
    """One sequence: its tokens, how many of them have KV computed, and its status.

    The scheduler's only rule reads two numbers: ``num_computed_tokens`` (tokens whose K/V are in
    the cache) and ``num_tokens`` (prompt + generated). A step schedules up to
    ``num_tokens - num_computed_tokens`` of them; when it catches up, the step samples one more
    token. Preemption resets ``num_computed_tokens`` to 0 and keeps every generated token.
    Speculative decoding adds draft tokens to a step (never to ``all_token_ids``): the step
    computes past ``num_tokens`` and the rejected drafts' count is taken back afterwards.

    Args:
        request_id: unique id (a sample of an ``n > 1`` request gets its own id).
        prompt_token_ids: prompt tokens.
        sampling_params: its sampling parameters (``n`` is already fanned out, here it is 1).
        eos_token_id: the model's EOS id, or None.
        arrival_time: time.monotonic() at arrival (seconds).
        priority: lower runs first under the priority policy.
        parent_id / sample_index: the user request this sample belongs to, and its index.
        mm_features: the prompt's images (placeholders already expanded), in prompt order;
            None for a text-only prompt.
        client_id: who sent it (the OpenAI ``user`` field, else a digest of the API key; ""
            when unknown): the fair policy shares tokens over clients.
        lora_request: the LoRA adapter it runs with (None: the base model).
        pooling_params: set for an embedding request: its prompt is computed and pooled into
            one vector, nothing is generated.
        cache_salt: a non-empty string mixed into the hash of the prompt's first KV block, so
            that only requests with the same salt share prefix-cache blocks (vLLM's
            ``cache_salt``); None: unsalted, shared with every unsalted request.
        prompt_embeds: the prompt's embedding rows when it was given as embeddings
            (``prompt_token_ids`` then holds one placeholder 0 per row); kept until the
            request finishes, since a preempted request recomputes its prompt from them.
        session_id: the session it belongs to (vLLM 0.32's request field): written into the
            ``BlockStored`` KV cache events of the blocks it stores; None: none.
    """

    # Slots, not an instance dict: the scheduler, runner and output paths read and write these
    # on every step for every request. CPython 3.11 shares one key table among a class's
    # instance dicts only up to 29 attributes (its SHARED_KEYS_MAX_SIZE); the 30th made each
    # request's attributes a private 1.5 KiB dict whose loads and stores miss the interpreter's
    # fast paths: host time per decode step rose 1.15x at 256 requests (docs/benchmarks.md,
    # session 47). Slots keep every attribute at a fixed offset whatever their number.
    __slots__ = (
        "all_token_ids", "arrival_time", "block_hashes", "cache_salt", "client_id",
        "eos_token_id", "kv_steady_until", "lora_request", "max_num_tokens", "min_stop_len", "mm_features",
        "num_cached_tokens", "num_computed_tokens", "num_external_cached_tokens",
        "num_output_placeholders", "num_preemptions", "parent_id", "pooling_params", "priority",
        "prompt_embeds", "prompt_logprobs", "prompt_token_ids", "request_id", "sample_index",
        "sampling_params", "session_id", "spec_counts", "status", "stop_eos_id",
        "stop_reason", "structured_output", "times",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        parent_id: str | None = None,
        sample_index: int = 0,
        mm_features: list[MultiModalFeature] | None = None,
        client_id: str = "",
        lora_request: LoRARequest | None = None,
        pooling_params: PoolingParams | None = None,
        cache_salt: str | None = None,
        prompt_embeds: PromptEmbeds | None = None,
        session_id: str | None = None,
    ) -> None:
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self._set_origin(request_id, parent_id, sample_index, arrival_time, priority, client_id,
                         session_id)
        self._set_inputs(prompt_token_ids, mm_features, prompt_embeds, cache_salt, lora_request,
                         pooling_params)
        self._set_progress()
        self._set_stop_limits()

    def _set_origin(self, request_id: str, parent_id: str | None, sample_index: int,
                    arrival_time: float | None, priority: int, client_id: str,
                    session_id: str | None) -> None:
        """Who sent it and when: its id, the user request it is a sample of, its arrival,
        its priority, its client and session (see the class's Args)."""
        self.request_id = request_id
        self.parent_id = parent_id if parent_id is not None else request_id
        self.sample_index = sample_index
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.priority = priority
        self.client_id = client_id
        self.session_id = session_id

    def _set_inputs(self, prompt_token_ids: list[int],
                    mm_features: list[MultiModalFeature] | None,
                    prompt_embeds: PromptEmbeds | None, cache_salt: str | None,
                    lora_request: LoRARequest | None,
                    pooling_params: PoolingParams | None) -> None:
        """What the model computes: the prompt (a copy; its images, its embedding rows), the
        prefix-cache salt, the adapter, the pooling of an embedding request."""
        self.prompt_token_ids = list(prompt_token_ids)
        self.mm_features = mm_features or None
        self.prompt_embeds = prompt_embeds
        self.cache_salt = cache_salt
        self.lora_request = lora_request
        self.pooling_params = pooling_params

    def _set_progress(self) -> None:
        """The state of a request not scheduled yet: waiting, its tokens the prompt's (their
        own list), nothing computed, cached, in flight or timed."""
        self.status = RequestStatus.WAITING
        self.stop_reason: str | int | None = None
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.num_computed_tokens = 0
        # Tokens sampled by steps still in flight (async scheduling): already computed into
        # the next step's inputs on the device, not yet appended here.
        self.num_output_placeholders = 0
        self.num_cached_tokens = -1  # prefix-cache hits at first schedule; -1 = not yet known
        self.num_external_cached_tokens = 0  # of those, the tokens a KV connector loaded
        self.num_preemptions = 0
        self.times = RequestTimes()  # vLLM's phases, for /metrics
        self.block_hashes: list[int] = []  # hash chain over this request's full blocks
        # Kept by the KV cache manager: while num_computed_tokens plus a step's new tokens
        # stay at or below this, allocating their slots has nothing to do (no new block, no
        # full block to index), so the scheduler skips the call; 0: no such promise.
        self.kv_steady_until = 0
        # kvflow.structured.request_state.RequestStructuredOutput when the output is constrained
        self.structured_output = None
        self.spec_counts = SpecDecodeCounts()  # speculative decoding (zeros without it)

    def _set_stop_limits(self) -> None:
        """Stop rules as token counts, read on every step (the scheduler caps
        ``max_num_tokens`` at max_model_len when the request arrives), and the prompt logprobs
        gathered so far (position p at index p; position 0 has none; None once handed to the
        output, or never asked for)."""
        params, num_prompt = self.sampling_params, len(self.prompt_token_ids)
        self.min_stop_len = num_prompt + params.min_tokens  # stop ids count past it
        self.stop_eos_id = None if params.ignore_eos else self.eos_token_id
        self.max_num_tokens = num_prompt + params.max_tokens \
            if params.max_tokens is not None else float("inf")
        self.prompt_logprobs: list | None = \
            [None] if params.prompt_logprobs is not None else None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[len(self.prompt_token_ids):]

    @property
    def lora_int_id(self) -> int:
        """Its adapter's id, 0 for the base model."""
        return 0 if self.lora_request is None else self.lora_request.lora_int_id

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def is_schedulable(self) -> bool:
        """False while its structured-output grammar is still compiling."""
        return self.structured_output is None or self.structured_output.is_ready

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Asked for prompt logprobs and not all of them are computed yet (its prompt must
        then be computed, not taken from the prefix cache)."""
        return self.prompt_logprobs is not None and \
            len(self.prompt_logprobs) < self.num_prompt_tokens

    @property
    def skips_prefix_cache(self) -> bool:
        """Whether the request must compute its whole prompt instead of taking a cached
        prefix: it wants prompt logprobs not all recorded yet, or it is a per-token pooling
        request (``token_embed`` / ``token_classify``: every prompt token's final hidden
        state is reported, and a cache hit's tokens are not run). Its blocks are still
        published for later requests."""
        return self.needs_prompt_logprobs or (
            self.pooling_params is not None and self.pooling_params.per_token)

    def add_prompt_logprobs(self, start: int, entries: list) -> None:
        """Record the logprobs of prompt positions ``start, start + 1, ...``; positions
        already recorded (recomputed after a preemption) are kept as they were."""
        if self.prompt_logprobs is None:
            return
        skip = len(self.prompt_logprobs) - start
        if 0 <= skip < len(entries):
            self.prompt_logprobs.extend(entries[skip:])

    def take_prompt_logprobs(self) -> list | None:
        """All prompt logprobs once complete (then never again), else None."""
        if self.prompt_logprobs is None or self.needs_prompt_logprobs:
            return None
        done, self.prompt_logprobs = self.prompt_logprobs, None
        return done

    def append_output_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.value}, "
                f"computed={self.num_computed_tokens}/{self.num_tokens})")
