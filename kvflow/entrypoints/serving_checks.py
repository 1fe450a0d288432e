"""The request checks every OpenAI handler shares (the model and task it names, admission,
prompt length, ``n``, logprobs, stream options, fields kvflow does not do, priority):
:class:`OpenAIServingChecks`, the base class of
:class:`kvflow.entrypoints.serving_base.OpenAIServing`."""

from __future__ import annotations

import logging

from kvflow.beam_search import check_logprobs_mode
from kvflow.entrypoints.beam_requests import check_beam_request
from kvflow.entrypoints.openai_errors import OpenAIError, engine_dead
from kvflow.entrypoints.protocol import PromptTokenUsageInfo, SamplingRequest, UsageInfo
from kvflow.entrypoints.serving_models import ModelNotFound
from kvflow.lora.request import LoRANameError, LoRARequest

logger = logging.getLogger(__name__)

# The flags that start a server for an endpoint's task, for the wrong_task refusal: vLLM
# 0.32's --runner / --convert first (what a vLLM command line has), then kvflow's --task.
_SERVE_FOR = {
    "embed": "--runner pooling --convert embed (or --task embed)",
    "classify": "--runner pooling --convert classify (or --task classify)",
    "score": "--task score (a cross-encoder) or --runner pooling --convert embed (an "
             "embedding model, cosine similarity)",
    "generate": "--runner generate (or --task generate)",
}


