"""Encoder token classifiers (``task token_classify``): BERT and (XLM-)RoBERTa with their HF
``*ForTokenClassification`` head, for NER and tagging checkpoints (dslim/bert-base-NER,
xlm-roberta-large-finetuned-conll03-english, ...).

transformers builds them as the encoder without its pooler, dropout (the identity at
inference) and ``classifier``, one Linear [num_labels, hidden] (with bias) applied to every
token's final hidden state. The runner keeps every prompt token's row (``PoolerConfig("all")``)
and calls :meth:`score_head` on them; the softmax (sigmoid for one label) is its job
(``worker/pooling.py``), as for the decoder token classifiers (``models/llama.py``).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from kvflow.models.bert import BertModel
from kvflow.models.roberta import RobertaModel


def _token_classifier(encoder: type, skipped: tuple[str, ...]) -> type:
    """``encoder`` (BertModel or RobertaModel) + ``classifier`` on every token, its
    checkpoint tensors under ``skipped`` (pooler, LM head) not loaded."""

    class TokenClassifier(encoder):
        is_token_classifier: ClassVar[bool] = True
        skipped_prefixes: ClassVar[tuple[str, ...]] = skipped

        def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
            super().__init__(config, *args, **kwargs)
            self.classifier = nn.Linear(config.hidden_size, int(config.num_labels))

        def score_head(self, hidden: torch.Tensor) -> torch.Tensor:
            """[N, hidden] final hidden states, one row per token -> [N, num_labels] logits
            (no activation)."""
            return self.classifier(hidden)

    return TokenClassifier


class BertForTokenClassification(_token_classifier(BertModel, ("pooler.", "cls."))):
    """BERT encoder + ``classifier`` on every token: ``forward`` as BertModel.

    Raises:
        ValueError: as BertModel's constructor.
    """


class RobertaForTokenClassification(_token_classifier(RobertaModel, ("pooler.", "lm_head."))):
    """RoBERTa / XLM-RoBERTa encoder + ``classifier`` on every token: ``forward`` as
    RobertaModel.

    Raises:
        ValueError: as RobertaModel's constructor.
    """
