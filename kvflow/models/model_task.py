"""Which task an engine runs (``--task``: ``auto`` picks by the architecture and the model
folder) and, for a classification head, its activations and class names; an embedding
model's pooling is :mod:`kvflow.models.pooling_config`'s."""

from __future__ import annotations

from typing import Any

from kvflow.models.pooler_overrides import FLAG, apply_pooler_overrides
from kvflow.models.pooling_config import (
    PoolerConfig,
    has_sentence_transformers_config,
    load_pooler_config,
)

# sentence-transformers' CrossEncoder activation_fn paths kvflow applies (config.json)
_ACTIVATIONS = {"torch.nn.modules.activation.Sigmoid": "sigmoid",
                "torch.nn.modules.linear.Identity": "identity", "torch.nn.Sigmoid": "sigmoid",
                "torch.nn.Identity": "identity"}


def resolve_task(requested: str, is_pooling_architecture: bool, folder: str | None,
                 is_cross_encoder: bool = False, is_token_classifier: bool = False,
                 flags: str = "--task") -> str:
    """``generate``, ``embed``, ``score`` or ``classify``: ``requested``, or for ``auto`` score
    for a sequence classifier (``*ForSequenceClassification``, encoder or decoder), embed when
    the architecture only embeds (an encoder such as BertModel, a decoder without LM head such
    as Qwen2Model) or the folder is a sentence-transformers model (``modules.json``).

    A token classifier (``*ForTokenClassification``) runs ``token_classify`` only.

    ``pooling`` and ``pooling_native`` (vLLM's ``--runner pooling`` with ``--convert auto``
    / ``none``, :attr:`ModelConfig.requested_task`): what ``auto`` picks when it pools; for a
    generating architecture ``pooling`` is ``embed`` (vLLM converts it so) and
    ``pooling_native`` is refused. ``flags``: the flags that asked for the task
    (:attr:`ModelConfig.task_flags`), named in a refusal when they are vLLM's
    ``--runner`` / ``--convert``.

    Raises:
        ValueError: for ``generate`` on an architecture without an LM head, ``score`` /
            ``classify`` on one without a classification head, ``token_classify`` on one
            without a token-classification head, another task on a sequence or token
            classifier, or ``pooling_native`` on a generating architecture.
    """
    if requested in ("pooling", "pooling_native"):
        return _pooling_runner_task(requested, is_pooling_architecture, folder,
                                    is_cross_encoder, is_token_classifier)
    asked = f"task={requested!r}" + ("" if flags == "--task" else f" ({flags})")
    if is_token_classifier or requested == "token_classify":
        return _token_classifier_task(requested, asked, is_token_classifier)
    if is_cross_encoder or requested in ("score", "classify"):
        return _sequence_classifier_task(requested, asked, is_cross_encoder)
    if requested == "auto":
        embed = is_pooling_architecture or has_sentence_transformers_config(folder)
        return "embed" if embed else "generate"
    if requested == "generate" and is_pooling_architecture:
        raise ValueError(f"{asked} needs a model with an LM head; this architecture only "
                         "embeds (use task='embed')")
    return requested


def _pooling_runner_task(requested: str, is_pooling_architecture: bool, folder: str | None,
                         is_cross_encoder: bool, is_token_classifier: bool) -> str:
    """vLLM's ``--runner pooling`` (``requested``: ``pooling`` or ``pooling_native``): the
    task ``auto`` picks when it pools, else ``embed`` for ``pooling`` (vLLM's conversion).

    Raises:
        ValueError: for ``pooling_native`` on a generating architecture.
    """
    task = resolve_task("auto", is_pooling_architecture, folder, is_cross_encoder,
                        is_token_classifier)
    if task != "generate":
        return task
    if requested == "pooling_native":
        raise ValueError("--runner pooling --convert none needs an architecture that "
                         "pools (an encoder, *ForSequenceClassification, ...); this one "
                         "generates text (--convert embed pools its last token)")
    return "embed"


def _token_classifier_task(requested: str, asked: str, is_token_classifier: bool) -> str:
    """``token_classify``, for a token classifier asked ``auto`` or ``token_classify``.

    Raises:
        ValueError: (``asked`` naming the request) for another task on a token classifier, or
            ``token_classify`` on an architecture without a token-classification head.
    """
    if not is_token_classifier:
        raise ValueError("task='token_classify' needs a token classifier ("
                         f"{', '.join(_TOKEN_CLASSIFIERS)}); this architecture has no "
                         "token-classification head")
    if requested not in ("auto", "token_classify"):
        raise ValueError(f"{asked}: this architecture is a token classifier "
                         "(a *ForTokenClassification head); it classifies every prompt "
                         "token (task='token_classify')")
    return "token_classify"