class OpenAIServingChecks:
    """Checks raising ``OpenAIError`` (4xx) before anything is queued; ``OpenAIServing`` sets
    ``engine``, ``config``, ``model_name`` and ``models``, which they read."""

    # ---- checks ------------------------------------------------------------------------------
    def check_model(self, model: str | None) -> LoRARequest | None:
        """The LoRA adapter ``model`` names, None for the base model.

        Raises:
            OpenAIError: 400 for a name no model can have (empty, whitespace only, a control
                character); 404 if the request names a model or adapter this server does not
                serve.
        """
        try:
            return self.models.resolve(model)
        except LoRANameError as e:
            raise OpenAIError(str(e), param="model", code="invalid_value") from None
        except ModelNotFound as e:
            raise OpenAIError(str(e), 404, "invalid_request_error", "model",
                              "model_not_found") from None

    def response_model(self, model: str | None) -> str:
        """The ``model`` a response names: the adapter's name when the request picked a LoRA
        adapter (as vLLM and the OpenAI API echo the requested model), else the served
        model's name. ``model`` was checked by ``check_model`` on entry."""
        return model or self.model_name

    def serves(self, task: str) -> bool:
        """Whether the served model does ``task`` (what ``check_task`` refuses otherwise)."""
        pooler = self.engine.processor.pooler
        return task in ((self.engine.task,) if pooler is None else pooler.tasks)

    def task_flags(self) -> str:
        """The flags that chose the served model's task, as its refusals name them
        (``ModelConfig.task_flags``: ``--task``, or vLLM's ``--runner`` / ``--convert``)."""
        return self.engine.config.model_config.task_flags

    def check_task(self, task: str) -> None:
        """Refuse an endpoint the served model does not do (text on an embedding model,
        embeddings on a text model, scores on either, scores on a classify server whose
        classifier has several labels, ...). A sequence classifier serves both head tasks
        where it can (``PoolerConfig.tasks``).

        Raises:
            OpenAIError: 400 (param ``model``, code ``wrong_task``) when the engine does not
                serve ``task``.
        """
        if self.serves(task):
            return
        pooler = self.engine.processor.pooler
        flags = self.task_flags()
        if self.engine.task == "classify" and task == "score":
            labels = pooler.num_labels
            raise OpenAIError(f"this server's model runs task='classify' ({flags}) with "
                              f"num_labels={labels}: /v1/score and /v1/rerank need a "
                              "one-label classifier (num_labels == 1, a relevance logit); "
                              f"serve it with --task score for its {labels} values per pair, "
                              "or use /v1/classify", param="model", code="wrong_task")
        use = {"embed": "/v1/embeddings, /v1/score or /v1/rerank",
               "score": "/v1/score, /v1/rerank or /v1/classify",
               "classify": "/v1/classify",
               "token_classify": "/pooling with task token_classify"}.get(
            self.engine.task, "/v1/completions or /v1/chat/completions")
        serve = _SERVE_FOR.get(task)
        how = f", or start a server with {serve}" if serve else ""
        raise OpenAIError(f"this server's model runs task={self.engine.task!r} ({flags}); "
                          f"this endpoint needs task={task!r}: use {use}{how}", param="model",
                          code="wrong_task")

    def check_admission(self, num_requests: int, param: str = "prompt", n: int = 1) -> None:
        """Raises OpenAIError 503 (with Retry-After) when too many requests wait already, or
        when ``num_requests`` prompts of ``n`` samples each would take the sequences in
        flight past ``--max-num-queued-reqs`` (both counted on /metrics as
        ``kvflow:requests_overloaded``, the latter also as vLLM's
        ``kvflow:admission_rejections{reason="max_num_queued_reqs"}``), or 400 naming ``param`` (or ``n``) when the request
        alone has more prompts than ``--max-waiting-requests`` or more sequences than
        ``--max-num-queued-reqs`` (no retry would ever be admitted)."""
        limit = self.config.max_waiting_requests
        if not self.engine.is_healthy:
            raise engine_dead(self.engine.dead_error
                              or RuntimeError("the engine core process is gone"))
        self._check_fits_in_flight(num_requests, param, n)
        self._check_in_flight(num_requests * n)
        if limit is not None and num_requests > limit:
            raise OpenAIError(f"the request has {num_requests} prompts; this server admits "
                              f"at most {limit} waiting requests (--max-waiting-requests): "
                              f"send at most {limit} per request", param=param,
                              code="too_many_prompts")
        if limit is not None and self.engine.num_waiting_requests + num_requests > limit:
            self.engine.metrics.overloaded.inc()
            raise OpenAIError(f"the server is overloaded: {self.engine.num_waiting_requests} "
                              f"requests are waiting (limit {limit}); retry later", 503,
                              "server_overloaded", code="server_overloaded",
                              headers={"Retry-After": "1"})

    def _check_fits_in_flight(self, num_requests: int, param: str, n: int) -> None:
        """400 when the request alone has more sequences (``num_requests`` prompts of ``n``
        samples each) than ``--max-num-queued-reqs``: it could never be admitted, so the
        503 + Retry-After of ``_check_in_flight`` would have a client retry forever. Names
        ``n`` (``integer_above_max_value``) when it is above 1, else ``param`` (the prompt
        or input field, ``too_many_prompts``). vLLM 0.32 answers this case with its 503."""
        limit = self.config.max_num_queued_reqs
        if limit is None or num_requests * n <= limit:
            return
        if n > 1:
            raise OpenAIError(f"the request asks for {num_requests * n} sequences "
                              f"({num_requests} prompt(s) with n={n}); this server keeps at "
                              f"most {limit} in flight (--max-num-queued-reqs): send fewer "
                              "(a smaller n)", param="n", code="integer_above_max_value")
        raise OpenAIError(f"the request has {num_requests} prompts; this server keeps at most "
                          f"{limit} sequences in flight (--max-num-queued-reqs): send at most "
                          f"{limit} per request", param=param, code="too_many_prompts")

    def _check_in_flight(self, slots: int) -> None:
        """vLLM's ``--max-num-queued-reqs``: a 503 (Retry-After 1) when the sequences in
        flight (waiting or running; ``n`` per request) plus ``slots`` exceed it, as vLLM's
        ``AsyncLLM.check_admission`` counts them."""
        limit = self.config.max_num_queued_reqs
        in_flight = self.engine.num_open_sequences if limit is not None else 0
        if limit is not None and in_flight + slots > limit:
            self.engine.metrics.record_admission_rejection("max_num_queued_reqs")
            raise OpenAIError(f"the server is overloaded: sequences in flight: {in_flight}, "
                              f"this request's: {slots} (limit {limit}, "
                              "--max-num-queued-reqs); retry later", 503,
                              "server_overloaded", code="server_overloaded",
                              headers={"Retry-After": "1"})

    def check_prompt(self, token_ids: list[int], max_tokens: int, param: str,
                     min_tokens: int = 0) -> int:
        """The request's ``max_tokens`` as the context leaves it: at most ``max_model_len``
        minus the prompt's tokens (vLLM 0.32's ``get_max_tokens`` clamp: the sample then ends
        with finish_reason ``length`` when the context is full). ``min_tokens`` must fit in
        what is left, as vLLM's SamplingParams checks it against the clamped ``max_tokens``.

        Raises:
            OpenAIError: 400 naming ``param`` for an empty prompt (code ``empty_array``), an
                out-of-vocabulary token id (``invalid_value``) or a prompt that leaves no
                room for a generated token (``context_length_exceeded``); naming
                ``min_tokens`` (``invalid_value``) when it is above the tokens the context
                leaves. A ``max_tokens`` above ``max_model_len`` is refused before, by
                ``check_max_tokens``.
        """
        try:
            self.engine.processor.validate(token_ids)
        except ValueError as e:
            raise OpenAIError(str(e), param=param, code=prompt_error_code(str(e))) from None
        limit = self.engine.max_model_len
        left = limit - len(token_ids)
        if min_tokens > left:
            raise OpenAIError(f"min_tokens={min_tokens} is more than the {left} tokens this "
                              f"model's context of {limit} leaves after the prompt's "
                              f"{len(token_ids)}: ask for fewer", param="min_tokens",
                              code="invalid_value")
        return min(max_tokens, left)

    def check_n(self, n: int) -> None:
        """Refuse more samples per request than the server allows.

        Raises:
            OpenAIError: 400 (param ``n``, code ``integer_above_max_value`` as OpenAI's for
                its own cap) if ``n`` is above ``--max-n``.
        """
        if n > self.config.max_n:
            raise OpenAIError(f"n={n} is above this server's limit of {self.config.max_n} "
                              "(--max-n)", param="n", code="integer_above_max_value")

    def check_num_logprobs(self, value: int | None, param: str) -> None:
        """Refuse more logprobs per token than the server allows; ``param`` names the field.

        Raises:
            OpenAIError: 400 (naming ``param``, code ``integer_above_max_value``) if ``value``
                is above ``--max-logprobs``.
        """
        if value is not None and value > self.config.max_logprobs:
            raise OpenAIError(f"{param}={value} is above this server's limit of "
                              f"{self.config.max_logprobs} (--max-logprobs)", param=param,
                              code="integer_above_max_value")

    @staticmethod
    def check_stream_options(req: SamplingRequest) -> None:
        """``stream_options`` only makes sense on a streamed request, and kvflow adds no
        obfuscation to its chunks (``include_obfuscation`` false, as /v1/responses takes it).

        Raises:
            OpenAIError: 400 (param ``stream_options``) if it is set while ``stream`` is
                false; 400 (param ``stream_options.include_obfuscation``, code
                ``unsupported_parameter``) if that is true.
        """
        if req.stream_options is not None and not req.stream:
            raise OpenAIError("stream_options is only allowed when stream is true",
                              param="stream_options", code="invalid_value")
        if req.stream_options is not None and req.stream_options.include_obfuscation:
            param = "stream_options.include_obfuscation"
            raise OpenAIError(f"{param} is not supported (kvflow adds no obfuscation to "
                              "stream chunks; send include_obfuscation false)", param=param,
                              code="unsupported_parameter")

    def stream_usage(self, req: SamplingRequest) -> tuple[bool, bool]:
        """What a stream reports of its usage: (a last chunk with the request's usage,
        ``include_usage``, always under ``--enable-force-include-usage``; every chunk with
        the usage so far, ``continuous_usage_stats``)."""
        force = self.config.enable_force_include_usage
        options = req.stream_options
        if options is None:
            return force, False
        return options.include_usage or force, options.continuous_usage_stats

    def usage(self, num_prompt: int, num_generated: int, num_cached: int) -> UsageInfo:
        """A reply's ``usage`` (``usage_info``), with the prompt tokens' details under
        ``--enable-prompt-tokens-details``."""
        return usage_info(num_prompt, num_generated, num_cached,
                          self.config.enable_prompt_tokens_details)

    def check_unsupported(self, req: SamplingRequest) -> None:
        """Raises OpenAIError 400 naming a field set to something kvflow does not do:
        ``best_of`` other than ``n``, a field ``use_beam_search`` would not honour (or
        ``length_penalty`` without it: ``beam_requests.check_beam_request``), beam search on
        an engine whose ``--logprobs-mode`` reports logits, a ``priority``
        while the scheduler is not run by priority (it would be ignored), or vLLM's
        ``kv_transfer_params`` on a server without ``--kv-transfer-config`` (no connector
        would load or store the prompt's KV: a proxy's prefill and decode would each compute
        it). The code is
        ``unsupported_parameter`` for a field this endpoint never takes, else
        ``unsupported_value`` (OpenAI's codes for the two). Undeclared fields were checked
        first (``check_fields``)."""
        if req.best_of is not None and req.best_of != req.n:
            raise OpenAIError(f"best_of={req.best_of} is not supported: kvflow returns every "
                              "sample it generates (send n, or best_of equal to n)",
                              param="best_of", code="unsupported_value")
        if check_beam_request(req):
            try:
                check_logprobs_mode(self.engine.config.model_config.logprobs_mode)
            except ValueError as e:
                raise OpenAIError(str(e), param="use_beam_search",
                                  code="unsupported_value") from None
        if req.kv_transfer_params is not None and self.engine.config.kv_transfer_config is None:
            raise OpenAIError("kv_transfer_params is for disaggregated prefill, and this "
                              "server runs no KV connector (start it with "
                              "--kv-transfer-config), so the prompt's KV would be neither "
                              "stored nor loaded: leave it out", param="kv_transfer_params",
                              code="unsupported_parameter")
        self.check_priority(req.priority)

    def check_priority(self, priority: int) -> None:
        """A request's ``priority`` orders only the priority (and fair) policy's queue.

        Raises:
            OpenAIError: 400 (param ``priority``, code ``unsupported_value``) for a nonzero
                priority while the scheduler is not run by priority (it would be ignored).
        """
        if not priority:  # the default: every policy takes it
            return
        try:  # the scheduler's rule (SchedulerConfig.check_priority), answered as a 400
            self.engine.config.scheduler_config.check_priority(priority)
        except ValueError as e:
            raise OpenAIError(f"{e}: start the server with --policy priority or fair",
                              param="priority", code="unsupported_value") from None


