"""POST /v1/score (vLLM's shape) and /v1/rerank, /rerank (Jina / Cohere's shape): text pairs
scored by a cross-encoder (``--task score``), one engine request per pair, batched by the
scheduler like any prompts; a pair is tokenized as ``LLM.score`` does
(``kvflow.inputs.score.pair_prompt``). An embedding model (``--task embed``) scores a pair
with the cosine similarity of its two texts' embeddings, as vLLM does."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace

from fastapi import Request
from fastapi.responses import Response

from kvflow.engine.streams import RequestStream
from kvflow.entrypoints.engine_requests import pooled_vector
from kvflow.entrypoints.openai_errors import OpenAIError
from kvflow.entrypoints.preprocess import off_loop
from kvflow.entrypoints.protocol import (
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
from kvflow.entrypoints.serving_base import OpenAIServing, request_activation, request_ids
from kvflow.inputs.score import (
    cosine_similarity,
    cut_pairs,
    pair_prompt,
    score_pairs,
    score_value,
)
from kvflow.inputs.tokenization import pooling_cut
from kvflow.inputs.truncation import truncation_length
from kvflow.pooling_params import PoolingParams

Pair = tuple[list[int], PoolingParams]
# /v1/score's two fields: kvflow's and vLLM 0.10's text_1 / text_2, and vLLM 0.32's names
SCORE_FIELDS = (("text_1", "text_2"), ("queries", "documents"), ("queries", "items"),
                ("data_1", "data_2"))
Finish = Callable[[], Awaitable[tuple[list[float | list[float]], int]]]


class OpenAIServingScore(OpenAIServing):
    """Handler of /v1/score and /v1/rerank (see OpenAIServing for the constructor)."""

    async def create_score(self, req: ScoreRequest, raw: Request) -> Response:
        """Score every (text_1, text_2) pair; answer in pair order.

        ``activation`` / ``use_activation`` false gives each pair's raw head logit(s) instead
        of the score activation (sigmoid for one label).

        Raises:
            OpenAIError: 400 for bad texts (named), a pair (or, for an embedding model, a
                text) longer than the context, ``activation`` on an embedding model (cosine
                similarity has none) or disagreeing with ``use_activation``, or a model
                that does not score (``wrong_task``); 404 for another model; 503 when
                overloaded.
        """
        self._check(req, "/v1/score")
        fields = score_fields(req)
        pairs = _pairs(getattr(req, fields[0]), getattr(req, fields[1]), fields)
        names = [f"pair {i} ({fields[0]}, {fields[1]})" for i in range(len(pairs))]
        pairs = await self._cut_pairs(req, pairs)
        reply_id, streams, finish = await self._queue(req, raw, pairs, names, fields)

        async def response() -> ScoreResponse:
            scores, tokens = await finish()
            return ScoreResponse(id=reply_id, model=self.model_name,
                                 data=[ScoreData(index=i, score=s) for i, s in enumerate(scores)],
                                 usage=ScoreUsage(prompt_tokens=tokens, total_tokens=tokens))

        return await self.respond(raw, streams, response())

    async def create_rerank(self, req: RerankRequest, raw: Request) -> Response:
        """Score every document against the query; answer the best ``top_n`` first.

        Raises:
            OpenAIError: 400 for an empty query or documents (named), a document too long for
                the context (see ``create_score``), a model with several labels (no single
                relevance score) or one that does not score (``wrong_task``); 404 for another
                model; 503 when overloaded.
        """
        self._check(req, "/v1/rerank")
        labels = self.engine.processor.pooler.num_labels
        if self.engine.task == "score" and labels != 1:
            raise OpenAIError(f"rerank needs one relevance score per document, but this model "
                              f"has num_labels={labels}: use /v1/score for its {labels} values",
                              param="model", code="invalid_value")
        sent = _pairs(req.query, req.documents, ("query", "documents"))
        names = [f"documents[{i}]" for i in range(len(sent))]
        pairs = await self._cut_pairs(req, sent)
        reply_id, streams, finish = await self._queue(req, raw, pairs, names,
                                                      ("query", "documents"))

        async def response() -> RerankResponse:
            scores, tokens = await finish()
            order = sorted(range(len(scores)), key=lambda i: -scores[i])  # stable on ties
            documents = [d for _, d in sent]  # as sent, a one-text ``documents`` as a list
            results = [RerankResult(index=i, relevance_score=scores[i],
                                    document=RerankDocument(text=documents[i])
                                    if req.return_documents else None)
                       for i in order[:req.top_n or None]]
            return RerankResponse(id=reply_id, model=self.model_name, results=results,
                                  usage=RerankUsage(prompt_tokens=tokens,
                                                    total_tokens=tokens))

        return await self.respond(raw, streams, response())

    def _check(self, req: ScoreRequest | RerankRequest, endpoint: str) -> None:
        """The checks before any work: fields, model, task (a cross-encoder, or an embedding
        model: cosine similarity)."""
        self.check_fields(req, endpoint)
        self.check_model(req.model)
        if self.engine.task != "embed":
            self.check_task("score")
        self.check_priority(req.priority)
        for name in ("chat_template_kwargs", "instruction"):
            if getattr(req, name):  # vLLM 0.32 reads them only in a score chat template
                raise OpenAIError(f"{name} is not supported by kvflow: it is read by a score "
                                  "chat template, and this server renders none (each pair "
                                  "is tokenized as the tokenizer pairs the two texts; "
                                  "LLM.score(chat_template=...) renders pairs offline)",
                                  param=name, code="unsupported_parameter")

    async def _cut_pairs(self, req: ScoreRequest | RerankRequest,
                         pairs: list[tuple[str, str]]) -> list[tuple[str, str]]:
        """``pairs`` with each first text cut to ``max_tokens_per_query`` tokens and each
        second text to ``max_tokens_per_doc`` (0: not cut; ``score_inputs.cut_text``, vLLM
        0.32's cut, before the pair is tokenized or, for an embedding model, each text
        embedded), off the event loop when long.

        Raises:
            OpenAIError: 400 naming the field for a limit not below ``--max-model-len``
                (vLLM's rule).
        """
        limits = (req.max_tokens_per_query, req.max_tokens_per_doc)
        for name, limit in zip(("max_tokens_per_query", "max_tokens_per_doc"), limits):
            if limit >= self.engine.max_model_len:
                raise OpenAIError(f"{name}={limit} must be less than max_model_len "
                                  f"({self.engine.max_model_len})", param=name,
                                  code="invalid_value")
        if not any(limits):
            return pairs
        tokenizer = self.tokenizer
        return await off_loop(sum(len(a) + len(b) for a, b in pairs),
                              lambda: cut_pairs(pairs, tokenizer, limits))

    async def _queue(self, req: ScoreRequest | RerankRequest, raw: Request,
                     pairs: list[tuple[str, str]], names: list[str], fields: tuple[str, str]
                     ) -> tuple[str, list[RequestStream], Finish]:
        """Queue the work for ``pairs``: (reply id, the streams, ``finish()`` -> (each pair's
        score, the tokens counted)). A cross-encoder computes one request per pair (its ids
        padded to ``max_model_len`` under ``padding`` "max_length", vLLM 0.32's: the pads
        take the pair's last token type, as vLLM pads token types); an embedding model one
        per distinct text (padded likewise), the score of a pair being the cosine
        similarity of its two embeddings (vLLM's scoring with embedding models; each pair
        counts both texts' tokens).

        Raises:
            OpenAIError: see ``create_score``.
        """
        reply_id, request_id = request_ids("score" if isinstance(req, ScoreRequest)
                                           else "rerank", req.request_id, raw)
        texts = None  # an embedding model's distinct texts, in the order they are queued
        use_activation = request_activation(req)
        if self.engine.task == "embed":
            if use_activation is not None:
                name = "activation" if req.activation is not None else "use_activation"
                raise OpenAIError(f"{name}: an embedding model scores by cosine similarity, "
                                  "which has no activation to turn off", param=name,
                                  code="invalid_value")
            texts, prompts = await self._embedding_prompts(req, pairs, fields)
        else:
            prompts = [(ids, replace(params, use_activation=use_activation)) for ids, params
                       in await self._prompts(pairs, req.truncate_prompt_tokens, names,
                                              fields[1], req.truncation_side)]
        padded = self.pad_ids([ids for ids, _ in prompts], req.padding)
        prompts = [(ids, params) for ids, (_, params) in zip(padded, prompts)]
        streams = await self._add(req, raw, request_id, prompts, fields[1])

        async def finish() -> tuple[list[float | list[float]], int]:
            values = await _collect(streams)
            if texts is None:
                return [score_value(v) for v in values], sum(len(i) for i, _ in prompts)
            at = {t: k for k, t in enumerate(texts)}
            return ([cosine_similarity(values[at[a]], values[at[b]]) for a, b in pairs],
                    sum(len(prompts[at[a]][0]) + len(prompts[at[b]][0]) for a, b in pairs))

        return reply_id, streams, finish

    async def _embedding_prompts(self, req: ScoreRequest | RerankRequest,
                                 pairs: list[tuple[str, str]], fields: tuple[str, str]
                                 ) -> tuple[list[str], list[Pair]]:
        """An embedding model's distinct texts of ``pairs`` and their prompts (as
        /v1/embeddings tokenizes them).

        ``truncate_prompt_tokens`` cuts each text on its own (on ``truncation_side``), as
        /v1/embeddings cuts an input (:func:`~kvflow.inputs.tokenization.pooling_cut`).

        Raises:
            OpenAIError: 400 for a bad ``truncate_prompt_tokens`` or a text longer than the
                context (named; ``fields[1]``, or ``fields[0]`` for a first text).
        """
        try:
            limit = truncation_length(req.truncate_prompt_tokens, self.engine.max_model_len)
        except ValueError as e:
            raise OpenAIError(str(e), param="truncate_prompt_tokens",
                              code="invalid_value") from None
        texts = list(dict.fromkeys(t for pair in pairs for t in pair))
        processor, tokenizer = self.engine.processor, self.tokenizer
        model_texts = [processor.pooling_text(t) for t in texts]
        if limit is None:
            ids = await self.encode_texts(tokenizer, model_texts, True, fields[1],
                                          pooling=True)
        else:
            cut = pooling_cut(limit, req.truncation_side)
            ids = await off_loop(sum(map(len, model_texts)), lambda: [
                cut.encode(tokenizer, t) for t in model_texts])
        first, limit = {a for a, _ in pairs}, self.engine.max_model_len
        for text, text_ids in zip(texts, ids):
            if len(text_ids) > limit:
                raise OpenAIError(f"the text {text[:40]!r} has {len(text_ids)} tokens but "
                                  f"max_model_len is {limit}",
                                  param=fields[0] if text in first else fields[1],
                                  code="context_length_exceeded")
        return texts, [(i, PoolingParams()) for i in ids]

    async def _prompts(self, pairs: list[tuple[str, str]], truncate: int | None,
                       names: list[str], param: str, side: str | None = None) -> list[Pair]:
        """Each pair's token ids and PoolingParams (tokenized off the event loop when long;
        cut to ``truncate`` on ``side``: ``pair_prompt``), each checked against the
        context.

        Raises:
            OpenAIError: 400 naming the pair (``names[i]``; ``param``) that does not fit,
                code ``context_length_exceeded``, or a bad ``truncate_prompt_tokens``.
        """
        tokenizer = self.tokenizer

        def encode_all() -> list[Pair]:
            limit = truncation_length(truncate, self.engine.max_model_len)  # -1: all of it
            return [pair_prompt(tokenizer, a, b, limit, side) for a, b in pairs]

        try:
            prompts = await off_loop(sum(len(a) + len(b) for a, b in pairs), encode_all)
        except ValueError as e:
            raise OpenAIError(str(e), param="truncate_prompt_tokens",
                              code="invalid_value") from None
        limit = self.engine.max_model_len
        for name, (ids, _) in zip(names, prompts):
            if len(ids) > limit:
                raise OpenAIError(f"{name} has {len(ids)} tokens but max_model_len is {limit}: "
                                  "shorten it or send truncate_prompt_tokens", param=param,
                                  code="context_length_exceeded")
        return prompts

    async def _add(self, req: ScoreRequest | RerankRequest, raw: Request, request_id: str,
                   prompts: list[Pair], param: str) -> list[RequestStream]:
        """Queue every pair (ids ``{request_id}-{i}``; ``param``: the field named if
        admission refuses them); see ``OpenAIServing.admit_all``."""
        self.check_admission(len(prompts), param)
        self.note_request(req, request_id)
        client = self.client_id(req, raw)

        def add(i: int) -> RequestStream:
            ids, params = prompts[i]
            self.log_request(f"{request_id}-{i}", None, ids, params)
            return self.engine.add_pooling_request(f"{request_id}-{i}", None, ids, params,
                                                   client, req.priority)

        return await self.admit_all(add, len(prompts))


async def _collect(streams: Sequence[RequestStream]) -> list[list[float]]:
    """Each stream's pooled values, in order.

    Raises:
        OpenAIError: 503 if the engine dropped a request.
    """
    return [await pooled_vector(stream) for stream in streams]


def score_fields(req: ScoreRequest) -> tuple[str, str]:
    """The two fields a /v1/score body holds its texts in: one pair of ``SCORE_FIELDS``
    (``text_1`` / ``text_2``, or vLLM 0.32's ``queries`` / ``documents``, ``queries`` /
    ``items``, ``data_1`` / ``data_2``), both sent and no field of another pair.

    Raises:
        OpenAIError: 400 naming a field missing from the pair begun (or ``text_1`` when
            none was sent; code ``missing_required_parameter``) or one of another pair sent
            too (``invalid_value``).
    """
    sent = [n for n in dict.fromkeys(n for pair in SCORE_FIELDS for n in pair)
            if getattr(req, n) is not None]
    whole = [pair for pair in SCORE_FIELDS if set(pair) <= set(sent)]
    if not whole:
        begun = next((pair for pair in SCORE_FIELDS if pair[0] in sent or pair[1] in sent),
                     SCORE_FIELDS[0])
        missing = next(n for n in begun if n not in sent)
        raise OpenAIError(f"{missing}: a required field, not sent (send text_1 and text_2, or "
                          "vLLM's queries and documents (or items), or data_1 and data_2)",
                          param=missing, code="missing_required_parameter")
    extra = [n for n in sent if n not in whole[0]]
    if extra:
        raise OpenAIError(f"{extra[0]}: send the texts in one pair of fields, not "
                          f"{whole[0][0]} / {whole[0][1]} and {', '.join(extra)}",
                          param=extra[0], code="invalid_value")
    return whole[0]


def _pairs(first: str | Sequence[str], second: str | Sequence[str],
           names: tuple[str, str]) -> list[tuple[str, str]]:
    """``score_pairs(first, second, names)``: the pairs to score, in order.

    Raises:
        OpenAIError: 400 (``invalid_value``) for texts that do not pair, naming the field.
    """
    try:
        return score_pairs(first, second, names)
    except ValueError as e:
        raise OpenAIError(str(e), param=_named(str(e), names), code="invalid_value") from None


def _named(message: str, names: tuple[str, str]) -> str:
    """The request field a pairing error names first (``names[0]`` when it names neither)."""
    return min(names, key=lambda n: (message.find(n) < 0, message.find(n)))
