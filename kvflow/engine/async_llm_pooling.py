"""The embedding request of :class:`kvflow.engine.async_llm.AsyncLLM`:
``add_pooling_request`` (the server's /v1/embeddings, /pooling and /score, the offline
``LLM.embed`` family). AsyncLLM's base class."""

from __future__ import annotations

import time

from kvflow.engine.request_args import check_request_args
from kvflow.engine.streams import RequestStream
from kvflow.pooling_params import PoolingParams


class AsyncLLMPooling:
    """``add_pooling_request`` of :class:`~kvflow.engine.async_llm.AsyncLLM`, which sets
    ``config`` and ``processor`` and gives ``_check_serving`` / ``_queue`` that it uses."""

    def add_pooling_request(self, request_id: str, prompt: str | None,
                            prompt_token_ids: list[int], params: PoolingParams | None = None,
                            client_id: str = "", priority: int = 0,
                            data_parallel_rank: int | None = None) -> RequestStream:
        """Validate and queue one embedding request; its stream ends with one
        ``EmbeddingRequestOutput``. ``client_id`` names the sender for the fair policy,
        ``priority`` its place under the priority policy (lower first),
        ``data_parallel_rank`` the replica it must run on (None: the balancer chooses).

        Raises:
            ValueError: on a generation model, for a bad prompt, ``params`` or
                ``dimensions``, a request id that is not a string, a ``priority`` that is not
                an integer or is nonzero under a policy that does not read it, or a
                ``data_parallel_rank`` that is not an integer or is outside the replicas.
            EngineDeadError: if no replica is running, or the pinned one is not.
        """
        check_request_args(request_id, priority, None, data_parallel_rank)
        if params is not None and not isinstance(params, PoolingParams):
            raise ValueError(
                f"params must be a PoolingParams or None, got {type(params).__name__}")
        self.config.scheduler_config.check_priority(priority)
        self._check_serving()
        arrival = time.monotonic()
        request = self.processor.make_pooling_request(request_id, prompt_token_ids, params,
                                                      arrival, client_id, priority)
        return self._queue(request_id, prompt, [request], arrival, data_parallel_rank)