def _sequence_classifier_task(requested: str, asked: str, is_cross_encoder: bool) -> str:
    """``score`` or ``classify`` (``score`` for ``auto``) on a sequence classifier.

    Raises:
        ValueError: (``asked`` naming the request) for another task on a sequence classifier,
            or ``score`` / ``classify`` on an architecture without a classification head.
    """
    if not is_cross_encoder:
        raise ValueError(f"{asked} needs a sequence classifier ("
                         f"{', '.join(_CLASSIFIERS)}); this architecture has no "
                         "classification head")
    if requested not in ("auto", "score", "classify"):
        raise ValueError(f"{asked}: this architecture is a sequence classifier "
                         "(a *ForSequenceClassification head); it scores text pairs "
                         "(task='score') or classifies texts (task='classify')")
    return "score" if requested == "auto" else requested


_CLASSIFIERS = ("BertForSequenceClassification", "RobertaForSequenceClassification",
                "XLMRobertaForSequenceClassification", "LlamaForSequenceClassification",
                "MistralForSequenceClassification", "Qwen2ForSequenceClassification",
                "Qwen3ForSequenceClassification", "MixtralForSequenceClassification",
                "Qwen2MoeForSequenceClassification", "Qwen3MoeForSequenceClassification")


_TOKEN_CLASSIFIERS = ("BertForTokenClassification", "RobertaForTokenClassification",
                      "XLMRobertaForTokenClassification", "LlamaForTokenClassification",
                      "MistralForTokenClassification", "Qwen2ForTokenClassification",
                      "Qwen3ForTokenClassification")


def model_task(requested: str, hf_config: Any, folder: str | None, flags: str = "--task",
               overrides: dict[str, Any] | None = None) -> tuple[str, PoolerConfig | None]:
    """:func:`model_pooling` with ``overrides`` (``ModelConfig.pooler_config``, vLLM's
    ``--pooler-config``) applied to the pooling
    (:func:`kvflow.models.pooler_overrides.apply_pooler_overrides`).

    Raises:
        ValueError: see :func:`model_pooling`; for overrides on a generating engine (no
            pooling to override) or that the model's pooling cannot take.
    """
    task, pooler = model_pooling(requested, hf_config, folder, flags)
    if overrides and pooler is None:
        raise ValueError(f"{FLAG} overrides a pooling model's pooling; this engine generates "
                         "text (task='generate')")
    if pooler is not None:
        pooler = apply_pooler_overrides(pooler, overrides, int(hf_config.hidden_size))
    return task, pooler


def model_pooling(requested: str, hf_config: Any, folder: str | None, flags: str = "--task"
                  ) -> tuple[str, PoolerConfig | None]:
    """The task an engine runs and, for ``embed``, ``score``, ``classify`` and
    ``token_classify`` (a ``*ForTokenClassification`` model, every token pooled), the model's
    pooling (one place for the engine core, the runners and the API process to decide it
    alike). A sequence classifier pools its first token (CLS, an encoder) or its last (a
    decoder: the last token of the prompt, which has no padding), as transformers'
    ``*ForSequenceClassification`` do, and serves both head tasks where the model allows
    (``PoolerConfig.other_tasks``): a score engine classifies too, a classify engine scores
    when its classifier has one label (vLLM's rule for /score and /rerank); a decoder
    classifier also serves vLLM's ``token_classify`` (its head on every prompt token).

    Args:
        requested: ``ModelConfig.requested_task`` (auto | generate | embed | score |
            classify | token_classify | pooling | pooling_native).
        hf_config: the model's HF config.
        folder: the HF model folder (None for a GGUF file).
        flags: ``ModelConfig.task_flags``, the flags a refusal names.

    Raises:
        ValueError: see :func:`resolve_task` and :func:`load_pooler_config`.
    """
    from kvflow.models.registry import is_cross_encoder, is_token_classifier, model_traits

    pooling_only, encoder = model_traits(hf_config)
    task = resolve_task(requested, pooling_only, folder, is_cross_encoder(hf_config),
                        is_token_classifier(hf_config), flags)
    if task == "generate":
        return task, None
    if task == "token_classify":  # every prompt token's row through the head
        return task, _token_classifier_pooling(hf_config)
    if task not in ("score", "classify"):
        return task, load_pooler_config(folder, hf_config, encoder)
    return task, _sequence_classifier_pooling(task, hf_config, encoder)


