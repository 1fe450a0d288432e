"""How an embedding model turns hidden states into one vector: the task, the pooling and the
normalization, read from the model folder's sentence-transformers files.

sentence-transformers describes a model as a pipeline of modules (``modules.json``):
``Transformer`` (the network), ``Pooling`` (``1_Pooling/config.json``: CLS token, mean of the
tokens or last token) and optionally ``Normalize`` (L2). kvflow runs exactly that pipeline; a
folder asking for anything else (a ``Dense`` projection, max or weighted-mean pooling, pooling
that leaves out the instruction) is refused with the module's name rather than embedded
differently. Without those files an encoder (BERT) pools its CLS token and a decoder its last
token, both normalized (vLLM's defaults). The ``Transformer`` module's
``sentence_bert_config.json`` is honoured as vLLM does: ``max_seq_length`` caps the context
(sentence-transformers truncates there; kvflow refuses longer inputs, it never truncates) and
``do_lower_case`` lower-cases text inputs before tokenizing; the model's default prompt
(``config_sentence_transformers.json``: ``prompts[default_prompt_name]``) is put before each
text input, as ``SentenceTransformer.encode`` does.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

TASKS = ("generate", "embed", "score", "classify", "token_classify")
_KNOWN_MODULES = {"Transformer", "Pooling", "Normalize"}
# sentence-transformers < 6: one boolean per mode; >= 6: "pooling_mode": name
_POOLING_MODES = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean",
                  "pooling_mode_lasttoken": "last", "cls": "cls", "mean": "mean",
                  "lasttoken": "last"}


@dataclass(frozen=True)
class PoolerConfig:
    """One model's pooling.

    Attributes:
        pooling_type: "cls" (the first token's hidden state), "mean" (over the prompt's
            tokens), "last" (the last token's) or "all" (every token's: a token
            classifier).
        normalize: L2-normalize the vector (after any Matryoshka truncation).
        matryoshka_dimensions: the truncations the model was trained for (None: any
            ``dimensions`` up to the hidden size), when it supports them at all.
        supports_dimensions: whether a request may ask for fewer ``dimensions``.
        max_seq_length: the longest input in tokens the model was set up for
            (``sentence_bert_config.json``), None when the folder does not say.
        lowercase: lower-case text inputs before tokenizing (``do_lower_case``).
        prompt: text put before every text input (the default prompt), "" for none.
        task: "embed" (a vector per prompt), "score" (a cross-encoder: the model's
            ``score_head`` on the pooled state, then ``activation``) or "classify" (the same
            head, then a softmax over the classes, a sigmoid for one class) or
            "token_classify" (a ``*ForTokenClassification`` head on every prompt token, then
            the classify activation per token): the engine's task (``--task``, or what
            ``auto`` picked). An embed engine also serves vLLM's per-token "token_embed"
            (``other_tasks``).
        activation: the activation of ``task`` on a score or classify model's logits:
            "sigmoid" or "identity" (score,
            :func:`~kvflow.models.model_task.score_activation`), "softmax" or "sigmoid"
            (classify, :func:`~kvflow.models.model_task.classify_activation`); None for
            embeddings.
        other_tasks: the head tasks the engine serves besides ``task``, each with its
            activation (``(("classify", "softmax"),)``): a sequence classifier scores and
            classifies on one engine, scoring only with one label on a classify engine
            (:func:`~kvflow.models.model_task.model_task`), a decoder classifier gives every
            token's classes too (``token_classify``); ``(("token_embed", None),)`` for
            embeddings.
        num_labels: a score or classify model's outputs per prompt (its classifier's
            ``num_labels``); 0 for embeddings.
        labels: a classify model's class names by index (``config.id2label``, "LABEL_i"
            where it names none); () otherwise.
        use_activation: whether a head task's logits go through ``activation`` when the
            request does not say (``--pooler-config``'s ``use_activation``; an embedding's
            default is ``normalize``).
        dimensions: the Matryoshka ``dimensions`` of an embedding request that gives none
            (``--pooler-config``), None: the whole vector.
        logit_mean / logit_sigma: a head's logits become ``(logit - logit_mean) /
            logit_sigma`` before the activation (``--pooler-config``'s affine calibration;
            None: not subtracted / not divided).
    """

    pooling_type: str
    normalize: bool
    supports_dimensions: bool = False
    matryoshka_dimensions: tuple[int, ...] | None = None
    max_seq_length: int | None = None
    lowercase: bool = False
    prompt: str = ""
    task: str = "embed"
    activation: str | None = None
    num_labels: int = 0
    labels: tuple[str, ...] = ()
    other_tasks: tuple[tuple[str, str | None], ...] = ()
    use_activation: bool = True
    dimensions: int | None = None
    logit_mean: float | None = None
    logit_sigma: float | None = None

    @property
    def tasks(self) -> tuple[str, ...]:
        """Every pooling task the engine serves, its own ``task`` first."""
        return (self.task, *(name for name, _ in self.other_tasks))

    def activation_for(self, task: str) -> str | None:
        """The activation of a ``task`` request's logits (``activation`` for the engine's
        own task, the one ``other_tasks`` names for another).

        Raises:
            ValueError: for a task the engine does not serve.
        """
        if task == self.task:
            return self.activation
        for name, activation in self.other_tasks:
            if name == task:
                return activation
        raise ValueError(task_mismatch(self.task, task, self.num_labels))

    def cap_model_len(self, positions: int | None, requested: int | None) -> int | None:
        """The model's context limit ``positions`` capped at ``max_seq_length``.

        Raises:
            ValueError: if ``requested`` (``--max-model-len``) exceeds ``max_seq_length``.
        """
        if self.max_seq_length is None:
            return positions
        if requested is not None and requested > self.max_seq_length:
            raise ValueError(f"max_model_len={requested} exceeds the model's max_seq_length "
                             f"({self.max_seq_length}, sentence_bert_config.json): "
                             "sentence-transformers embeds at most that many tokens")
        return min(positions or self.max_seq_length, self.max_seq_length)

    def check_dimensions(self, dimensions: int | None, hidden_size: int) -> None:
        """Whether a request's ``dimensions`` can be honoured.

        Raises:
            ValueError: when the model does not support Matryoshka truncation, or for a size
                it was not trained for or above its hidden size.
        """
        if dimensions is None:
            return
        if not self.supports_dimensions:
            raise ValueError("dimensions: this model does not support Matryoshka "
                             "representations (set is_matryoshka or matryoshka_dimensions in "
                             "its config.json if it was trained for them)")
        allowed = self.matryoshka_dimensions
        if dimensions > hidden_size or (allowed and dimensions not in allowed):
            raise ValueError(f"dimensions={dimensions} is not supported by this model "
                             f"(choose {list(allowed) if allowed else f'1..{hidden_size}'})")


def _read_json(path: str) -> Any:
    with open(path) as f:
        return json.load(f)


def has_sentence_transformers_config(folder: str | None) -> bool:
    return folder is not None and os.path.isfile(os.path.join(folder, "modules.json"))


# an embedding engine gives every prompt token's hidden state too (vLLM's token_embed)
_TOKEN_EMBED = (("token_embed", None),)
def load_pooler_config(folder: str | None, hf_config: Any, is_encoder: bool) -> PoolerConfig:
    """The model's pooling: from sentence-transformers' files when the folder has them, else
    CLS (encoders) or last-token (decoders), normalized.

    Raises:
        ValueError: for a sentence-transformers module or pooling mode kvflow does not run.
    """
    supports, dims = _matryoshka(hf_config)
    if not has_sentence_transformers_config(folder):
        return PoolerConfig("cls" if is_encoder else "last", True, supports, dims,
                            other_tasks=_TOKEN_EMBED)
    pooling, normalize, text = None, False, {}
    for module in _read_json(os.path.join(folder, "modules.json")):
        kind = str(module.get("type", "")).rsplit(".", 1)[-1]
        if kind not in _KNOWN_MODULES:
            raise ValueError(f"sentence-transformers module {module.get('type')!r} "
                             f"({module.get('path')}) is not supported; kvflow runs "
                             "Transformer, Pooling and Normalize")
        if kind == "Pooling":
            pooling = _pooling_type(os.path.join(folder, module.get("path", ""), "config.json"))
        if kind == "Transformer":
            text = _text_config(os.path.join(folder, module.get("path", "")))
        normalize = normalize or kind == "Normalize"
    if pooling is None:
        pooling = "cls" if is_encoder else "last"
    return PoolerConfig(pooling, normalize, supports, dims, **text,
                        prompt=_default_prompt(folder), other_tasks=_TOKEN_EMBED)



def _default_prompt(folder: str) -> str:
    """The prompt ``SentenceTransformer.encode`` puts before every text by default:
    ``prompts[default_prompt_name]`` of ``config_sentence_transformers.json`` ("" without one).

    Raises:
        ValueError: for a ``default_prompt_name`` that names no prompt (sentence-transformers
            refuses to load such a model too).
    """
    path = os.path.join(folder, "config_sentence_transformers.json")
    if not os.path.isfile(path):
        return ""
    config = _read_json(path)
    name = config.get("default_prompt_name")
    if name is None:
        return ""
    prompts = config.get("prompts")
    prompt = prompts.get(name) if isinstance(prompts, dict) else None
    if prompt is None:
        raise ValueError(f"{path}: default_prompt_name={name!r} names no prompt in prompts")
    return str(prompt)


def _text_config(module_dir: str) -> dict[str, Any]:
    """``max_seq_length`` and ``lowercase`` from a Transformer module's
    ``sentence_bert_config.json`` (none when the file is absent or does not set them).

    Raises:
        ValueError: for a ``max_seq_length`` that is not a positive integer.
    """
    path = os.path.join(module_dir, "sentence_bert_config.json")
    if not os.path.isfile(path):
        return {}
    config = _read_json(path)
    length = config.get("max_seq_length")
    if length is not None and (not isinstance(length, int) or isinstance(length, bool)
                               or length < 1):
        raise ValueError(f"{path}: max_seq_length={length!r} must be a positive integer")
    return {"max_seq_length": length, "lowercase": bool(config.get("do_lower_case", False))}


def _pooling_type(path: str) -> str:
    """The one pooling mode a sentence-transformers Pooling config turns on.

    Raises:
        ValueError: for none or several modes, one kvflow does not run, or
            ``include_prompt: false``.
    """
    config = _read_json(path)
    mode = config.get("pooling_mode")
    on = [mode] if isinstance(mode, str) else \
        [k for k, v in config.items() if k.startswith("pooling_mode_") and v]
    if len(on) != 1 or on[0] not in _POOLING_MODES:
        raise ValueError(f"{path}: pooling modes {on} are not supported; kvflow pools with "
                         "exactly one of cls, mean, lasttoken")
    if config.get("include_prompt", True) is False:
        raise ValueError(f"{path}: include_prompt=false (pooling without the instruction) is "
                         "not supported")
    return _POOLING_MODES[on[0]]


def _matryoshka(hf_config: Any) -> tuple[bool, tuple[int, ...] | None]:
    """(supports Matryoshka truncation, the trained sizes or None), from the HF config's
    ``matryoshka_dimensions`` or ``is_matryoshka`` (vLLM's fields)."""
    dims = getattr(hf_config, "matryoshka_dimensions", None)
    if dims:
        return True, tuple(int(d) for d in dims)
    return bool(getattr(hf_config, "is_matryoshka", False)), None


TASK_VERB = {"generate": "generates text", "embed": "embeds", "score": "scores text pairs",
             "classify": "classifies texts", "token_classify": "classifies each prompt token"}
_TASK_USE = {"generate": "LLM.generate / LLM.chat or /v1/completions and "
                         "/v1/chat/completions",
             "embed": "LLM.embed or /v1/embeddings (or LLM.score, /v1/score and /v1/rerank "
                      "for cosine similarities)",
             "score": "LLM.score or /v1/score and /v1/rerank (or LLM.classify, /v1/classify)",
             "classify": "LLM.classify or /v1/classify",
             "token_classify": "LLM.encode(pooling_task='token_classify') or /pooling with "
                               "task token_classify"}


def task_mismatch(engine_task: str, asked: str, num_labels: int = 0) -> str:
    """The message refusing a request of task ``asked`` on an engine running
    ``engine_task`` (each a name of :data:`TASKS`): what the engine does, what to use instead
    and which task the request needs (a classify engine asked to score: that its classifier
    has ``num_labels`` != 1)."""
    if engine_task == "classify" and asked == "score":
        return (f"this engine runs task='classify' with num_labels={num_labels}: it scores "
                "text pairs (LLM.score, /v1/score, /v1/rerank) only with a one-label "
                "classifier (num_labels == 1, a relevance logit); serve the model with "
                f"task='score' for its {num_labels} values per pair, or use LLM.classify or "
                "/v1/classify")
    needs = {"score": "task='score' (a cross-encoder) or task='embed' (cosine similarity)",
             "classify": "task='classify' (a *ForSequenceClassification model)",
             "token_classify": "task='token_classify' (a *ForTokenClassification model; "
                               "a decoder *ForSequenceClassification serves it too)",
             "token_embed": "task='embed' (an embedding model)"}.get(
        asked, f"task={asked!r}")
    return (f"this engine runs task={engine_task!r} (it {TASK_VERB[engine_task]}): use "
            f"{_TASK_USE[engine_task]}; a {asked} request needs a model served with {needs}")
