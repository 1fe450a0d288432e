"""Messages between the API process and the engine-core process (msgspec, msgpack-encoded).

API -> core (one PUSH/PULL socket): ``AddRequests``, ``AbortRequests``, ``Shutdown``, and the
calls ``AddLoRA`` / ``RemoveLoRA`` / ``ResetPrefixCache`` / ``Sleep`` / ``WakeUp`` /
``CollectiveRPC``.
Core -> API (another PUSH/PULL socket): ``EngineReady`` or ``EngineFailed`` once at start-up,
then ``EngineOutputs`` (the step's new tokens plus the core's stats) after every step that
produced tokens and after every batch of inputs it handled, and, with admission control, an
``AdmissionVerdicts`` as soon as a batch of new requests was judged (before the next step).
A ``UtilityResult`` answers each call (matched by ``call_id``). A ready core's thread sends an
``EngineHeartbeat`` every second or so (its own PUSH socket to the same output socket). With data
parallelism every replica has an input socket of its own and all of them push to the
one output socket; their messages carry the replica's ``engine_index``.
"""

from __future__ import annotations

from typing import Any

import msgspec

from kvflow.engine_outputs import EngineCoreOutput, EngineStats
from kvflow.inputs.embeds import PromptEmbeds
from kvflow.inputs.multimodal import MultiModalFeature
from kvflow.lora.request import LoRARequest
from kvflow.models.pooling_config import PoolerConfig
from kvflow.pooling_params import PoolingParams
from kvflow.request import Request
from kvflow.sampling_params import SamplingParams