def _token_classifier_pooling(hf_config: Any) -> PoolerConfig:
    """A ``*ForTokenClassification`` model's pooling: every prompt token's row through the
    head, with its activation and class labels."""
    num_labels = int(hf_config.num_labels)
    return PoolerConfig("all", False, task="token_classify",
                        activation=classify_activation(hf_config),
                        num_labels=num_labels, labels=class_labels(hf_config))


def _sequence_classifier_pooling(task: str, hf_config: Any, encoder: bool) -> PoolerConfig:
    """A sequence classifier's pooling for ``task`` (``score`` or ``classify``): its first
    token (``encoder``) or its last, with the other tasks its head serves and their
    activations (:func:`model_pooling`)."""
    # One head serves both (vLLM): classify always; score on a classify engine only with
    # one label (a relevance logit), on a score engine with any (CrossEncoder.predict's values).
    num_labels = int(hf_config.num_labels)
    served = ("score", "classify") if task == "score" or num_labels == 1 else ("classify",)
    if not encoder:
        # vLLM's token_classify on a sequence classifier: the score head on every prompt
        # token's row (a decoder's head is one Linear, so transformers' per-token logits
        # before its last-token pick; an encoder's head starts with the CLS pooler's dense
        # + tanh, which is no per-token head, so encoders do not serve it)
        served += ("token_classify",)
    activations = {t: score_activation(hf_config) if t == "score" else
                   classify_activation(hf_config) for t in served}
    return PoolerConfig("cls" if encoder else "last", False, task=task,
                        activation=activations[task], num_labels=num_labels,
                        labels=class_labels(hf_config),
                        other_tasks=tuple(kv for kv in activations.items() if kv[0] != task))


def classify_activation(hf_config: Any) -> str:
    """The activation of a classify (or token_classify) request's logits, as vLLM's
    ``get_act_fn`` and transformers' text-classification pipeline pick it from
    ``config.problem_type``: "identity" for ``regression`` (the logits are the values),
    "sigmoid" for ``multi_label_classification`` (each label on its own), else a softmax over
    two or more classes and the sigmoid of a single one (vLLM's ``PoolerClassify``; a
    softmax over one logit is always 1); an unset (or other) ``problem_type`` is the
    last case.
    """
    problem_type = getattr(hf_config, "problem_type", None)
    if problem_type == "regression":
        return "identity"
    if problem_type == "multi_label_classification":
        return "sigmoid"
    return "softmax" if int(hf_config.num_labels) >= 2 else "sigmoid"


def score_activation(hf_config: Any) -> str:
    """The activation sentence-transformers' ``CrossEncoder.predict`` applies to the logits
    (its ``get_default_activation_fn``, v4-v6): ``config.json``'s
    ``sentence_transformers.activation_fn`` (or the older ``sbert_ce_default_activation_function``)
    when set, else sigmoid for one label (``num_labels == 1``) and identity for several.

    Raises:
        ValueError: for an activation other than torch's Sigmoid or Identity.
    """
    st = getattr(hf_config, "sentence_transformers", None)
    path = st.get("activation_fn") if isinstance(st, dict) else None
    path = path or getattr(hf_config, "sbert_ce_default_activation_function", None)
    if path is None:
        return "sigmoid" if int(hf_config.num_labels) == 1 else "identity"
    if path not in _ACTIVATIONS:
        raise ValueError(f"config.json: cross-encoder activation_fn {path!r} is not supported; "
                         f"kvflow applies {sorted(_ACTIVATIONS)}")
    return _ACTIVATIONS[path]


def class_labels(hf_config: Any) -> tuple[str, ...]:
    """The ``num_labels`` class names by index: ``config.id2label`` (keys ints or digit
    strings, as config.json stores them), ``LABEL_i`` for an index it does not name
    (transformers' default names)."""
    names = getattr(hf_config, "id2label", None) or {}
    names = {int(k): str(v) for k, v in names.items()}
    return tuple(names.get(i, f"LABEL_{i}") for i in range(int(hf_config.num_labels)))
