"""Request fields shared by /v1/completions and /v1/chat/completions (sampling, stop,
structured outputs, scheduling), and the /v1/completions request itself."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field, model_validator

from kvflow.entrypoints.protocol.base import (
    INT32_MAX,
    INT64_MAX,
    INT64_MIN,
    RequestBody,
    RequestModel,
    request_limit,
)

# logit_bias entries one request may hold: more than any model's vocabulary has token ids (the
# largest in use, Gemma 3's, has about 262,000), so no valid request holds more; validated on
# the event loop, a 32 MiB body's ~2.5 million entries held it for seconds. In docs/openai-server.md.
MAX_LOGIT_BIAS = 300_000

# session_id's length (as request_id's): the string is copied into every BlockStored KV cache
# event of the blocks the request stores, so it stays short. In docs/openai-server.md.
MAX_SESSION_ID_CHARS = 256

# a vllm_xargs value (vLLM: str | int | float, or a list of them; JSON's true / false kept)
XargValue = str | bool | int | float


class StreamOptions(RequestModel):
    """``stream_options`` of a streamed request. ``include_usage``: a last chunk (no choices)
    carries the request's usage; ``continuous_usage_stats`` (vLLM's extension): every chunk
    carries the usage so far (prompt tokens, tokens generated up to and including that chunk,
    their sum). ``include_obfuscation`` (OpenAI's; the official ``openai`` client types it):
    kvflow adds no obfuscation padding to chunks, so ``false`` (and null) is what it does and
    ``true`` is a 400 (``serving_checks.check_stream_options``), as on /v1/responses. A key
    it does not declare is a 400 naming ``stream_options.<key>``."""

    include_usage: bool = False
    continuous_usage_stats: bool = False
    include_obfuscation: bool | None = None


class JsonSchemaFormat(RequestModel):
    """``response_format.json_schema``: the schema is under ``schema`` (alias of
    ``json_schema``, which pydantic's BaseModel reserves). ``strict``: the schema is always
    enforced (as with OpenAI's ``strict: true``). ``name`` is required, by OpenAI's rule
    (``^[a-zA-Z0-9_-]{1,64}$``)."""

    model_config = ConfigDict(populate_by_name=True)

    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    description: str | None = None
    json_schema: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class StructuralTagStructure(RequestModel):
    """One of ``response_format.structures`` (type ``structural_tag``, vLLM's legacy
    spelling): the ``begin`` string, a JSON value valid for ``schema`` (alias of
    ``structure_schema``, which pydantic's BaseModel reserves), the ``end`` string."""

    model_config = ConfigDict(populate_by_name=True)

    begin: str
    structure_schema: dict[str, Any] | bool = Field(alias="schema")
    end: str


class ResponseFormat(RequestModel):
    """OpenAI ``response_format``: ``text``, ``json_object`` or ``json_schema``; or vLLM's
    ``structural_tag`` (free text until one of ``triggers``, then one of ``structures``),
    with ``structures`` and ``triggers`` or, in xgrammar's newer spelling, ``format``
    (``kvflow/structured/structural_tag.py``)."""

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None
    structures: list[StructuralTagStructure] | None = None
    triggers: list[str] | None = None
    format: dict[str, Any] | None = None


class StructuredOutputsField(RequestModel):
    """The vLLM-style ``structured_outputs`` extra body field (exactly one of these)."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    structural_tag: str | dict[str, Any] | None = None


class RepetitionDetection(RequestModel):
    """vLLM 0.32's ``repetition_detection``: the request finishes with reason
    ``repetition`` (stop reason ``"repetition_detected"``) once its generated tokens end with
    an n-gram of ``min_pattern_size`` (0: 1) to ``max_pattern_size`` tokens repeated
    ``min_count`` times in a row (``kvflow/sampling/repetition_detection.py``); ``max_pattern_size``
    0 turns it off. A key it does not declare is a 400 naming
    ``repetition_detection.<key>``; the rules between the fields (``min_pattern_size`` <=
    ``max_pattern_size``, ``min_count`` >= 2 while on) a 400 naming the field."""

    max_pattern_size: int = Field(0, ge=0, le=INT32_MAX)
    min_pattern_size: int = Field(0, ge=0, le=INT32_MAX)
    min_count: int = Field(0, ge=0, le=INT32_MAX)


class SamplingRequest(RequestBody):
    """Fields shared by completion and chat requests. vLLM's older ``guided_json`` /
    ``guided_regex`` / ``guided_choice`` / ``guided_grammar`` are ``structured_outputs``
    under other names; ``priority`` orders the waiting queue (needs ``--policy priority`` or
    ``fair``); ``target_ttft_ms`` / ``target_tpot_ms`` override the server's service-level
    targets for this request; ``user`` names the client for ``--policy fair``; vLLM's
    ``request_id`` names the reply (``id``: ``cmpl-{request_id}`` / ``chatcmpl-{request_id}``,
    as vLLM writes it); vLLM's ``cache_salt`` (a non-empty string) salts the prompt's
    prefix-cache blocks: only requests with the same salt share them. vLLM's
    ``allowed_token_ids``, ``bad_words`` and ``truncate_prompt_tokens`` are SamplingParams'
    (``kvflow.sampling_params``); ``return_tokens_as_token_ids`` writes every logprobs token
    as ``token_id:{id}`` (unset: the server's ``--return-tokens-as-token-ids``); vLLM's ``vllm_xargs`` (string keys; each value a string, number or
    bool, or a flat list of them, as vLLM's type allows; anything nested is a 400 naming it)
    becomes ``SamplingParams.extra_args``, the arguments of the server's custom logits
    processors (``--logits-processors``). vLLM's ``kv_transfer_params`` (a JSON object, what
    a disaggregated-prefill proxy sends each instance) is taken by a server with
    ``--kv-transfer-config`` and read by no connector of kvflow's (SharedStorageConnector
    finds a prompt's blocks by their content, as vLLM's does). vLLM 0.32's
    ``thinking_token_budget`` (an integer >= 0, or -1 for unlimited) ends the reply's think
    block after that many tokens (``SamplingParams.thinking_token_budget``; the markers come
    from ``--reasoning-parser``); ``stream_interval`` (tokens per streamed chunk, raised to
    the server's ``--stream-interval``; no effect on a reply that is not streamed, as
    vLLM's) and ``repetition_detection`` are SamplingParams', and so is ``logprob_token_ids``
    (each generated token's logprobs are those of the listed ids and its own, in place of the
    top ones; it needs ``logprobs``: a count on completions, ``true`` on chat). vLLM 0.32's
    ``session_id`` (a string of at most 256 characters; "" as none) names the conversation or
    agent session the request belongs to: it goes into the ``BlockStored`` KV cache events of
    the blocks the request stores (``--kv-events-config``), for session-aware routers."""

    model: str | None = None
    request_id: str | None = Field(None, min_length=1, max_length=256)
    n: int = Field(1, ge=1, le=INT32_MAX)
    temperature: float | None = Field(None, ge=0.0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int | None = Field(None, ge=-1, le=INT32_MAX)
    min_p: float | None = Field(None, ge=0.0, le=1.0, allow_inf_nan=False)
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, le=INT32_MAX)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0, allow_inf_nan=False)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0, allow_inf_nan=False)
    repetition_penalty: float | None = Field(None, gt=0.0, allow_inf_nan=False)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    return_token_ids: bool = False
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    priority: int = Field(0, ge=-INT32_MAX, le=INT32_MAX)
    target_ttft_ms: float | None = Field(None, gt=0.0, allow_inf_nan=False)
    target_tpot_ms: float | None = Field(None, gt=0.0, allow_inf_nan=False)
    best_of: int | None = Field(None, ge=1, le=INT32_MAX)
    use_beam_search: bool = False
    length_penalty: float = Field(1.0, allow_inf_nan=False)
    prompt_logprobs: int | None = Field(None, ge=0, le=INT32_MAX)
    cache_salt: str | None = Field(None, min_length=1)
    session_id: str | None = Field(None, max_length=MAX_SESSION_ID_CHARS)
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    return_tokens_as_token_ids: bool | None = None  # None: --return-tokens-as-token-ids
    # vLLM's custom arguments: SamplingParams.extra_args, read by custom logits processors
    vllm_xargs: dict[str, XargValue | list[XargValue]] | None = None
    # vLLM's disaggregated-prefill parameters (--kv-transfer-config servers only)
    kv_transfer_params: dict[str, Any] | None = None
    # vLLM 0.32's: think tokens before the end marker is forced (-1 or null: unlimited);
    # needs --reasoning-parser (entrypoints/sampling_requests.py)
    thinking_token_budget: int | None = Field(None, ge=-1, le=INT64_MAX)
    # vLLM 0.32's: the logprobs of these ids in place of the top ones (needs logprobs)
    logprob_token_ids: list[int] | None = Field(None, min_length=1)
    # vLLM 0.32's: tokens per streamed chunk, raised to the server's --stream-interval
    stream_interval: int | None = Field(None, ge=1, le=INT32_MAX)
    # vLLM 0.32's: finish with reason "repetition" on a repeated n-gram
    repetition_detection: RepetitionDetection | None = None

    @model_validator(mode="wrap")
    @classmethod
    def _cap_logit_bias(cls, data: Any, handler: Any) -> Any:
        """Refuse more than :data:`MAX_LOGIT_BIAS` ``logit_bias`` entries before the body is
        validated (:func:`cap_logit_bias`)."""
        cap_logit_bias(data)
        return handler(data)


def cap_logit_bias(data: Any) -> None:
    """Refuse a raw request body (``data``, before validation) holding more than
    :data:`MAX_LOGIT_BIAS` ``logit_bias`` entries.

    Raises:
        PydanticCustomError: ``base.request_limit``'s, answered as a 400 at ``logit_bias``
            (code ``array_above_max_length``).
    """
    bias = data.get("logit_bias") if isinstance(data, dict) else None
    if isinstance(bias, dict) and len(bias) > MAX_LOGIT_BIAS:
        raise request_limit("logit_bias", f"a request holds at most {MAX_LOGIT_BIAS} "
                            f"entries (more than any model's vocabulary); this one holds "
                            f"{len(bias)}")


class CompletionRequest(SamplingRequest):
    """POST /v1/completions. ``prompt``: a string, a list of strings, a list of token ids or a
    list of token-id lists; ``prompt_embeds`` (``--enable-prompt-embeds``): base64 of a
    ``torch.save``d float tensor [num_tokens, hidden_size], or a list of them, answered
    before the ``prompt`` prompts (one of the two fields is required)."""

    # list[int] before list[str]: a long list of token ids is then matched at once, not
    # first refused item by item as strings (1M ids: 0.03 s instead of 0.3 s on the loop)
    prompt: str | list[int] | list[str] | list[list[int]] | None = None
    prompt_embeds: str | list[str] | None = None
    # unset or null: the model's generation-config max_new_tokens, else 16
    max_tokens: int | None = Field(None, le=INT32_MAX)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=INT32_MAX)
    add_special_tokens: bool = True
    suffix: str | None = None