class EngineCoreRequest(msgspec.Struct, array_like=True):
    """The constructor arguments of one engine ``Request`` (one sample of a user request)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    arrival_time: float  # time.monotonic() seconds (system-wide clock on Linux)
    priority: int
    parent_id: str
    sample_index: int
    # the prompt's images, preprocessed (pixel patches as bytes): see kvflow/multimodal_inputs
    mm_features: list[MultiModalFeature] | None = None
    client_id: str = ""
    lora_request: LoRARequest | None = None
    pooling_params: PoolingParams | None = None
    cache_salt: str | None = None  # salts the prompt's first prefix-cache block
    # a prompt given as embedding rows (raw bytes): see kvflow/inputs/embeds.py
    prompt_embeds: PromptEmbeds | None = None
    session_id: str | None = None  # vLLM 0.32's: written into its BlockStored events

    @classmethod
    def from_request(cls, r: Request) -> EngineCoreRequest:
        return cls(r.request_id, r.prompt_token_ids, r.sampling_params, r.eos_token_id,
                   r.arrival_time, r.priority, r.parent_id, r.sample_index, r.mm_features,
                   r.client_id, r.lora_request, r.pooling_params, r.cache_salt,
                   r.prompt_embeds, r.session_id)

    def to_request(self) -> Request:
        return Request(self.request_id, self.prompt_token_ids, self.sampling_params,
                       self.eos_token_id, self.arrival_time, self.priority, self.parent_id,
                       self.sample_index, self.mm_features, self.client_id,
                       self.lora_request, self.pooling_params, self.cache_salt,
                       self.prompt_embeds, self.session_id)


class AddRequests(msgspec.Struct, tag="add"):
    requests: list[EngineCoreRequest]


class AbortRequests(msgspec.Struct, tag="abort"):
    """Sample ids to stop now; their KV blocks are freed before the next step. ``stopped``:
    stop strings ended them (a finish, counted in the metrics as vLLM does), not a client."""

    request_ids: list[str]
    stopped: bool = False


class Shutdown(msgspec.Struct, tag="shutdown"):
    pass


class AddLoRA(msgspec.Struct, tag="add_lora"):
    """Load a LoRA adapter on every rank (answered by a ``UtilityResult``)."""

    call_id: int
    lora_request: LoRARequest


class RemoveLoRA(msgspec.Struct, tag="remove_lora"):
    """Forget a LoRA adapter (answered by a ``UtilityResult``)."""

    call_id: int
    lora_int_id: int


class Sleep(msgspec.Struct, tag="sleep"):
    """Sleep mode: free the KV cache, offload (1) or drop (2) the weights (answered by a
    ``UtilityResult``)."""

    call_id: int
    level: int


class WakeUp(msgspec.Struct, tag="wake_up"):
    """Wake the sleeping ``tags`` ("weights", "kv_cache"; None: both)."""

    call_id: int
    tags: list[str] | None = None


class CollectiveRPC(msgspec.Struct, tag="collective_rpc"):
    """A Worker method by name on every rank; the ``UtilityResult`` holds the results."""

    call_id: int
    method: str
    args: list = msgspec.field(default_factory=list)
    kwargs: dict | None = None


class ResetPrefixCache(msgspec.Struct, tag="reset_prefix_cache"):
    """Forget the cached prefixes (answered by a ``UtilityResult`` whose ``result`` says
    whether the cache was reset: ``EngineCore.reset_prefix_cache``)."""

    call_id: int


UtilityCall = AddLoRA | RemoveLoRA | ResetPrefixCache | Sleep | WakeUp | CollectiveRPC
EngineInput = AddRequests | AbortRequests | Shutdown | AddLoRA | RemoveLoRA | ResetPrefixCache \
    | Sleep | WakeUp | CollectiveRPC


class EngineReady(msgspec.Struct, tag="ready"):
    """Sent once the model is loaded and the KV cache is sized."""

    max_model_len: int
    vocab_size: int
    eos_token_id: int | None  # from the model config (the tokenizer's wins when it has one)
    num_blocks: int
    block_size: int
    stats: EngineStats  # the idle engine's counters, so /metrics is right before any request
    engine_index: int = 0  # the data-parallel replica
    task: str = "generate"  # or "embed", "score", "classify"
    pooler: PoolerConfig | None = None  # a pooling (embed or score) model's pooling
    hidden_size: int = 0
    max_model_len_note: str = ""  # why max_model_len is lower than asked (the KV cache)
    enable_prefix_caching: bool = True  # as the core resolved it (/metrics' cache_config_info)


class EngineFailed(msgspec.Struct, tag="failed"):
    """Sent when start-up or a step raised; the core process exits after sending it.
    ``bad_input``: start-up raised ValueError (a bad model or configuration, the message
    says which), which the API process raises as a ValueError too (CLI exit status 2)."""

    message: str
    engine_index: int = 0
    bad_input: bool = False


class EngineOutputs(msgspec.Struct, tag="outputs"):
    outputs: list[EngineCoreOutput]
    stats: EngineStats
    engine_index: int = 0


class Rejection(msgspec.Struct, array_like=True):
    """A user request (all its samples) refused by admission control."""

    request_id: str  # the parent id (the API's request id)
    retry_after_s: float
    message: str


class AdmissionVerdicts(msgspec.Struct, tag="verdicts"):
    """Admission control's answer for the user requests of one batch of inputs: those
    queued, and those refused (their samples were never queued)."""

    accepted: list[str]
    rejected: list[Rejection]


class UtilityResult(msgspec.Struct, tag="utility"):
    """The answer to a call (``UtilityCall``): ``error`` is None on success, else the
    ValueError's message (the engine keeps running); ``result``: the call's return value,
    for a call that has one (``ResetPrefixCache``: whether the cache was reset; a
    ``CollectiveRPC``'s results by rank, plain data)."""

    call_id: int
    error: str | None = None
    result: Any = None


class EngineHeartbeat(msgspec.Struct, tag="heartbeat"):
    """Sent every second or so by a core's heartbeat thread (``core_heartbeat``), from the
    core's start (its model load included) and during long steps: the API process takes a
    core silent for longer than ``engine_heartbeat_timeout`` for dead (stopped or frozen).
    ``stamp``: the core's ``time.monotonic()`` (seconds; one system-wide clock on Linux
    and macOS)."""

    engine_index: int
    stamp: float


EngineOutput = EngineReady | EngineFailed | EngineOutputs | AdmissionVerdicts | UtilityResult \
    | EngineHeartbeat


def input_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(EngineInput)


def output_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(EngineOutput)
