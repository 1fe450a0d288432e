"""Running a request's prompts in the engine once they are queued: waiting for admission
(aborting them all on any failure) and answering (a whole JSON body, an SSE stream, or a pooling
request's pooled vector). What every OpenAI handler does once its request is checked
(``serving_base.OpenAIServing`` calls these with its engine and its ``abort``, which also
cancels beam searches).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel

from kvflow.core.request_errors import (
    EXTRA_ARGS,
    LORA_REQUEST,
    MULTI_MODAL_DATA,
    PROMPT_EMBEDS,
)
from kvflow.engine.async_llm import (
    AdmissionRejected,
    AsyncLLM,
    EngineDeadError,
    RequestFailed,
    RequestRefused,
    RequestStream,
)
from kvflow.entrypoints.openai_errors import OpenAIError, engine_dead, invalid_request
from kvflow.entrypoints.protocol import ErrorResponse
from kvflow.entrypoints.streaming import SSE_DONE, run_unless_disconnected, sse

Abort = Callable[[Sequence[RequestStream]], None]  # ends the streams' requests (no-op if done)


async def admit_all(engine: AsyncLLM, add: Callable[[int], RequestStream], count: int,
                    abort: Abort, bad_input: Callable[[ValueError], OpenAIError] = invalid_request
                    ) -> list[RequestStream]:
    """Queue ``add(0) .. add(count - 1)``, then (with admission control) wait until the
    engine core accepted them all; on any failure ``abort`` every stream queued so far.

    Raises:
        OpenAIError: ``bad_input(e)`` (a 400) for a ValueError from the engine's
            validation; 503 if the engine is gone or admission control refused a prompt
            (with ``Retry-After``).
    """
    streams: list[RequestStream] = []
    try:
        for i in range(count):
            streams.append(add(i))
        for stream in streams:
            await engine.admitted(stream)
    except ValueError as e:
        abort(streams)
        raise bad_input(e) from None
    except EngineDeadError as e:
        abort(streams)
        raise engine_dead(e) from None
    except AdmissionRejected as e:
        abort(streams)
        raise OpenAIError(str(e), 503, "server_overloaded", code="ttft_unattainable",
                          headers={"Retry-After": str(int(e.retry_after_s))}) from None
    return streams


# The request field (OpenAI's name) holding each part of a request the core may refuse
# (``RequestRefused.field``); a refused grammar is named by the handler (``refused_param``).
_FIELD_PARAMS = {LORA_REQUEST: "model", MULTI_MODAL_DATA: "messages",
                 PROMPT_EMBEDS: "prompt_embeds", EXTRA_ARGS: "vllm_xargs"}


def refused(error: RequestRefused | RequestFailed, param: str | None) -> OpenAIError:
    """The 400 for a request the engine core refused, naming the request field at fault:
    the one that holds the part the core names (``error.field``: ``model`` for a LoRA
    adapter that could not be loaded, ``messages`` for images, ...), else ``param`` (the
    field that held a grammar that did not compile in time), unless the message names a
    field itself; a 429 (type ``rate_limit_exceeded``, code ``grammar_compiles_busy``, with
    ``Retry-After``) when the core was busy rather than the request bad
    (``error.retry_after_s`` set: grammar compiles saturated); a 500 (type
    ``InternalServerError``, code ``internal_error``, as vLLM answers a request that failed
    in its engine) for a ``RequestFailed``: the core's fault, not the request's."""
    if isinstance(error, RequestFailed):
        return OpenAIError(str(error), 500, "InternalServerError", code="internal_error")
    param = _FIELD_PARAMS.get(error.field, param)
    if error.retry_after_s is not None:
        return OpenAIError(str(error), 429, "rate_limit_exceeded", param=param,
                           code="grammar_compiles_busy",
                           headers={"Retry-After": str(max(1, round(error.retry_after_s)))})
    answer = invalid_request(error)
    if answer.param is None:
        answer.param = param
    return answer


async def respond(raw: Request, streams: Sequence[RequestStream],
                  work: Awaitable[BaseModel | Response], abort: Abort,
                  refused_param: str | None = None) -> Response:
    """Await the non-streaming response body (a model, sent as JSON, or a whole Response:
    /v1/embeddings' ``bytes``); ``abort`` the requests if the client leaves.

    Raises:
        OpenAIError: 503 if the engine dies meanwhile; 400 if the engine core refused a
            request (``RequestRefused``: e.g. its grammar did not compile in time), its
            ``param`` ``refused_param`` unless the core named the field; 429 if it refused
            it as busy; 500 if the core failed on it (``RequestFailed``): ``refused``.
    """
    try:
        result = await run_unless_disconnected(raw, work, lambda: abort(streams))
    except EngineDeadError as e:
        raise engine_dead(e) from None
    except (RequestRefused, RequestFailed) as e:
        raise refused(e, refused_param) from None
    finally:
        abort(streams)
    if result is None:  # the client is gone; nobody reads this
        return Response(status_code=499)
    if isinstance(result, Response):
        return result
    return Response(result.model_dump_json(), media_type="application/json")


async def stream(streams: Sequence[RequestStream], chunks: AsyncIterator[BaseModel],
                 abort: Abort, refused_param: str | None = None) -> AsyncIterator[str]:
    """SSE body: each chunk as ``data: {json}``, then ``data: [DONE]``; an engine failure
    or a refused request (``RequestRefused``, ``RequestFailed``) becomes an error event (the
    503's / 400's / 500's body, a 400's ``param`` as ``refused`` names it), then ``[DONE]``, as
    vLLM 0.32 streams an error. Always aborts the requests when it ends (client gone too)."""
    try:
        async for chunk in chunks:
            yield sse(chunk.model_dump_json())
    except (EngineDeadError, RequestRefused, RequestFailed) as e:
        error = engine_dead(e) if isinstance(e, EngineDeadError) else refused(e, refused_param)
        yield sse(ErrorResponse.model_validate(error.body()).model_dump_json())
    finally:
        abort(streams)
        if hasattr(chunks, "aclose"):
            await chunks.aclose()  # stops merge_streams' pump tasks now, not at GC
    yield SSE_DONE


async def pooled_vector(stream: RequestStream) -> list[float]:
    """A pooling request's result (its last output's ``embedding``: an embedding, a score or
    class probabilities), once the stream ends.

    Raises:
        OpenAIError: 503 if the stream ended without one (the engine dropped the request).
    """
    last = None
    async for out in stream:
        last = out
    vector = last.outputs.embedding if last is not None else []
    if not vector:
        raise OpenAIError("the engine dropped the request", 503, "service_unavailable")
    return vector
