"""The /v1/score (vLLM's shape) and /v1/rerank (Jina / Cohere's shape) requests and
responses of a cross-encoder server (``--task score``)."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field

from kvflow.entrypoints.protocol.base import (
    INT32_MAX,
    OmitNoneModel,
    OpenAIBaseModel,
    RequestBody,
    now,
)
from kvflow.entrypoints.protocol.embeddings import EmbeddingUsage


class ScoreRequest(RequestBody):
    """POST /v1/score: ``text_1`` against ``text_2`` (a string or a list each: 1-to-1, 1-to-N
    or N-to-N pairs), or under vLLM 0.32's names ``queries`` against ``documents`` (or
    ``items``), ``data_1`` against ``data_2`` (one pair of fields: the handler's
    ``score_fields``); ``truncate_prompt_tokens`` cuts each pair to that many tokens (the
    longer text first, each keeping its first tokens; vLLM's ``truncation_side``
    ``"left"`` / ``"right"`` cuts the whole encoding to its last / first N:
    ``kvflow.inputs.score.pair_prompt``; an embedding model cuts each text as
    /v1/embeddings does) instead of refusing a pair longer than the context; vLLM 0.32's
    ``max_tokens_per_query`` / ``max_tokens_per_doc`` (0: no cut) first cut each first /
    second text to that many tokens (``kvflow.inputs.score.cut_text``); vLLM's
    ``request_id`` names the reply (``id``: ``score-{request_id}``) and ``priority``
    orders the waiting queue (needs ``--policy priority`` or ``fair``); vLLM 0.32's
    ``padding`` ``"max_length"`` pads each pair's ids (an embedding model's: each text's)
    with the pad token to ``max_model_len``; its ``chat_template_kwargs`` / ``instruction``
    (read by a score chat template) are refused when set, as no template renders a pair
    here."""

    model: str | None = None
    request_id: str | None = Field(None, min_length=1, max_length=256)
    text_1: str | list[str] | None = None
    text_2: str | list[str] | None = None
    queries: str | list[str] | None = None
    documents: str | list[str] | None = None
    items: str | list[str] | None = None
    data_1: str | list[str] | None = None
    data_2: str | list[str] | None = None
    truncate_prompt_tokens: int | None = Field(None, ge=-1, le=INT32_MAX)
    truncation_side: Literal["left", "right"] | None = None  # None: keep the first tokens
    max_tokens_per_query: int = Field(0, ge=0, le=INT32_MAX)  # 0: no cut (vLLM 0.32's)
    max_tokens_per_doc: int = Field(0, ge=0, le=INT32_MAX)
    user: str | None = None
    priority: int = Field(0, ge=-INT32_MAX, le=INT32_MAX)
    activation: bool | None = None  # vLLM 0.10's name of use_activation
    use_activation: bool | None = None  # False: raw head logits, no softmax / sigmoid
    padding: Literal["max_length", "do_not_pad"] | None = None  # vLLM 0.32's
    # vLLM 0.32's score-template fields: refused (the server renders no score template)
    chat_template_kwargs: dict[str, Any] | None = None
    instruction: str | None = None


class ScoreData(OpenAIBaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float | list[float]  # the num_labels values of a model with several labels


ScoreUsage = EmbeddingUsage  # the same counts: prompt tokens only (vLLM's shape)


class ScoreResponse(OpenAIBaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=now)
    model: str
    data: list[ScoreData]
    usage: ScoreUsage


class RerankRequest(RequestBody):
    """POST /v1/rerank (and /rerank): ``documents`` (a list of texts, or one text as vLLM
    takes it) scored against ``query``, best first; ``top_n`` keeps the best N (0 or None:
    all); ``return_documents`` echoes each document's text (default true, as vLLM and Jina
    do; false: no ``document``, else the document as sent); ``truncate_prompt_tokens``,
    ``truncation_side``, ``max_tokens_per_query`` (the query), ``max_tokens_per_doc``,
    ``priority``, ``padding``, ``chat_template_kwargs`` and ``instruction`` as /v1/score
    reads them."""

    model: str | None = None
    request_id: str | None = Field(None, min_length=1, max_length=256)
    query: str
    documents: str | list[str]
    top_n: int | None = Field(None, ge=0, le=INT32_MAX)
    return_documents: bool = True
    truncate_prompt_tokens: int | None = Field(None, ge=-1, le=INT32_MAX)
    truncation_side: Literal["left", "right"] | None = None  # None: keep the first tokens
    max_tokens_per_query: int = Field(0, ge=0, le=INT32_MAX)  # 0: no cut (vLLM 0.32's)
    max_tokens_per_doc: int = Field(0, ge=0, le=INT32_MAX)
    user: str | None = None
    priority: int = Field(0, ge=-INT32_MAX, le=INT32_MAX)
    activation: bool | None = None  # vLLM 0.10's name of use_activation
    use_activation: bool | None = None  # False: raw head logits, no softmax / sigmoid
    padding: Literal["max_length", "do_not_pad"] | None = None  # vLLM 0.32's
    # vLLM 0.32's score-template fields: refused (the server renders no score template)
    chat_template_kwargs: dict[str, Any] | None = None
    instruction: str | None = None


class RerankDocument(OpenAIBaseModel):
    text: str


class RerankResult(OmitNoneModel):
    OMIT_IF_NONE: ClassVar[tuple[str, ...]] = ("document",)

    index: int
    relevance_score: float
    document: RerankDocument | None = None


class RerankUsage(OpenAIBaseModel):
    """vLLM's: the pairs' prompt tokens, twice (nothing is generated)."""

    prompt_tokens: int = 0
    total_tokens: int = 0


class RerankResponse(OpenAIBaseModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]
