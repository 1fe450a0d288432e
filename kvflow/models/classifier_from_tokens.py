"""A causal-LM checkpoint served as a sequence classifier whose ``score`` head is built from
rows of its LM head (vLLM's online conversion of LLM-as-reranker models: Qwen3-Reranker,
mxbai-rerank-v2, bge-reranker-v2-gemma).

Such a reranker is trained to answer "yes" or "no" after a query/document prompt; its
relevance is the probability of "yes" among the two next tokens at the last position:

    softmax([z_no, z_yes])[1] = sigmoid(z_yes - z_no),   z_t = lm_head[t] . h_last

so one linear row ``lm_head[yes] - lm_head[no]`` on the last hidden state gives the logit and
the one-label classifier's sigmoid gives the score, without the [vocab, hidden] matmul
(https://huggingface.co/Qwen/Qwen3-Reranker-0.6B/discussions/3). The config, usually set
with ``--hf-overrides`` over the checkpoint's own ``*ForCausalLM`` config, says how (vLLM's
fields and rules):

- ``architectures``: a decoder ``*ForSequenceClassification`` (Llama, Mistral, Qwen2, Qwen3,
  Mixtral, Qwen2Moe, Qwen3Moe);
- ``classifier_from_token``: token strings of the vocabulary;
- ``method``: ``from_2_way_softmax`` (two tokens ``[false, true]``: one label, the row
  ``lm_head[true] - lm_head[false]``, computed in float32) or ``no_post_processing`` (one
  label per token, its ``lm_head`` row); ``is_original_qwen3_reranker: true`` means
  ``from_2_way_softmax`` (vLLM reads it for Qwen3; kvflow for each of these families).

The tied case (``tie_word_embeddings``) takes the rows of ``model.embed_tokens.weight``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

METHODS = ("from_2_way_softmax", "no_post_processing")
_HOW = ("e.g. --hf-overrides '{\"architectures\": [\"Qwen3ForSequenceClassification\"], "
        "\"classifier_from_token\": [\"no\", \"yes\"], \"is_original_qwen3_reranker\": true}'")


def classifier_method(hf_config: Any) -> str | None:
    """The config's conversion method (module docstring), or None when the checkpoint has a
    ``score`` head of its own (no ``classifier_from_token``, ``method`` or
    ``is_original_qwen3_reranker``).

    Raises:
        ValueError: naming the field: an unknown ``method``; ``classifier_from_token``
            missing, not a non-empty list of strings, or without a ``method``; two tokens
            not given for ``from_2_way_softmax``.
    """
    tokens = getattr(hf_config, "classifier_from_token", None)
    method = getattr(hf_config, "method", None)
    if getattr(hf_config, "is_original_qwen3_reranker", False):
        method = method or "from_2_way_softmax"
    if tokens is None and method is None:
        return None
    if method is None:
        raise ValueError(f"classifier_from_token={tokens!r} needs a \"method\" saying how its "
                         f"LM-head rows become the score head: one of {list(METHODS)} (or "
                         f"\"is_original_qwen3_reranker\": true), {_HOW}")
    if method not in METHODS:
        raise ValueError(f"method={method!r} is not a classifier conversion kvflow knows; "
                         f"choose one of {list(METHODS)}")
    if not (isinstance(tokens, list) and tokens and all(isinstance(t, str) for t in tokens)):
        raise ValueError(f"method={method!r} needs classifier_from_token, a list of token "
                         f"strings, got {tokens!r}; {_HOW}")
    if method == "from_2_way_softmax" and len(tokens) != 2:
        raise ValueError(f"method='from_2_way_softmax' (or is_original_qwen3_reranker) takes "
                         f"two tokens [false, true] in classifier_from_token, got {tokens!r}")
    return method


def resolve_classifier_tokens(hf_config: Any, load_tokenizer: Callable[[], Any]) -> None:
    """For a config that builds its score head from LM-head rows (:func:`classifier_method`),
    set what the model and the engine read: ``classifier_token_ids`` (the tokens' ids, in
    order) and ``num_labels`` (1 for ``from_2_way_softmax``, else one per token), as vLLM
    does before it loads the model. Other configs are left as they are.

    Args:
        hf_config: the model's HF config (overrides merged); updated in place.
        load_tokenizer: returns the model's tokenizer (called only for such a config).

    Raises:
        ValueError: see :func:`classifier_method`; an architecture that is not a decoder
            ``*ForSequenceClassification``; a token that is not one token of the vocabulary
            (naming it); no tokenizer to look the tokens up in.
    """
    from kvflow.models.registry import get_model_class

    method = classifier_method(hf_config)
    if method is None:
        return
    arches = getattr(hf_config, "architectures", None)
    if not getattr(get_model_class(arches), "builds_score_from_tokens", False):
        raise ValueError(f"classifier_from_token builds a sequence classifier's score head, "
                         f"but the model's architectures are {arches}: add \"architectures\": "
                         "[\"<Family>ForSequenceClassification\"] (Llama, Mistral, Qwen2, "
                         "Qwen3, Mixtral, Qwen2Moe, Qwen3Moe) to the overrides")
    tokenizer = load_tokenizer()
    if tokenizer is None:
        raise ValueError("classifier_from_token needs the model's tokenizer to find its "
                         "tokens (skip_tokenizer_init is set)")
    ids = []
    for token in hf_config.classifier_from_token:
        token_id = tokenizer.convert_tokens_to_ids(token)
        if token_id is None or tokenizer.convert_ids_to_tokens(token_id) != token:
            raise ValueError(f"classifier_from_token: {token!r} is not a token of the model's "
                             "vocabulary (give tokens as the tokenizer spells them, e.g. 'yes' "
                             "or 'Ġyes' for a byte-level BPE's ' yes')")
        ids.append(int(token_id))
    hf_config.classifier_token_ids = ids
    hf_config.num_labels = 1 if method == "from_2_way_softmax" else len(ids)


def score_weight_from_lm_head(head: torch.Tensor, hf_config: Any) -> torch.Tensor:
    """The score head [num_labels, hidden] from the LM head (or tied embedding) [vocab,
    hidden]: ``head[true] - head[false]`` in float32 for ``from_2_way_softmax``, the tokens'
    rows for ``no_post_processing`` (``hf_config.classifier_token_ids`` from
    :func:`resolve_classifier_tokens`); in ``head``'s dtype.

    Raises:
        ValueError: for a token id outside ``head``'s rows.
    """
    ids = list(hf_config.classifier_token_ids)
    if max(ids) >= head.shape[0]:
        raise ValueError(f"classifier_from_token ids {ids} exceed the LM head's {head.shape[0]} "
                         "rows")
    if classifier_method(hf_config) == "from_2_way_softmax":
        false_id, true_id = ids
        return (head[true_id].float() - head[false_id].float()).unsqueeze(0).to(head.dtype)
    return head[ids].clone()


def load_score_from_lm_head(load: Callable[[Iterable[tuple[str, torch.Tensor]]], set[str]],
                            weights: Iterable[tuple[str, torch.Tensor]], hf_config: Any,
                            score: torch.Tensor) -> set[str]:
    """Load a causal-LM checkpoint into a sequence classifier whose config names
    ``classifier_token_ids``: ``load`` (the model's own loader) gets every tensor but the LM
    head, and ``score`` ([num_labels, hidden]) is filled from the LM head's rows
    (:func:`score_weight_from_lm_head`; the tied embedding's with ``tie_word_embeddings``).

    Returns:
        the parameter names loaded, ``score.weight`` included.

    Raises:
        ValueError: for a checkpoint without the LM head (or tied embedding) it reads, or with
            a ``score.weight`` of its own besides; the loader's own errors.
    """
    tied = getattr(hf_config, "tie_word_embeddings", False)
    source = "model.embed_tokens.weight" if tied else "lm_head.weight"
    found: dict[str, torch.Tensor] = {}

    def keep_head(items: Iterable[tuple[str, torch.Tensor]]
                  ) -> Iterable[tuple[str, torch.Tensor]]:
        for name, tensor in items:
            if name in (source, "score.weight"):
                found[name] = tensor
            if not name.startswith("lm_head.") and name != "score.weight":
                yield name, tensor

    loaded = load(keep_head(weights))
    if "score.weight" in found or source not in found:
        raise ValueError(
            f"classifier_from_token builds the score head from {source}; the checkpoint "
            f"{'has a score.weight of its own' if source in found else 'lacks it'} (leave "
            "classifier_from_token / method / is_original_qwen3_reranker out for a "
            "checkpoint converted to sequence classification)")
    with torch.no_grad():
        score.copy_(score_weight_from_lm_head(found[source], hf_config))
    return loaded | {"score.weight"}
