"""``LLM``'s queue without waiting (vLLM's ``enqueue`` / ``enqueue_chat`` /
``wait_for_completion``), its ``get_default_sampling_params``, and the engine stepping every
offline call shares (which keeps the outputs of enqueued requests that finish during another
call, and feeds ``get_metrics``), mixed into :class:`kvflow.offline.llm.LLM`."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tqdm.auto import tqdm

from kvflow.engine.llm_engine import LLMEngine
from kvflow.engine.streams import RequestFailed, RequestRefused
from kvflow.inputs.prompts import PromptType
from kvflow.lora.request import LoRARequest
from kvflow.offline.stats import OfflineStats
from kvflow.outputs import RequestOutput
from kvflow.runtime.gc_heap import caller_heap_frozen
from kvflow.sampling_params import SamplingParams


@dataclass
class EnqueuedRequests:
    """The requests ``enqueue`` queued and ``wait_for_completion`` has not returned yet.

    Attributes:
        ids: their request ids, in the order queued.
        finished: the finished output of each that ended (during any call's steps).
        prompts: the rendered chat text of an ``enqueue_chat`` request, set as its output's
            ``prompt`` (``chat``'s rule).
        refused: why the engine core refused a request (during any call's steps), by id.
        failed: the error of a failed engine step that took a request with it (during
            another call's steps: that call raised it), by id.
    """

    ids: list[str] = field(default_factory=list)
    finished: dict[str, Any] = field(default_factory=dict)
    prompts: dict[str, str] = field(default_factory=dict)
    refused: dict[str, str] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)


class LLMQueue:
    """The queue methods of :class:`kvflow.offline.llm.LLM` (a mixin: ``LLM`` sets ``engine``,
    ``_enqueued`` and ``_stats``, and defines ``_add_generate_requests`` and
    ``_render_chat``)."""

    engine: LLMEngine
    _enqueued: EnqueuedRequests
    _stats: OfflineStats | None
    _add_generate_requests: Callable[..., list[str]]
    _render_chat: Callable[..., tuple[list[str], list[Any]]]

    def get_default_sampling_params(self) -> SamplingParams:
        """The SamplingParams a request without its own gets (vLLM's): the model's
        ``generation_config.json`` sampling fields (``temperature``, ``top_p``, ``top_k``,
        ``min_p``, ``repetition_penalty``, ``presence_penalty``, ``frequency_penalty``,
        ``max_new_tokens`` as ``max_tokens``) with ``override_generation_config`` over them,
        the rest kvflow's defaults; ``SamplingParams()`` with ``generation_config="none"``
        or a model without the file. A fresh object each call."""
        return SamplingParams(**self.engine.sampling_defaults)

    def enqueue(self, prompts: PromptType | Sequence[PromptType],
                sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
                priority: int | Sequence[int] | None = None,
                use_tqdm: bool | Callable[..., Any] = True,
                tokenization_kwargs: dict[str, Any] | None = None,
                mm_processor_kwargs: dict[str, Any] | None = None, *,
                user: Sequence[str] | None = None) -> list[str]:
        """Queue prompts for generation without running them (vLLM's ``LLM.enqueue``; its
        argument order): their request ids, in order. :meth:`wait_for_completion` runs them
        and returns their outputs; a ``generate`` (or other call) in between runs them too,
        and keeps their outputs for it.

        Args:
            prompts, sampling_params, lora_request, priority, tokenization_kwargs,
                mm_processor_kwargs: as ``generate`` takes them (None: each request takes
                :meth:`get_default_sampling_params`).
            use_tqdm: vLLM's (a bar while its renderer adds requests); kvflow queues at once
                and shows none.
            user: ``generate``'s (a kvflow extension, keyword-only).

        Raises:
            ValueError: what ``generate`` refuses before running (nothing is queued then).
        """
        del use_tqdm  # queuing is one fast pass: no bar
        ids = self._add_generate_requests(prompts, sampling_params, priority, user,
                                          lora_request, tokenization_kwargs,
                                          mm_processor_kwargs)
        self._enqueued.ids += ids
        return ids

    def enqueue_chat(self, messages: list[dict] | list[list[dict]],
                     sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                     use_tqdm: bool | Callable[..., Any] = True,
                     lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
                     *, priority: int | Sequence[int] | None = None,
                     **chat_options: Any) -> list[str]:
        """Render conversations as ``chat`` does and queue them without running them (vLLM's
        ``LLM.enqueue_chat``): their request ids, in order; :meth:`wait_for_completion`
        returns their outputs, each with its rendered text as ``prompt``.

        Args:
            messages, sampling_params, lora_request, priority: as ``chat`` takes them.
            use_tqdm: vLLM's (a bar while rendering); kvflow shows none.
            **chat_options: ``chat``'s keyword arguments (``chat_template``,
                ``chat_template_content_format``, ``add_generation_prompt``,
                ``continue_final_message``, ``tools``, ``chat_template_kwargs``,
                ``documents``, ``tokenization_kwargs``, ``mm_processor_kwargs``).

        Raises:
            ValueError: what ``chat`` refuses before running (nothing is queued then);
                ``TypeError`` for a keyword ``chat`` does not take.
        """
        del use_tqdm
        mm_processor_kwargs = chat_options.pop("mm_processor_kwargs", None)
        texts, token_prompts = self._render_chat(messages, **chat_options)
        ids = self._add_generate_requests(token_prompts, sampling_params, priority, None,
                                          lora_request, None, mm_processor_kwargs)
        self._enqueued.ids += ids
        self._enqueued.prompts.update(zip(ids, texts))
        return ids

    def wait_for_completion(self, output_type: type | tuple[type, ...] | None = None, *,
                            use_tqdm: bool | Callable[..., Any] = True) -> list[Any]:
        """Run every enqueued request to its end (vLLM's ``LLM.wait_for_completion``): their
        finished outputs, in request-id order (the order queued), those that finished
        during another call included; ``[]`` when none is enqueued. The queue is empty
        after it.

        Args:
            output_type: the class (or tuple of classes) every output must be; None:
                ``RequestOutput``.
            use_tqdm: a progress bar over the requests still running (a callable is a tqdm
                factory, as for ``generate``).

        Raises:
            ValueError: an ``output_type`` that is not a class or a tuple of classes
                (before anything runs: the queue stays as it was); an output that is not an
                ``output_type`` (naming both);
                ``RequestRefused`` (a ValueError) ``"request <id>: <why>"`` when the engine
                core could not run one, now or while another call stepped (as ``generate``
                raises ``"prompt <i>: <why>"``): every enqueued request is aborted then, its
                output dropped, and the queue emptied.
            RequestFailed: (a RuntimeError) ``"request <id>: ..."`` naming the error, when
                an engine step that failed during another call (which raised that error)
                took an enqueued request with it; the queue is emptied as above.
            Exception: whatever a step of this call raised (every enqueued request is
                aborted and the queue emptied).
        """
        _check_output_type(output_type)
        queue, self._enqueued = self._enqueued, EnqueuedRequests()
        waiting = [rid for rid in queue.ids if rid not in queue.finished]
        bar = _progress_bar(use_tqdm if len(waiting) > 1 else False, len(waiting),
                            "Processed prompts")
        try:
            with caller_heap_frozen(), contextlib.closing(bar):
                while not (queue.refused or queue.failed) and \
                        self.engine.has_unfinished_requests():
                    for out in self._step(queue):
                        if out.finished and out.request_id in waiting:
                            bar.update(1)
        except BaseException:
            for rid in queue.ids:
                self._abort(rid)
            raise
        if queue.refused or queue.failed:  # during another call: as generate, drop the rest
            for rid in queue.ids:
                self._abort(rid)
            if queue.refused:
                rid, why = next(iter(queue.refused.items()))
                raise RequestRefused(f"request {rid}: {why}", rid)
            rid, why = next(iter(queue.failed.items()))
            raise RequestFailed(f"request {rid}: an engine step failed while it ran (during "
                                f"another call): {why}", rid)
        return _checked(queue, output_type or RequestOutput)

    def _run(self, request_ids: list[str], use_tqdm: bool | Callable[..., Any],
             on_output: Callable[[int, Any], None] | None = None) -> list[Any]:
        """Step the engine until it has no unfinished request; the last outputs of
        ``request_ids``, in order (those of enqueued requests that finish meanwhile are kept
        for :meth:`wait_for_completion`; ``on_output`` sees only ``request_ids``'). A progress
        bar when ``use_tqdm`` and more than one request: ``use_tqdm`` itself where it is a
        callable (vLLM's: a tqdm-like factory, e.g. ``functools.partial(tqdm, leave=False)``,
        called with ``total`` and ``desc``; its bar needs ``update`` and ``close``), else
        tqdm's."""
        finished: dict[str, Any] = {}
        index = {rid: i for i, rid in enumerate(request_ids)}
        try:  # no full collection of the caller's heap between steps (kvflow/runtime/gc_heap.py)
            bar = _progress_bar(use_tqdm if len(request_ids) > 1 else False,
                                len(request_ids), "Processed prompts")
            with caller_heap_frozen(), contextlib.closing(bar):
                while self.engine.has_unfinished_requests():
                    for out in self._step():
                        if out.request_id not in index:  # an enqueued request's
                            continue
                        if on_output is not None:
                            on_output(index[out.request_id], out)
                        if out.finished:
                            finished[out.request_id] = out
                            bar.update(1)
        except BaseException as e:
            # Leave the engine usable: drop this call's requests and free their KV blocks.
            for rid in request_ids:
                self._abort(rid)
            if isinstance(e, RequestRefused) and e.request_id in index:
                i = index[e.request_id]  # name the prompt, as the checks before queuing do
                raise RequestRefused(f"prompt {i}: {e}", e.request_id) from None
            raise
        return [finished[rid] for rid in request_ids]

    def _step(self, queue: EnqueuedRequests | None = None) -> list[Any]:
        """One engine step: its outputs (every request's that changed), after feeding them
        to ``get_metrics`` and keeping the finished ones of enqueued requests (in ``queue``,
        or the LLM's queue). An enqueued request the core refuses is recorded in the queue
        (``wait_for_completion`` raises it), so the call stepping goes on.

        Raises:
            RequestRefused: see ``LLMEngine.step``, for a request not in the queue.
        """
        queue = queue if queue is not None else self._enqueued
        try:
            outputs, refused = self.engine.step(), {}
        except RequestRefused as e:  # the step's other outputs are kept on the error
            outputs, refused = getattr(e, "outputs", []), getattr(e, "refused", {})
            refused = refused or {e.request_id: str(e)}
        except BaseException:  # the engine forgot what the failed step took with it
            for rid, why in self.engine.lost.items():
                if rid in queue.ids:  # raised by wait_for_completion
                    queue.failed.setdefault(rid, why)
            raise
        for out in outputs:
            if self._stats is not None:
                self._stats.observe(out)
            if out.finished and out.request_id in queue.ids:
                queue.finished[out.request_id] = out
        others = [(rid, why) for rid, why in refused.items() if rid not in queue.ids]
        for rid, why in refused.items():
            if rid in queue.ids:  # raised by wait_for_completion, whichever call stepped
                queue.refused.setdefault(rid, why)
        if others:
            raise RequestRefused(others[0][1], others[0][0])
        return outputs

    def _abort(self, request_id: str) -> None:
        """Abort one request (a no-op once it finished) and count it in the metrics."""
        self.engine.abort_request(request_id)
        if self._stats is not None:
            self._stats.aborted(request_id)


def _check_output_type(output_type: Any) -> None:
    """Raises ValueError naming ``output_type`` unless it is None, a class or a tuple of
    classes (what ``isinstance`` takes)."""
    types = output_type if isinstance(output_type, tuple) else (output_type,)
    if output_type is not None and (not types or not all(isinstance(t, type) for t in types)):
        raise ValueError(f"wait_for_completion(output_type={output_type!r}) must be a class "
                         "(e.g. RequestOutput), a tuple of classes, or None")


def _checked(queue: EnqueuedRequests, output_type: type | tuple[type, ...]) -> list[Any]:
    """The finished outputs of ``queue``, in request-id order, each an ``output_type``; an
    ``enqueue_chat`` request's with its rendered text as ``prompt``.

    Raises:
        ValueError: for an output of another class.
    """
    outputs = [queue.finished[rid] for rid in sorted(queue.ids, key=int)
               if rid in queue.finished]
    for out in outputs:
        if not isinstance(out, output_type):
            raise ValueError(f"wait_for_completion(output_type={output_type!r}): request "  # noqa: TRY004
                             f"{out.request_id}'s output is a {type(out).__name__}")
        if out.request_id in queue.prompts:
            out.prompt = queue.prompts[out.request_id]
    return outputs


def _progress_bar(use_tqdm: bool | Callable[..., Any], total: int, desc: str) -> Any:
    """A progress bar over ``total`` items: ``use_tqdm`` itself where it is a callable
    (vLLM's tqdm-like factory, called with ``total`` and ``desc``; its bar needs ``update``
    and ``close``), else tqdm's, hidden when ``use_tqdm`` is false."""
    factory = use_tqdm if callable(use_tqdm) else functools.partial(tqdm, disable=not use_tqdm)
    return factory(total=total, desc=desc)
