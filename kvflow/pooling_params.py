"""What a pooling request (an embedding, a pair's score, a text's classes, or one of them per
prompt token) asks for beyond its prompt (pure data, crosses to the runner)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvflow.utils.close_names import guess_unknown_keywords

POOLING_TASKS = ("embed", "score", "classify", "token_embed", "token_classify")
# vLLM's per-token tasks: one row per prompt token instead of one vector per prompt
TOKEN_TASKS = ("token_embed", "token_classify")
_EMBED_TASKS = ("embed", "token_embed")  # the tasks that take ``dimensions`` / ``normalize``


@guess_unknown_keywords
@dataclass
class PoolingParams:
    """Options of one pooling request.

    Attributes:
        dimensions: keep the first ``dimensions`` values of the pooled vector (Matryoshka
            representation learning, Kusupati et al. 2022), normalized again when the vector
            is normalized (``normalize``); None: the whole vector. Only for models that
            declare Matryoshka support (checked by the engine against the model); with
            ``token_embed`` each token's row is cut.
        normalize: L2-normalize the embedding (after any ``dimensions`` cut): True or False
            (vLLM's field; False gives the raw pooled vector, float32); None: as the model's
            pooling config says (its sentence-transformers ``Normalize`` module). Embeddings
            (``task`` "embed", or "token_embed": each token's row on its own) only.
        task: "embed" (a vector, ``LLM.embed``), "score" (a cross-encoder's pair, set by
            ``LLM.score`` and the score routes), "classify" (class probabilities,
            ``LLM.classify`` and /classify), or vLLM's per-token tasks "token_embed" (every
            prompt token's final hidden state, [num_prompt_tokens, hidden]) and
            "token_classify" (a token classifier's class probabilities per token,
            [num_prompt_tokens, num_labels]); the engine refuses a task it does not run.
        second_segment_start: for a scored pair whose tokenizer gives token types (BERT),
            the index in tokens of the pair's second segment (token type 1 from there on);
            None: one segment (type 0 throughout); 0: type 1 throughout (a pair cut on
            the left inside its second segment). Set by the score paths, not by users.
        use_activation: whether a head task's values ("score", "classify",
            "token_classify") go through the task's activation (softmax / sigmoid):
            False gives the head's raw logits (float32), True or None the activation (vLLM
            0.11.1's field). On the embedding tasks it is vLLM 0.32's name of ``normalize``
            (the embedding's activation is its L2 normalization); ``normalize`` wins when
            both are set, and they must agree.
        activation: vLLM 0.10 / 0.11.0's name of ``use_activation`` (either may be given;
            after construction both hold the resolved value).
        extra_kwargs: vLLM 0.32's field, read by ``LLM.score`` only (then dropped): its
            ``max_tokens_per_query`` / ``max_tokens_per_doc`` (each first / second text cut
            to its first N tokens before the pair is tokenized, 0: no cut) and, with
            ``LLM.score(chat_template=...)``, ``chat_template_kwargs`` (the template's
            variables); the engine refuses a request that still carries it.
        softmax: vLLM 0.10's reward-model field, its name of ``use_activation`` on the
            per-token ``encode`` task (here "token_classify": the head's softmax / sigmoid
            per token, False the raw logits); after construction ``use_activation`` and
            ``activation`` hold it too. The engine refuses it on every other task, as vLLM
            0.10 takes it on ``encode`` only.

    Raises:
        ValueError: from the constructor for ``dimensions`` < 1 or not an integer, an unknown
            ``task``, a ``second_segment_start`` < 0 or not an integer, or a ``normalize``
            that is not a bool (or is set for a task other than "embed"), an ``activation``
            / ``use_activation`` / ``softmax`` that is not a bool, or two of them set to
            different values (``normalize`` and ``use_activation`` included), or an
            ``extra_kwargs`` that is not a dict.
    """

    dimensions: int | None = None
    task: str = "embed"
    second_segment_start: int | None = None
    normalize: bool | None = None
    use_activation: bool | None = None
    activation: bool | None = None
    softmax: bool | None = None
    extra_kwargs: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        self._resolve_activation()
        if self.extra_kwargs is not None and not isinstance(self.extra_kwargs, dict):
            raise ValueError(f"PoolingParams.extra_kwargs={self.extra_kwargs!r} must be a dict "
                             "or None")
        d = self.dimensions
        if d is not None and (not isinstance(d, int) or isinstance(d, bool) or d < 1):
            raise ValueError(f"PoolingParams.dimensions={d!r} must be an integer >= 1")
        if self.task not in POOLING_TASKS:
            raise ValueError(f"PoolingParams.task={self.task!r} must be one of {POOLING_TASKS}")
        s = self.second_segment_start
        if s is not None and (not isinstance(s, int) or isinstance(s, bool) or s < 0):
            raise ValueError(f"PoolingParams.second_segment_start={s!r} must be an integer "
                             ">= 0")
        if self.normalize is not None:
            if not isinstance(self.normalize, bool):
                raise ValueError(f"PoolingParams.normalize={self.normalize!r} must be a bool "
                                 "or None")
            if self.task not in _EMBED_TASKS:
                raise ValueError(f"PoolingParams.normalize applies to embeddings only, not "
                                 f"task={self.task!r}")
            if self.use_activation not in (None, self.normalize):
                raise ValueError(f"PoolingParams.normalize={self.normalize!r} and "
                                 f"use_activation={self.use_activation!r} disagree (vLLM "
                                 "0.32's use_activation is normalize on embeddings: set one)")

    def _resolve_activation(self) -> None:
        """Check ``activation`` / ``use_activation`` / ``softmax`` and give the first two the
        one value set (``softmax`` stays as given: the engine checks its task).

        Raises:
            ValueError: for a value that is not a bool or None, or two different values.
        """
        names = ("activation", "use_activation", "softmax")
        for name in names:
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"PoolingParams.{name}={value!r} must be a bool or None")
        given = [(n, getattr(self, n)) for n in names if getattr(self, n) is not None]
        if len({v for _, v in given}) > 1:
            said = " and ".join(f"{n}={v!r}" for n, v in given)
            raise ValueError(f"PoolingParams.{said} disagree (activation and softmax are "
                             "vLLM 0.10's names of use_activation: set one)")
        self.use_activation = self.activation = given[0][1] if given else None

    def normalizes(self, model_default: bool) -> bool:
        """Whether an embedding (task "embed" / "token_embed") is L2-normalized:
        ``normalize``, else ``use_activation`` (vLLM 0.32's name), else ``model_default``
        (the model's pooling config)."""
        for value in (self.normalize, self.use_activation):
            if value is not None:
                return value
        return model_default

    @property
    def raw_logits(self) -> bool:
        """Whether a head task's logits are reported without their activation
        (``use_activation`` False)."""
        return self.use_activation is False

    @property
    def per_token(self) -> bool:
        """Whether the request reports one row per prompt token (``TOKEN_TASKS``): its
        prompt's every hidden state is needed, so none may come from the prefix cache."""
        return self.task in TOKEN_TASKS
