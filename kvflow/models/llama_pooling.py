"""The Llama family's pooling variants, built from a causal-LM class (``LlamaForCausalLM`` or
a subclass): ``embedding_only`` (a bare-decoder checkpoint, hidden states for the runner to
pool), ``sequence_classifier`` (HF ``*ForSequenceClassification``: a ``score`` head on the
last token) and ``token_classifier`` (HF ``*ForTokenClassification``: a ``score`` head on
every token). Each drops the LM head; the runner pools and applies the activation
(``worker/pooling.py``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from kvflow.attention.layer import AttentionContext
from kvflow.distributed.parallel_state import ParallelState
from kvflow.models.classifier_from_tokens import load_score_from_lm_head
from kvflow.models.parallel_utils import PPMissingLayer

if TYPE_CHECKING:
    from kvflow.models.llama import LlamaForCausalLM


def embedding_only(cls: type[LlamaForCausalLM]) -> type[LlamaForCausalLM]:
    """``cls`` for a checkpoint of the bare decoder (HF ``LlamaModel``, ``Qwen2Model``, ...:
    tensors without the ``model.`` prefix, no LM head), as decoder-based embedding models
    ship: it only computes hidden states, for the runner to pool."""

    class EmbeddingOnly(cls):
        is_pooling_only: ClassVar[bool] = True

        def __init__(self, config: Any, ctx: AttentionContext,
                     parallel: ParallelState | None = None) -> None:
            super().__init__(config, ctx, parallel)
            self.lm_head = PPMissingLayer()

        def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
            return super().load_weights(
                (n if n.startswith(("model.", "lm_head.")) else f"model.{n}", t)
                for n, t in weights if not n.startswith("lm_head."))

    EmbeddingOnly.__name__ = EmbeddingOnly.__qualname__ = f"{cls.__name__}EmbeddingOnly"
    return EmbeddingOnly


def sequence_classifier(cls: type[LlamaForCausalLM]) -> type[LlamaForCausalLM]:
    """``cls`` as transformers' ``*ForSequenceClassification`` decoder (Llama, Mistral, Qwen2,
    Qwen3 and the sparse MoE Mixtral, Qwen2-MoE, Qwen3-MoE: ``model.*`` tensors and a ``score.weight`` [num_labels, hidden] head without bias,
    no LM head): it computes hidden states, the runner pools the prompt's last token and
    calls :meth:`score_head` on it (``task="score"`` or ``"classify"``). transformers pools
    the last non-pad token of a padded batch; a kvflow prompt carries no padding, so that is
    its last token (vLLM's rule too).

    A causal-LM checkpoint (``lm_head.weight``, no ``score.weight``) whose config names
    ``classifier_from_token`` (set with ``--hf-overrides``, e.g. Qwen3-Reranker) loads too: its
    score head is built from those tokens' LM-head rows (the tied embedding's when
    ``tie_word_embeddings``), see :mod:`kvflow.models.classifier_from_tokens`."""

    class SequenceClassifier(cls):
        is_pooling_only: ClassVar[bool] = True
        is_cross_encoder: ClassVar[bool] = True  # has a sequence-classification head
        builds_score_from_tokens: ClassVar[bool] = True  # classifier_from_token

        def __init__(self, config: Any, ctx: AttentionContext,
                     parallel: ParallelState | None = None) -> None:
            super().__init__(config, ctx, parallel)
            self.lm_head = PPMissingLayer()
            self.score = nn.Linear(config.hidden_size, int(config.num_labels), bias=False)

        def score_head(self, pooled: torch.Tensor) -> torch.Tensor:
            """[N, hidden] last-token hidden states (after the final norm) -> [N, num_labels]
            logits (no activation)."""
            return self.score(pooled)

        def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
            """As the causal LM's, without its LM head; a config with
            ``classifier_token_ids`` builds ``score.weight`` from the LM head's rows.

            Raises:
                ValueError: see :meth:`LlamaForCausalLM.load_weights`; a checkpoint without
                    the LM head (or tied embedding) such a config reads, or with a
                    ``score.weight`` of its own besides.
            """
            if getattr(self.config, "classifier_token_ids", None) is None:
                return super().load_weights((n, t) for n, t in weights
                                            if not n.startswith("lm_head."))
            return load_score_from_lm_head(super().load_weights, weights, self.config,
                                           self.score.weight)

    SequenceClassifier.__name__ = SequenceClassifier.__qualname__ = \
        f"{cls.__name__}SequenceClassifier"
    return SequenceClassifier


def token_classifier(cls: type[LlamaForCausalLM]) -> type[LlamaForCausalLM]:
    """``cls`` as transformers' ``*ForTokenClassification`` decoder (Llama, Mistral, Qwen2,
    Qwen3: ``model.*`` tensors and a ``score`` [num_labels, hidden] head, with a bias unless
    ``config.token_classification_bias`` is False, as transformers builds it; no LM head):
    it computes hidden states and the runner keeps every prompt token's row, then calls
    :meth:`score_head` on all of them (``task="token_classify"``, vLLM's per-token task).
    transformers' dropout before the head is the identity at inference."""

    class TokenClassifier(cls):
        is_pooling_only: ClassVar[bool] = True
        is_token_classifier: ClassVar[bool] = True  # a per-token classification head

        def __init__(self, config: Any, ctx: AttentionContext,
                     parallel: ParallelState | None = None) -> None:
            super().__init__(config, ctx, parallel)
            self.lm_head = PPMissingLayer()
            self.score = nn.Linear(config.hidden_size, int(config.num_labels),
                                   bias=bool(getattr(config, "token_classification_bias",
                                                     True)))

        def score_head(self, hidden: torch.Tensor) -> torch.Tensor:
            """[N, hidden] final hidden states (after the final norm), one row per token ->
            [N, num_labels] logits (no activation)."""
            return self.score(hidden)

        def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
            """As the causal LM's, without its LM head (``score.*`` are the head's tensors).

            Raises:
                ValueError: see :meth:`LlamaForCausalLM.load_weights`.
            """
            return super().load_weights((n, t) for n, t in weights
                                        if not n.startswith("lm_head."))

    TokenClassifier.__name__ = TokenClassifier.__qualname__ = \
        f"{cls.__name__}TokenClassifier"
    return TokenClassifier