def usage_info(num_prompt: int, num_generated: int, num_cached: int,
               details: bool) -> UsageInfo:
    """A reply's ``usage`` (counts in tokens): ``num_cached`` of the ``num_prompt`` prompt
    tokens were prefix-cache hits, reported as ``prompt_tokens_details.cached_tokens`` when
    ``details`` (``--enable-prompt-tokens-details``), 0 included as OpenAI reports it (vLLM
    leaves the details out when nothing was cached); without, the usage has no
    ``prompt_tokens_details`` key at all."""
    return UsageInfo(prompt_tokens=num_prompt, completion_tokens=num_generated,
                     total_tokens=num_prompt + num_generated,
                     prompt_tokens_details=PromptTokenUsageInfo(cached_tokens=num_cached)
                     if details else None)


def check_token_ids(token_ids: list[int], vocab_size: int, param: str) -> None:
    """Refuse a token id a client sent outside ``[0, vocab_size)``, naming its place:
    ``param`` is the list's path (``prompt``, ``prompt.1``, ``tokens``) and the error's
    ``param`` is ``{param}.{index}`` of the first bad id, as the schema's own errors and the
    chat content parts name a list's element (``messages.0.content.1``).

    Raises:
        OpenAIError: 400, code ``invalid_value``.
    """
    if not token_ids or (min(token_ids) >= 0 and max(token_ids) < vocab_size):
        return  # the C-speed check first; then the first bad id's index
    i = next(i for i, t in enumerate(token_ids) if not 0 <= t < vocab_size)
    raise OpenAIError(f"{param}.{i}: token id {token_ids[i]} is outside the vocabulary "
                      f"[0, {vocab_size})", param=f"{param}.{i}", code="invalid_value")


def prompt_error_code(message: str) -> str:
    """The code of a prompt the engine's ``validate`` refused (by its message)."""
    if "max_model_len" in message:
        return "context_length_exceeded"
    return "empty_array" if "empty" in message else "invalid_value"
