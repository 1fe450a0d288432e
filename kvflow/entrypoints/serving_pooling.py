"""POST /pooling (vLLM's generic pooling endpoint): each input, or one chat conversation, ->
the pooling model's output: an embedding model's vector (as /v1/embeddings gives it), a
sequence classifier's class probabilities (as /classify's ``probs``), or with vLLM's
per-token tasks one row per prompt token (``token_embed``: every token's hidden state on an
embedding server; ``token_classify``: a token classifier's class probabilities). Inputs are read,
queued and encoded by /v1/embeddings' steps (``OpenAIServingEmbedding``); a conversation is
rendered by the chat handler's ``render``."""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.responses import Response

from kvflow.entrypoints.openai_errors import OpenAIError
from kvflow.entrypoints.pooling_encoding import check_encoding
from kvflow.entrypoints.protocol import (
    PoolingData,
    PoolingRequest,
    PoolingResponse,
    UsageInfo,
)
from kvflow.entrypoints.serving_base import request_activation, request_ids
from kvflow.entrypoints.serving_embedding import OpenAIServingEmbedding, check_normalize
from kvflow.models.pooling_config import TASK_VERB
from kvflow.pooling_params import PoolingParams

# vLLM's pooling tasks kvflow does not run on /pooling, and what to use instead
OTHER_TASKS = {
    "score": "score text pairs with /score (/v1/score) or /rerank",
    "encode": "vLLM 0.10's per-token task is token_embed (an embedding model) or "
              "token_classify (a token classifier) here",
    "plugin": "kvflow has no IO-processor plugins",
}
TASKS = ("embed", "classify", "token_embed", "token_classify")
# what a server of each engine task gives /pooling when the request names no task
_DEFAULT_TASK = {"embed": "embed", "token_classify": "token_classify"}
_RESULT = {"embed": "embeddings", "token_classify": "per-token classes"}


class OpenAIServingPooling(OpenAIServingEmbedding):
    """Handler of /pooling (see OpenAIServingEmbedding for the constructor)."""

    async def create_pooling(self, req: PoolingRequest, raw: Request) -> Response:
        """Pool every input (or the conversation); answer in input order.

        Raises:
            OpenAIError: 400 for a generating server (``wrong_task``), a ``task`` the model
                does not run or kvflow does not implement (naming ``task``), both or neither
                of ``input`` and ``messages``, a field that does not apply to the task
                (``dimensions``, ``normalize``) or encoding (``embed_dtype``,
                ``endianness`` with ``float``), and what /v1/embeddings refuses; 404 for
                another model; 503 when overloaded.
        """
        self.check_fields(req, "/pooling")
        self.check_model(req.model)
        params = self._params(req, self._task(req.task))
        check_encoding(req.encoding_format, req.embed_dtype, req.endianness)
        self.check_priority(req.priority)
        prompts = await self._inputs_of(req, raw)
        self.check_admission(len(prompts), "input")
        reply_id, request_id = request_ids("pool", req.request_id, raw)
        self.note_request(req, request_id)
        streams = await self._add(request_id, prompts, params, self.client_id(req, raw),
                                  req.priority)

        def reply(values: list[Any], num_tokens: int) -> PoolingResponse:
            data = [PoolingData(index=i, data=value) for i, value in enumerate(values)]
            return PoolingResponse(id=reply_id, model=self.model_name, data=data,
                                   usage=UsageInfo(prompt_tokens=num_tokens,
                                                   total_tokens=num_tokens))

        return await self.respond(raw, streams, self.encoded_reply(
            req, reply_id, prompts, streams, reply, per_token=params.per_token))

    def _task(self, task: str | None) -> str:
        """The pooling task of a request: ``task``, else the server's (``embed`` on an
        embedding server, ``token_classify`` on a token classifier, else ``classify``, which
        score servers run too).

        Raises:
            OpenAIError: 400 ``wrong_task`` (param ``model``) on a generating server, or
                (param ``task``) for a task the model does not run; 400 naming ``task`` for
                one kvflow does not implement here (``OTHER_TASKS``) or an unknown one.
        """
        pooler = self.engine.processor.pooler
        if pooler is None:  # every pooling engine task serves /pooling, not only embed
            served = [t for t in TASK_VERB if t != "generate"]
            raise OpenAIError(f"this server's model runs task={self.engine.task!r} "
                              f"({self.task_flags()}); "
                              f"/pooling needs a pooling model (--task "
                              f"{', '.join(served[:-1])} or {served[-1]}): use "
                              "/v1/completions or /v1/chat/completions", param="model",
                              code="wrong_task")
        if task in OTHER_TASKS:
            raise OpenAIError(f"task={task!r} is not supported on /pooling: "
                              f"{OTHER_TASKS[task]}", param="task", code="unsupported_value")
        if task is not None and task not in TASKS:
            raise OpenAIError(f"task={task!r} is not a pooling task: send one of "
                              f"{', '.join(TASKS)} (or leave it out)", param="task",
                              code="invalid_value")
        task = task or _DEFAULT_TASK.get(pooler.task, "classify")
        if task not in pooler.tasks:
            raise OpenAIError(f"this server's model runs task={pooler.task!r} "
                              f"({self.task_flags()}) and "
                              f"serves {', '.join(t for t in TASKS if t in pooler.tasks)} "
                              f"here, not {task!r}: leave task out for its "
                              f"{_RESULT.get(pooler.task, 'classes')}",
                              param="task", code="wrong_task")
        return task

    @staticmethod
    def _params(req: PoolingRequest, task: str) -> PoolingParams:
        """The requests' PoolingParams (``dimensions`` and ``normalize``: embeddings only,
        ``embed`` or ``token_embed``; ``activation`` / ``use_activation``: on ``classify``
        and ``token_classify`` false gives the raw logits, on the embedding tasks it is
        vLLM 0.32's name of ``normalize``; vLLM 0.10's ``softmax``, the same switch,
        ``token_classify`` only).

        Raises:
            OpenAIError: 400 naming ``dimensions`` or ``normalize`` set for ``classify`` or
                ``token_classify``, ``softmax`` set for another task than
                ``token_classify``, or two of these switches disagreeing.
        """
        embed = task in ("embed", "token_embed")
        for name in ("dimensions", "normalize"):
            if not embed and getattr(req, name) is not None:
                raise OpenAIError(f"{name} applies to embeddings (task embed or token_embed); "
                                  f"this request's task is {task!r}", param=name,
                                  code="invalid_value")
        if req.softmax is not None and task != "token_classify":
            raise OpenAIError(f"softmax (vLLM 0.10's reward-model field) applies to "
                              f"token_classify; this request's task is {task!r} (classify "
                              "takes activation, embeddings normalize)", param="softmax",
                              code="invalid_value")
        use_activation = request_activation(req)
        if req.softmax is not None and use_activation not in (None, req.softmax):
            raise OpenAIError(f"softmax={str(req.softmax).lower()} disagrees with "
                              f"activation / use_activation={str(use_activation).lower()} "
                              "(softmax is vLLM 0.10's name of use_activation: send one)",
                              param="softmax", code="invalid_value")
        if req.softmax is not None:
            use_activation = req.softmax
        if embed:
            check_normalize(req.normalize, use_activation,
                            "activation" if req.activation is not None else "use_activation")
        return PoolingParams(task=task, dimensions=req.dimensions, normalize=req.normalize,
                             use_activation=use_activation)
