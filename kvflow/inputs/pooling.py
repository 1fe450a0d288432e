"""The pooling half of :class:`kvflow.inputs.processor.InputProcessor` (its base class): an
embedding, classification or score prompt's token ids (as sentence-transformers would
tokenize the text), the task check, and the one pooling Request per prompt."""

from __future__ import annotations

import copy
from collections.abc import Mapping

from kvflow.inputs.prompts import PromptType, unpack_prompt
from kvflow.models.pooling_config import PoolerConfig, task_mismatch
from kvflow.pooling_params import PoolingParams
from kvflow.request import Request
from kvflow.sampling_params import SamplingParams


class PoolingInputs:
    """Pooling prompts and requests; ``InputProcessor`` sets ``pooler`` (None on a generation
    model), ``max_model_len`` and ``hidden_size`` and defines ``tokenize`` and ``validate``,
    which these use."""

    pooler: PoolerConfig | None

    def pooling_prompt(self, prompt: PromptType, task: str = "embed"
                       ) -> tuple[str | None, list[int]]:
        """(prompt text or None, token ids) of a pooling prompt of ``task``; text is
        tokenized as ``pooling_text`` prepares it.

        Raises:
            ValueError: on an engine not running ``task``, for a malformed prompt, or one with
                images or videos (``multi_modal_data``): embeddings are computed from text or
                token ids only; or with a ``cache_salt`` (generation prompts only).
        """
        self.require_task(task)
        if isinstance(prompt, Mapping):
            if prompt.get("cache_salt") is not None:
                raise ValueError("cache_salt: only generation prompts take a prefix-cache "
                                 "salt")
            prompt, images, videos = unpack_prompt(prompt)
            if images or videos:
                raise ValueError("multi_modal_data: embedding prompts are text or token ids "
                                 "only; images and videos are not embedded")
        if not isinstance(prompt, str):
            return self.tokenize(prompt)
        return prompt, self.tokenize(self.pooling_text(prompt))[1]

    def require_task(self, task: str = "embed") -> None:
        """Raises ValueError (what the engine runs, what to use) on an engine that does not
        serve ``task`` ("embed", "score" or "classify"; ``PoolerConfig.tasks``): a generation
        model, or another pooling task."""
        if self.pooler is None and task == "embed":
            raise ValueError("this model generates text: embeddings need a model served with "
                             "task='embed' (--task embed), or vLLM 0.32's runner='pooling' "
                             "convert='embed' (--runner pooling --convert embed), which "
                             "also turn a text generation model into an embedding model")
        if self.pooler is None:
            raise ValueError(task_mismatch("generate", task))
        if task not in self.pooler.tasks:
            raise ValueError(task_mismatch(self.pooler.task, task, self.pooler.num_labels))

    def pooling_text(self, text: str) -> str:
        """An embedding input as the model tokenizes it (sentence-transformers' rules): after
        the model's default prompt, lower-cased when its config says ``do_lower_case``."""
        if self.pooler is None:
            return text
        text = self.pooler.prompt + text
        return text.lower() if self.pooler.lowercase else text

    def make_pooling_request(self, request_id: str, token_ids: list[int],
                             params: PoolingParams | None = None,
                             arrival_time: float | None = None,
                             client_id: str = "", priority: int = 0) -> Request:
        """An embedding request (prompt computed and pooled, nothing generated; an embed or
        token_embed request without ``dimensions`` takes ``--pooler-config``'s);
        ``client_id`` names the sender for the fair policy ("" when unknown) and
        ``priority`` its place under the priority policy (lower first), as for
        ``make_requests``.

        Raises:
            ValueError: on a generation model, for a bad prompt (see ``validate``; image
                and video placeholders included), a ``dimensions`` the model cannot give
                (Matryoshka support, sizes), ``softmax`` on another task than
                token_classify, or ``extra_kwargs`` (``LLM.score`` reads and drops them).
        """
        params = params or PoolingParams()
        if params.extra_kwargs:
            raise ValueError(f"PoolingParams.extra_kwargs={params.extra_kwargs!r}: only "
                             "LLM.score reads it (max_tokens_per_query, max_tokens_per_doc, "
                             "chat_template_kwargs)")
        self.require_task(params.task)
        check_activation(params)
        self.validate(token_ids, pooling=True)
        if self.mm_processor is not None:
            if self.mm_processor.image_token_id in token_ids:
                raise ValueError(f"the prompt holds the image placeholder token "
                                 f"({self.mm_processor.placeholder!r}): embedding prompts "
                                 "are text only; images are not embedded")
            self.mm_processor.check_no_video(token_ids)
        if params.dimensions is None and self.pooler.dimensions is not None and \
                params.task in ("embed", "token_embed"):  # --pooler-config's default
            params = copy.copy(params)
            params.dimensions = self.pooler.dimensions
        self.pooler.check_dimensions(params.dimensions, self.hidden_size)
        return Request(request_id, token_ids, SamplingParams(max_tokens=1), None, arrival_time,
                       priority, pooling_params=params, client_id=client_id)


def check_activation(params: PoolingParams) -> None:
    """Refuse vLLM 0.10's ``softmax`` (its reward models' per-token ``encode`` task) on a
    task other than token_classify. (``activation`` / ``use_activation`` is taken on every
    task: the head's activation on classify, score and token_classify, the L2
    normalization on embed and token_embed, as vLLM 0.32 reads it.)

    Raises:
        ValueError: naming ``softmax`` for a request of another task that sets it.
    """
    if params.softmax is not None and params.task != "token_classify":
        raise ValueError(f"softmax (vLLM 0.10's reward-model field) applies to "
                         f"token_classify, not task={params.task!r} (classify and score "
                         "take activation, embeddings normalize or use_activation)")
