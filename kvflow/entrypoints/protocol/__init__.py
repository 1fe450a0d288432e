"""OpenAI API request/response schemas (pydantic), plus the vLLM extensions kvflow supports.

A top-level field a request does not declare is a 400 naming it (code ``unknown_parameter``,
as OpenAI answers; under ``--ignore-unknown-fields`` it is ignored and each name logged once,
as vLLM does: ``entrypoints/unknown_fields.py``), and nested objects (content parts,
``response_format``, ``tools``, ``tool_choice``, ``stream_options``, ...) take only their own
keys, as OpenAI's do: another is a 400 naming its path (code ``unknown_parameter``); a
message's extra keys reach the chat template; ``null`` for a nullable field means the same as
leaving it out (``"max_tokens": null``); a known
field with a value of the wrong type or out of its range fails validation and becomes a 400
with an OpenAI error body. Types are strict, as OpenAI's are (``RequestModel``): ``"8"``,
``8.0`` or ``true`` for an integer field is an ``invalid_type`` 400, not 8; a number field
takes any JSON number, an integer included. Every field a request model declares is honoured,
or rejected with a 400 naming it when set to a value kvflow does not implement (``best_of``
other than ``n``, a field ``use_beam_search`` does not honour, streamed chat
``prompt_logprobs``, ``suffix``, chat ``echo``,
``store: true``, a ``service_tier`` other than ``auto`` / ``default``);
tests/e2e/test_openai_fields.py walks every field. Text anywhere in a body that holds a lone
UTF-16 surrogate is a 400 naming the field (``invalid_unicode``).
Extensions beyond OpenAI: ``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``,
``ignore_eos``, ``stop_token_ids``, ``skip_special_tokens``, ``include_stop_str_in_output``,
``return_token_ids`` (adds ``token_ids`` to each choice and ``prompt_token_ids``; streamed,
the first chunk of each choice carries ``prompt_token_ids``), ``stream_options``'
``continuous_usage_stats`` (every chunk carries the usage so far),
``structured_outputs`` (``json`` / ``regex`` / ``choice`` / ``grammar`` / ``structural_tag``
constraints), ``response_format`` of type ``structural_tag`` (vLLM's).

The models live in one module per job: ``base`` (base classes, the error body, the
request-body checks), ``sampling`` (the fields completion and chat share; the completion
request), ``chat`` (the chat request), ``responses`` (completion and chat replies),
``responses_api`` (/v1/responses: imported from its module), ``embeddings``, ``pooling``
(/pooling), ``scoring`` (score and rerank), ``classification`` (/classify), ``management``
(models, LoRA adapters, tokenize, version). Import them from this package.
"""

from __future__ import annotations

from kvflow.entrypoints.protocol.base import (
    ErrorInfo,
    ErrorResponse,
    OmitNoneModel,
    OpenAIBaseModel,
    RequestBody,
    RequestModel,
)
from kvflow.entrypoints.protocol.chat import (
    ChatCompletionRequest,
    ChatMessage,
    ChatTool,
    ContentPart,
    FunctionDefinition,
    ImageURL,
    NamedFunction,
    NamedToolChoice,
)
from kvflow.entrypoints.protocol.classification import (
    ClassificationData,
    ClassificationRequest,
    ClassificationResponse,
)
from kvflow.entrypoints.protocol.embeddings import (
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingUsage,
)
from kvflow.entrypoints.protocol.management import (
    DetokenizeRequest,
    DetokenizeResponse,
    LoadLoRAAdapterRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    UnloadLoRAAdapterRequest,
    VersionResponse,
)
from kvflow.entrypoints.protocol.pooling import PoolingData, PoolingRequest, PoolingResponse
from kvflow.entrypoints.protocol.responses import (
    ChatChoice,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    ChatLogprobs,
    ChatLogprobToken,
    ChatResponseMessage,
    ChatStreamChoice,
    CompletionChoice,
    CompletionLogProbs,
    CompletionResponse,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    PromptLogprob,
    PromptTokenUsageInfo,
    ToolCall,
    TopLogprob,
    UsageInfo,
)
from kvflow.entrypoints.protocol.sampling import (
    CompletionRequest,
    JsonSchemaFormat,
    ResponseFormat,
    SamplingRequest,
    StreamOptions,
    StructuralTagStructure,
    StructuredOutputsField,
)
from kvflow.entrypoints.protocol.scoring import (
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    RerankUsage,
    ScoreData,
    ScoreRequest,
    ScoreResponse,
    ScoreUsage,
)

__all__ = [
    "ChatChoice",
    "ChatCompletionRequest",
    "ChatCompletionResponse",
    "ChatCompletionStreamResponse",
    "ChatLogprobToken",
    "ChatLogprobs",
    "ChatMessage",
    "ChatResponseMessage",
    "ChatStreamChoice",
    "ChatTool",
    "ClassificationData",
    "ClassificationRequest",
    "ClassificationResponse",
    "CompletionChoice",
    "CompletionLogProbs",
    "CompletionRequest",
    "CompletionResponse",
    "ContentPart",
    "DeltaFunctionCall",
    "DeltaMessage",
    "DeltaToolCall",
    "DetokenizeRequest",
    "DetokenizeResponse",
    "EmbeddingData",
    "EmbeddingRequest",
    "EmbeddingResponse",
    "EmbeddingUsage",
    "ErrorInfo",
    "ErrorResponse",
    "FunctionCall",
    "FunctionDefinition",
    "ImageURL",
    "JsonSchemaFormat",
    "LoadLoRAAdapterRequest",
    "ModelCard",
    "ModelList",
    "NamedFunction",
    "NamedToolChoice",
    "OmitNoneModel",
    "OpenAIBaseModel",
    "PoolingData",
    "PoolingRequest",
    "PoolingResponse",
    "PromptLogprob",
    "PromptTokenUsageInfo",
    "RequestBody",
    "RequestModel",
    "RerankDocument",
    "RerankRequest",
    "RerankResponse",
    "RerankResult",
    "RerankUsage",
    "ResponseFormat",
    "SamplingRequest",
    "ScoreData",
    "ScoreRequest",
    "ScoreResponse",
    "ScoreUsage",
    "StreamOptions",
    "StructuralTagStructure",
    "StructuredOutputsField",
    "TokenizeRequest",
    "TokenizeResponse",
    "ToolCall",
    "TopLogprob",
    "UnloadLoRAAdapterRequest",
    "UsageInfo",
    "VersionResponse",
]
