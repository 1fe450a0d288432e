"""POST /classify (and /v1/classify; vLLM's shape): each input (text or token ids) -> a
sequence classifier's class probabilities (``--task classify``), one engine request per
input, batched by the scheduler like any prompts. Inputs are read and refused as
/v1/embeddings reads them (the same handler's steps); ``label`` is the most probable class's
name from the model's ``config.id2label``."""

from __future__ import annotations

from collections.abc import Sequence

from fastapi import Request
from fastapi.responses import Response

from kvflow.engine.streams import RequestStream
from kvflow.entrypoints.engine_requests import pooled_vector
from kvflow.entrypoints.protocol import (
    ClassificationData,
    ClassificationRequest,
    ClassificationResponse,
    UsageInfo,
)
from kvflow.entrypoints.serving_base import request_activation, request_ids
from kvflow.entrypoints.serving_embedding import OpenAIServingEmbedding, Prompt
from kvflow.pooling_params import PoolingParams


class OpenAIServingClassification(OpenAIServingEmbedding):
    """Handler of /classify (see OpenAIServing for the constructor)."""

    async def create_classify(self, req: ClassificationRequest, raw: Request) -> Response:
        """Classify every input; answer in input order.

        Raises:
            OpenAIError: 400 for an empty input or a token id outside the vocabulary (named
                ``input`` / ``input.<i>``), both or neither of ``input`` and ``messages``, a
                chat field with ``input``, an input longer than the context (code
                ``context_length_exceeded``; send ``truncate_prompt_tokens`` to cut it), or a
                model that does not classify (``wrong_task``), ``activation`` and
                ``use_activation`` that disagree; 404 for another model; 503 when overloaded.
                ``activation`` / ``use_activation`` false answers the head's raw logits in
                ``probs`` (``label``: the largest).
        """
        self.check_fields(req, "/classify")
        self.check_model(req.model)
        self.check_task("classify")
        self.check_priority(req.priority)
        prompts = await self._inputs_of(req, raw)
        self.check_admission(len(prompts), "input")
        reply_id, request_id = request_ids("classify", req.request_id, raw)
        self.note_request(req, request_id)
        params = PoolingParams(task="classify", use_activation=request_activation(req))
        streams = await self._add(request_id, prompts, params, self.client_id(req, raw),
                                  req.priority)
        return await self.respond(raw, streams, self._classes(reply_id, prompts, streams))

    async def _classes(self, reply_id: str, prompts: list[Prompt],
                       streams: Sequence[RequestStream]) -> ClassificationResponse:
        labels, data = self.engine.processor.pooler.labels, []
        for i, stream in enumerate(streams):
            probs = await pooled_vector(stream)
            best = max(range(len(probs)), key=probs.__getitem__)  # the first of equal ones
            data.append(ClassificationData(index=i, label=labels[best], probs=probs,
                                           num_classes=len(probs)))
        num_tokens = sum(len(ids) for _, ids in prompts)
        return ClassificationResponse(id=reply_id, model=self.model_name, data=data,
                                      usage=UsageInfo(prompt_tokens=num_tokens,
                                                      total_tokens=num_tokens))
